package ctl

import (
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/fdpass"
	"tensorfs/ledger"
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
// an eighth (ledger.Row.Reserve) and one uid other than root may hold an eighth
// of the rest (perUIDCap): with these defaults 448 connections, 280
// waiting requests and 896 descriptors, so that a group of 253 ranks (the
// largest) fits one uid's connections and waiting requests (252 wait).
var defaultTotal = Limits{Conns: 4096, Parked: 2560, FDs: 8192}

const (
	// backendFDs is what a Backend call may hold at once, beyond the
	// descriptor it was given, counted against the peer's FDs.
	backendFDs = 4
	// maxClosers bounds the closers of a socket whose daemon gave it no
	// threads row (Config.Threads).
	maxClosers = 2048
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

// perUIDCap is the most one uid other than root may hold: an eighth of
// what total leaves once root's reserve is set aside, so that at least
// eight users fit; never below one, nor below what one export needs.
func perUIDCap(total Limits) Limits {
	share := func(n int) int { return int(ledger.Share(int64(n))) }
	return Limits{Conns: max(1, share(total.Conns)), Parked: max(1, share(total.Parked)), FDs: max(backendFDs+1, share(total.FDs))}
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

// quota counts what each uid holds against the limits, as three rows of
// the daemon's ledger (package ledger): connections, waiting requests and
// descriptors. Root is bound by total alone; other uids by perUID each
// and, together, by total less root's eighth, so that they can never shut
// root out.
type quota struct {
	conns, parked, fds *ledger.Row
	// threads counts the closers (closeAs): goroutines that may block in
	// the kernel, per uid.
	threads *ledger.Row

	mu sync.Mutex
	// closing counts the closes of received descriptors (release) not
	// yet returned, and drained is closed whenever it is zero: a close
	// may block for as long as the file's filesystem wants, so it never
	// runs under a lock or in a request's goroutine.
	closing int
	drained chan struct{}
	owner   map[int]uint32      // received descriptors held: whose FDs they count in
	queued  map[uint32][]func() // closes waiting for one of their uid's closers
	closers map[uint32]int      // each uid's closers running
}

// newQuota makes the socket's rows in l; threads is the daemon's row of
// goroutines that may block for a user, or nil for one of the socket's
// own.
func newQuota(l *ledger.Ledger, threads *ledger.Row, perUID, total Limits) *quota {
	row := func(name, unit string, perUID, total int) *ledger.Row {
		return l.Row(ledger.Spec{Name: name, Unit: unit, PerUID: int64(perUID), Total: int64(total)})
	}
	if threads == nil {
		threads = row("threads that may block in the kernel for requests", "thread", maxClosers/16, maxClosers)
	}
	return &quota{
		conns:   row("connections", "connection", perUID.Conns, total.Conns),
		parked:  row("waiting collective requests", "request", perUID.Parked, total.Parked),
		fds:     row("socket descriptors", "descriptor", perUID.FDs, total.FDs),
		threads: threads,
		owner:   make(map[int]uint32),
		queued:  make(map[uint32][]func()),
		closers: make(map[uint32]int),
		drained: closedChan(),
	}
}

func closedChan() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}

// rows pairs each row with d's count for it.
func (q *quota) rows(d Limits) [3]struct {
	row *ledger.Row
	n   int64
} {
	return [3]struct {
		row *ledger.Row
		n   int64
	}{{q.conns, int64(d.Conns)}, {q.parked, int64(d.Parked)}, {q.fds, int64(d.FDs)}}
}

// take counts d more for uid, or refuses with EAGAIN, changing nothing,
// if that exceeds a limit.
func (q *quota) take(uid uint32, d Limits) error {
	rows := q.rows(d)
	for i, r := range rows {
		if r.n == 0 {
			continue
		}
		if err := r.row.Take(uid, r.n); err != nil {
			for _, done := range rows[:i] {
				if done.n != 0 {
					done.row.Give(uid, done.n)
				}
			}
			return protoErrorf(syscall.EAGAIN, "%v", err)
		}
	}
	return nil
}

// give uncounts d for uid.
func (q *quota) give(uid uint32, d Limits) {
	for _, r := range q.rows(d) {
		if r.n != 0 {
			r.row.Give(uid, r.n)
		}
	}
}

// adopt counts received descriptors against uid's FDs until release
// closes them. If they exceed a limit it refuses, once one of uid's
// closers has closed them: the caller, a connection's reader, reads
// nothing more from that peer meanwhile.
func (q *quota) adopt(uid uint32, fds []int) error {
	if len(fds) == 0 {
		return nil
	}
	if err := q.take(uid, Limits{FDs: len(fds)}); err != nil {
		<-q.closeAs(uid, func() { fdpass.Close(fds) })
		return err
	}
	q.mu.Lock()
	for _, fd := range fds {
		q.owner[fd] = uid
	}
	q.mu.Unlock()
	return nil
}

// release closes adopted descriptors (negative ones are skipped) on
// their owner's closers (closeAs), and uncounts each once closed: the
// close of a descriptor a peer sent may block (a file on a FUSE mount of
// the peer's whose FLUSH never answers), so no lock is held and no caller
// waits for it. Until it returns, the descriptor counts in its owner's
// FDs, which bounds the closes a uid can leave waiting.
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

// closeLater forgets fd as an adopted number, then closes it on one of
// its owner's closers and uncounts it from its owner once closed.
func (q *quota) closeLater(fd int, closeFD func()) {
	q.mu.Lock()
	uid, owned := q.owner[fd]
	delete(q.owner, fd) // the number is free once close starts
	q.mu.Unlock()
	q.closeAs(uid, func() {
		closeFD()
		if owned {
			q.give(uid, Limits{FDs: 1})
		}
	})
}

// closeAs runs closeFD on a closer of uid's: a goroutine charged to uid
// in the threads row, since a close that blocks holds an OS thread. When
// the row refuses uid one more and uid has closers running, closeFD waits
// in uid's queue for them; a uid with none gets one all the same (Add:
// the row is shared with the mount, whose threads may hold uid's share),
// so that no close waits for a closer that will never come. The channel
// is closed once closeFD returned.
func (q *quota) closeAs(uid uint32, closeFD func()) <-chan struct{} {
	done := make(chan struct{})
	job := func() {
		defer q.closed()
		defer close(done)
		closeFD()
	}
	q.mu.Lock()
	if q.closing++; q.closing == 1 {
		q.drained = make(chan struct{})
	}
	if err := q.threads.Take(uid, 1); err != nil {
		if q.closers[uid] > 0 {
			q.queued[uid] = append(q.queued[uid], job)
			q.mu.Unlock()
			return done
		}
		q.threads.Add(uid, 1)
	}
	q.closers[uid]++
	q.mu.Unlock()
	go q.closer(uid, job)
	return done
}

// closer runs job, then uid's queued closes, then gives its thread back.
func (q *quota) closer(uid uint32, job func()) {
	for job != nil {
		job()
		q.mu.Lock()
		job = nil
		if jobs := q.queued[uid]; len(jobs) > 0 {
			job = jobs[0]
			if len(jobs) == 1 {
				delete(q.queued, uid)
			} else {
				q.queued[uid] = jobs[1:]
			}
		}
		if job == nil { // under mu: a close queued after this finds the thread free
			q.threads.Give(uid, 1)
			if q.closers[uid]--; q.closers[uid] == 0 {
				delete(q.closers, uid)
			}
		}
		q.mu.Unlock()
	}
}

// closed counts one close of closeAs's as returned.
func (q *quota) closed() {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closing--; q.closing == 0 {
		close(q.drained)
	}
}

// waitClosing waits for the closes that release started, at most d; it
// reports whether they all returned.
func (q *quota) waitClosing(d time.Duration) bool {
	q.mu.Lock()
	drained := q.drained
	q.mu.Unlock()
	select {
	case <-drained:
		return true
	case <-time.After(d):
		return false
	}
}
