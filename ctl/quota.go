package ctl

import (
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/fdpass"
)

// Limits bounds what peers may hold in the daemon, per uid or in total.
// A request that would exceed a limit is refused with EAGAIN.
type Limits struct {
	// Conns is the number of open connections.
	Conns int
	// Parked is the number of all_gather and broadcast requests waiting
	// for their group to fill.
	Parked int
	// FDs is the number of descriptors held for peers: those received
	// with requests and not yet closed, plus backendFDs for each export
	// or import the Backend is serving.
	FDs int
}

// defaultTotal is the limits for all users together. Of each, root keeps
// an eighth (rootReserve) and one uid other than root may hold an eighth
// of the rest (perUIDCap): with these defaults 448 connections, 280
// waiting requests and 896 descriptors, so that a group of 253 ranks (the
// largest) fits one uid's connections and waiting requests (252 wait).
var defaultTotal = Limits{Conns: 4096, Parked: 2560, FDs: 8192}

const (
	// backendFDs is what a Backend call may hold at once, beyond the
	// descriptor it was given, counted against the peer's FDs.
	backendFDs = 4
	// maxTurningAway bounds the connections being answered a refusal
	// (Server.turnAway); more are closed without a reply.
	maxTurningAway = 64
)

// withDefaults returns l with its zero fields taken from d.
func (l Limits) withDefaults(d Limits) Limits {
	if l.Conns <= 0 {
		l.Conns = d.Conns
	}
	if l.Parked <= 0 {
		l.Parked = d.Parked
	}
	if l.FDs <= 0 {
		l.FDs = d.FDs
	}
	return l
}

// capped returns l with no field above the same field of c.
func (l Limits) capped(c Limits) Limits {
	return Limits{Conns: min(l.Conns, c.Conns), Parked: min(l.Parked, c.Parked), FDs: min(l.FDs, c.FDs)}
}

// fitTotal lowers total so that the descriptors the socket may hold
// (connections, held descriptors, connections being turned away) stay
// within budget, keeping the ratio of connections to descriptors.
func fitTotal(total Limits, budget int) Limits {
	budget -= maxTurningAway
	if n := total.Conns + total.FDs; n > budget {
		total.Conns = max(1, total.Conns*budget/n)
		total.FDs = max(backendFDs+1, budget-total.Conns)
	}
	total.Parked = min(total.Parked, total.Conns)
	return total
}

// rootReserve is the part of total that only root may take: an eighth.
func rootReserve(total Limits) Limits {
	return Limits{Conns: total.Conns / 8, Parked: total.Parked / 8, FDs: total.FDs / 8}
}

// perUIDCap is the most one uid other than root may hold: an eighth of
// what total leaves once root's reserve is set aside, so that at least
// eight users fit; never below one, nor below what one export needs.
func perUIDCap(total Limits) Limits {
	shared := total.minus(rootReserve(total))
	return Limits{Conns: max(1, shared.Conns/8), Parked: max(1, shared.Parked/8), FDs: max(backendFDs+1, shared.FDs/8)}
}

// fdBudget is half the process's limit on open descriptors: the other
// half stays for FUSE.
func fdBudget() int {
	var r unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &r); err != nil {
		return 1024 / 2
	}
	return int(min(r.Cur, 1<<30) / 2)
}

func (l Limits) plus(d Limits) Limits {
	return Limits{Conns: l.Conns + d.Conns, Parked: l.Parked + d.Parked, FDs: l.FDs + d.FDs}
}

func (l Limits) minus(d Limits) Limits {
	return Limits{Conns: l.Conns - d.Conns, Parked: l.Parked - d.Parked, FDs: l.FDs - d.FDs}
}

// exceeds names the first field of l above max's, and max's value.
func (l Limits) exceeds(max Limits) (string, int) {
	switch {
	case l.Conns > max.Conns:
		return "connections", max.Conns
	case l.Parked > max.Parked:
		return "waiting collective requests", max.Parked
	case l.FDs > max.FDs:
		return "descriptors held", max.FDs
	}
	return "", 0
}

// quota counts what each uid holds against the limits. Root is bound by
// total alone; other uids by perUID each and, together, by total less
// rootReserve, so that they can never shut root out.
type quota struct {
	perUID, total Limits
	shared        Limits // total less rootReserve: for uids other than root

	// closing tracks the goroutines closing received descriptors
	// (release): a close may block for as long as the file's filesystem
	// wants, so it never runs under a lock or in a request's goroutine.
	closing sync.WaitGroup

	mu     sync.Mutex
	used   map[uint32]Limits
	sum    Limits
	others Limits         // the part of sum held by uids other than root
	owner  map[int]uint32 // received descriptors held: whose FDs they count in
}

func newQuota(perUID, total Limits) *quota {
	return &quota{perUID: perUID, total: total, shared: total.minus(rootReserve(total)),
		used: make(map[uint32]Limits), owner: make(map[int]uint32)}
}

// take counts d more for uid, or refuses with EAGAIN if that exceeds a
// limit.
func (q *quota) take(uid uint32, d Limits) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	u, sum, others := q.used[uid].plus(d), q.sum.plus(d), q.others
	var what, scope string
	var limit int
	if uid != 0 {
		others = others.plus(d)
		if what, limit = u.exceeds(q.perUID); what != "" {
			scope = "per uid"
		} else if what, limit = others.exceeds(q.shared); what != "" {
			scope = "for users other than root"
		}
	}
	if what == "" {
		what, limit = sum.exceeds(q.total)
		scope = "for all users"
	}
	if what != "" {
		return protoErrorf(syscall.EAGAIN, "uid %d reached the limit of %d %s %s", uid, limit, what, scope)
	}
	q.used[uid], q.sum, q.others = u, sum, others
	return nil
}

// give uncounts d for uid.
func (q *quota) give(uid uint32, d Limits) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.giveLocked(uid, d)
}

func (q *quota) giveLocked(uid uint32, d Limits) {
	if u := q.used[uid].minus(d); u == (Limits{}) {
		delete(q.used, uid)
	} else {
		q.used[uid] = u
	}
	q.sum = q.sum.minus(d)
	if uid != 0 {
		q.others = q.others.minus(d)
	}
}

// adopt counts received descriptors against uid's FDs until release
// closes them. If they exceed a limit it closes them and refuses.
func (q *quota) adopt(uid uint32, fds []int) error {
	if len(fds) == 0 {
		return nil
	}
	if err := q.take(uid, Limits{FDs: len(fds)}); err != nil {
		fdpass.Close(fds)
		return err
	}
	q.mu.Lock()
	for _, fd := range fds {
		q.owner[fd] = uid
	}
	q.mu.Unlock()
	return nil
}

// release closes adopted descriptors (negative ones are skipped), each
// on a goroutine of its own that q.closing tracks, and uncounts them once
// closed: the close of a descriptor a peer sent may block (a file on a
// FUSE mount of the peer's whose FLUSH never answers), so no lock is held
// and no caller waits for it. Until it returns, the descriptor counts in
// its owner's FDs, which bounds the closes a uid can leave hanging.
func (q *quota) release(fds ...int) {
	for _, fd := range fds {
		if fd >= 0 {
			q.closeLater(fd, func() { unix.Close(fd) })
		}
	}
}

// releaseFile is release for f, the adopted descriptor fd made an
// *os.File.
func (q *quota) releaseFile(fd int, f *os.File) {
	q.closeLater(fd, func() { f.Close() })
}

// closeLater forgets fd as an adopted number, then runs close on a
// tracked goroutine and uncounts fd from its owner once close returns.
func (q *quota) closeLater(fd int, closeFD func()) {
	q.mu.Lock()
	uid, owned := q.owner[fd]
	delete(q.owner, fd) // the number is free once close starts
	q.closing.Add(1)
	q.mu.Unlock()
	go func() {
		defer q.closing.Done()
		closeFD()
		if owned {
			q.give(uid, Limits{FDs: 1})
		}
	}()
}

// waitClosing waits for the closes that release started, at most d; it
// reports whether they all returned.
func (q *quota) waitClosing(d time.Duration) bool {
	done := make(chan struct{})
	go func() {
		q.closing.Wait()
		close(done)
	}()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}
