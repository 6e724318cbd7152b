package fs

import (
	"errors"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/ledger"
	"tensorfs/procfs"
)

// pidfds holds the pidfds on which the watches of UNLINK segments
// (awaitUnmapped) wait for the exits of the processes that map them: one
// per process at most, shared by every watch that waits for it, and
// counted against the process's owner (its real uid) in the descriptor
// budget until the last watch lets go. A pidfd is a descriptor like the
// others that budget counts, out of the same open-file limit, so it is
// bounded with them: a user whose processes map many segments takes
// her own share, not the descriptors FUSE needs for everyone else.
type pidfds struct {
	mu sync.Mutex // protects m; a leaf
	m  map[uint32]*pidfd
}

// pidfd is one process's pidfd, the budget and owner it counts against,
// and how many watches hold it.
type pidfd struct {
	fd   int
	held *ledger.Row
	uid  uint32
	refs int
}

// get returns a pidfd of process pid for one more watch: the one a watch
// holds already, or a new one charged to the process's owner in held.
// It fails when the process has exited, and, as held.Take does (EMFILE,
// ENFILE), when its owner holds her share.
func (p *pidfds) get(pid uint32, held *ledger.Row) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if e := p.m[pid]; e != nil {
		e.refs++
		return e.fd, nil
	}
	st, err := procfs.ReadStatus(int(pid))
	if err != nil {
		return -1, err
	}
	uid := st.Uid[0]
	if err := held.Take(uid, 1); err != nil {
		return -1, err
	}
	fd, err := unix.PidfdOpen(int(pid), 0)
	if err != nil {
		held.Give(uid, 1)
		return -1, err
	}
	if p.m == nil {
		p.m = map[uint32]*pidfd{}
	}
	p.m[pid] = &pidfd{fd: fd, held: held, uid: uid, refs: 1}
	return fd, nil
}

// put lets go of a watch's pidfd of process pid: the last closes it and
// gives it back to its owner's budget.
func (p *pidfds) put(pid uint32) {
	p.mu.Lock()
	defer p.mu.Unlock()
	e := p.m[pid]
	if e == nil {
		return
	}
	if e.refs--; e.refs > 0 {
		return
	}
	delete(p.m, pid)
	unix.Close(e.fd)
	e.held.Give(e.uid, 1)
}

// pidWatch is what one watch waits on in its epoll instance: the shared
// pidfds of the processes that map its segment.
type pidWatch struct {
	fsys *filesystem
	rc   syscall.RawConn // the watch's epoll instance
	fds  map[uint32]int  // the pidfds held, by process
	// none are the processes this watch polls, without a pidfd: those
	// that exited (should /proc lag) and those whose owner is at her
	// bound of descriptors.
	none   map[uint32]bool
	warned bool // the watch logged that it polls
}

// follow makes the watch wait on the pidfds of pids and of no other
// process; false when its epoll instance was closed.
func (w *pidWatch) follow(pids map[uint32]bool) bool {
	for pid := range w.fds {
		if !pids[pid] { // unmapped, alive
			w.drop(pid)
		}
	}
	for pid := range pids {
		if _, ok := w.fds[pid]; ok || w.none[pid] {
			continue
		}
		fd, err := w.fsys.pidfds.get(pid, w.fsys.handles)
		if err != nil {
			w.none[pid] = true
			if (errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE)) && !w.warned {
				w.warned = true
				w.fsys.log.Info("an UNLINK segment's watch polls for the exits of processes that map it, without pidfds", "pid", pid, "err", err)
			}
			continue // otherwise gone already: the next check sees it
		}
		var cerr error
		err = w.rc.Control(func(e uintptr) {
			cerr = unix.EpollCtl(int(e), unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)})
		})
		if err != nil || cerr != nil {
			w.fsys.pidfds.put(pid)
			if err != nil {
				return false
			}
			w.none[pid] = true
			continue
		}
		w.fds[pid] = fd
	}
	return true
}

// exited records that the process whose pidfd is fd has exited.
func (w *pidWatch) exited(fd int) {
	for pid, f := range w.fds {
		if f == fd {
			w.none[pid] = true
			w.drop(pid)
		}
	}
}

// drop takes process pid's pidfd out of the watch's epoll instance and
// lets go of it.
func (w *pidWatch) drop(pid uint32) {
	fd := w.fds[pid]
	w.rc.Control(func(e uintptr) { unix.EpollCtl(int(e), unix.EPOLL_CTL_DEL, fd, nil) })
	w.fsys.pidfds.put(pid)
	delete(w.fds, pid)
}

// releaseAll lets go of every pidfd the watch holds.
func (w *pidWatch) releaseAll() {
	for pid := range w.fds {
		w.drop(pid)
	}
}
