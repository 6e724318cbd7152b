package fs

import (
	"context"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ledger"
)

// newHandleBudget sizes the budget of the descriptors requests make the
// daemon hold (one per open segment or directory, import, watch, or
// process whose exit watches wait for) from the daemon's open-file
// limit: half of it, less a reserve for the directory cache and the
// daemon's own files; a sixteenth of that for one user.
func newHandleBudget(l *ledger.Ledger) *ledger.Row {
	limit := 1024
	var r unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &r) == nil {
		limit = int(min(r.Cur, 1<<30))
	}
	total := max(limit/2-256-defaultDirFds, 64)
	return l.Row(ledger.Spec{Name: "descriptors (open segments and directories, imports, watches, pidfds)", Unit: "descriptor",
		PerUID: int64(total / 16), Total: int64(total), Over: syscall.EMFILE, Full: syscall.ENFILE})
}

// blockedThreads bounds the goroutines the daemon starts that may block
// in the kernel on a user's behalf (a call a user's FUSE server may leave
// unanswered), each of which holds an OS thread while it waits: far
// below Go's limit of 10000 threads, so that no user can make the daemon
// run out of them.
const blockedThreads = 2048

// newThreadBudget bounds those goroutines: blockedThreads in all, a
// sixteenth of it for one user.
func newThreadBudget(l *ledger.Ledger) *ledger.Row {
	return l.Row(ledger.Spec{Name: "threads that may block in the kernel for requests", Unit: "thread",
		PerUID: blockedThreads / 16, Total: blockedThreads, Over: syscall.EMFILE, Full: syscall.ENFILE})
}

// openAdopted marks the open flags of a handle an earlier daemon gave
// out, which HandoverFS.Adopt opens again. The kernel clears O_NOCTTY
// from every OPEN, OPENDIR and CREATE it sends (fuse_send_open,
// fuse_create_open), so no request carries it.
const openAdopted = unix.O_NOCTTY

// walkFor walks the directory open at dirfd as alloc.Walk does, for uid,
// who is charged a descriptor for each level the walk is in: a chain of
// MaxDepth directories would otherwise hold that many of the daemon's
// descriptors per request, charged to no one.
func (fsys *filesystem) walkFor(uid uint32, dirfd int, fn func(dirfd int, name, rel string, st *unix.Stat_t) error) error {
	return alloc.WalkHeld(dirfd, func() error { return fsys.handles.Take(uid, 1) }, func() { fsys.handles.Give(uid, 1) }, fn)
}

// oneAtATime runs what a uid asks for one request at a time, each uid on
// its own; the zero value is ready.
type oneAtATime struct{ locks sync.Map } // uid → *sync.Mutex

// lock waits for uid's turn and returns what ends it.
func (o *oneAtATime) lock(uid uint32) (unlock func()) {
	m, _ := o.locks.LoadOrStore(uid, new(sync.Mutex))
	mu := m.(*sync.Mutex)
	mu.Lock()
	return mu.Unlock
}

// takeHandle takes a handle from the caller's budget for open, which
// makes one (newHandle) or fails; a failed open gives it back. A handle
// adopted from an earlier daemon (an open whose flags have openAdopted)
// is charged whatever the bound: the kernel holds it already, and its
// opener past her share gets EMFILE for new ones until under.
func (fsys *filesystem) takeHandle(ctx context.Context, adopted bool, open func() error) error {
	uid := caller(ctx).Uid
	if adopted {
		fsys.handles.Add(uid, 1)
	} else if err := fsys.handles.Take(uid, 1); err != nil {
		return err
	}
	err := open()
	if err != nil {
		fsys.handles.Give(uid, 1)
	}
	return err
}
