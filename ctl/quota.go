package ctl

import (
	"sync"
	"syscall"

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

// Default limits: a group of 253 ranks (the largest) takes a quarter of a
// uid's connections and half of its waiting requests.
var (
	defaultPerUID = Limits{Conns: 1024, Parked: 512, FDs: 2048}
	defaultTotal  = Limits{Conns: 4096, Parked: 2048, FDs: 8192}
)

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

// quota counts what each uid holds against the limits.
type quota struct {
	perUID, total Limits

	mu    sync.Mutex
	used  map[uint32]Limits
	sum   Limits
	owner map[int]uint32 // received descriptors held: whose FDs they count in
}

func newQuota(perUID, total Limits) *quota {
	return &quota{perUID: perUID, total: total, used: make(map[uint32]Limits), owner: make(map[int]uint32)}
}

// take counts d more for uid, or refuses with EAGAIN if that exceeds a
// limit.
func (q *quota) take(uid uint32, d Limits) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	u, sum := q.used[uid].plus(d), q.sum.plus(d)
	what, limit := u.exceeds(q.perUID)
	scope := "per uid"
	if what == "" {
		what, limit = sum.exceeds(q.total)
		scope = "for all users"
	}
	if what != "" {
		return protoErrorf(syscall.EAGAIN, "uid %d reached the limit of %d %s %s", uid, limit, what, scope)
	}
	q.used[uid], q.sum = u, sum
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

// release closes adopted descriptors (negative ones are skipped) and
// uncounts them.
func (q *quota) release(fds ...int) {
	q.uncount(fds...)
	for _, fd := range fds {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
}

// uncount stops counting adopted descriptors that the caller then closes
// itself: uncounted first, a number reused once closed is counted afresh.
func (q *quota) uncount(fds ...int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, fd := range fds {
		if uid, ok := q.owner[fd]; ok {
			delete(q.owner, fd)
			q.giveLocked(uid, Limits{FDs: 1})
		}
	}
}
