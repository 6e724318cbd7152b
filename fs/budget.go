package fs

import (
	"context"
	"fmt"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// budget bounds something each user can make the daemon hold, per uid
// and in total, so that no user can take what serves everyone else: the
// backing descriptors of open segments and directories (one each), of
// imports, of watches and the pidfds they share (the control socket has
// the other half of the daemon's open-file limit, package ctl), GPU
// consumer counters, and threads that may block in the kernel. Root is bound by the total only; an eighth of it is
// root's alone, so that users other than root, however many, never take
// all of it.
type budget struct {
	// what names the things counted, in refusals ("open segments").
	what          string
	perUID, total int
	shared        int // total less root's eighth: for users other than root

	mu     sync.Mutex
	used   map[uint32]int
	all    int
	others int // the part of all held by users other than root
}

// newBudget bounds what: perUID for one user, total for all, total less
// an eighth for all users but root.
func newBudget(what string, perUID, total int) *budget {
	return &budget{what: what, perUID: perUID, total: total, shared: total - total/8, used: map[uint32]int{}}
}

// newHandleBudget sizes the budget of the descriptors requests make the
// daemon hold (one per open segment or directory, import, watch, or
// process whose exit watches wait for) from the daemon's open-file
// limit: half of it, less a reserve for the directory cache and the
// daemon's own files; a sixteenth of that for one user.
func newHandleBudget() *budget {
	limit := 1024
	var r unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &r) == nil {
		limit = int(min(r.Cur, 1<<30))
	}
	total := max(limit/2-256-defaultDirFds, 64)
	return newBudget("descriptors (open segments and directories, imports, watches, pidfds)", total/16, total)
}

// blockedThreads bounds the goroutines the daemon starts that may block
// in the kernel on a user's behalf (a call a user's FUSE server may leave
// unanswered), each of which holds an OS thread while it waits: far
// below Go's limit of 10000 threads, so that no user can make the daemon
// run out of them.
const blockedThreads = 2048

// newThreadBudget bounds those goroutines: blockedThreads in all, a
// sixteenth of it for one user.
func newThreadBudget() *budget {
	return newBudget("threads that may block in the kernel for requests", blockedThreads/16, blockedThreads)
}

// take counts a new one of uid, or refuses it: EMFILE when uid holds its
// share, ENFILE when the daemon holds its total or, for a uid other than
// root, when such users hold all but root's reserve.
func (b *budget) take(uid uint32) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case b.all >= b.total:
		return fmt.Errorf("%w: the daemon holds %d %s, the most it keeps at once", syscall.ENFILE, b.all, b.what)
	case uid != 0 && b.used[uid] >= b.perUID:
		return fmt.Errorf("%w: uid %d holds %d %s, the most one user may", syscall.EMFILE, uid, b.perUID, b.what)
	case uid != 0 && b.others >= b.shared:
		return fmt.Errorf("%w: users other than root hold %d %s, the most they may together (the rest is root's)", syscall.ENFILE, b.others, b.what)
	}
	b.countLocked(uid)
	return nil
}

// add counts one of uid that the daemon holds already (restored at
// mount), whatever the bounds.
func (b *budget) add(uid uint32) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.countLocked(uid)
}

func (b *budget) countLocked(uid uint32) {
	b.used[uid]++
	b.all++
	if uid != 0 {
		b.others++
	}
}

// give returns one of uid.
func (b *budget) give(uid uint32) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.used[uid]--; b.used[uid] <= 0 {
		delete(b.used, uid)
	}
	b.all--
	if uid != 0 {
		b.others--
	}
}

// takeHandle takes a handle from the caller's budget for open, which
// makes one (newHandle) or fails; a failed open gives it back.
func (fsys *filesystem) takeHandle(ctx context.Context, open func() error) error {
	uid := caller(ctx).Uid
	if err := fsys.handles.take(uid); err != nil {
		return err
	}
	err := open()
	if err != nil {
		fsys.handles.give(uid)
	}
	return err
}
