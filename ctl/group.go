package ctl

import (
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// groups is the rendezvous of all_gather and broadcast requests.
type groups struct {
	wait time.Duration // how long a group may take to fill
	q    *quota        // counts waiting members, closes their descriptors

	mu sync.Mutex
	m  map[groupKey]*group
}

// A groupKey names a group: its members' uid and its name, or for an open
// group its name alone. A uid never meets another uid's groups otherwise.
type groupKey struct {
	name string
	uid  uint32 // 0 in an open group
	open bool
}

// keyOf is the group a request from cred joins.
func keyOf(cred Cred, r *request) groupKey {
	if r.Open {
		return groupKey{name: r.Group, open: true}
	}
	return groupKey{name: r.Group, uid: cred.Uid}
}

// A group is one round of a collective that has not completed yet.
type group struct {
	key   groupKey
	op    string
	world int
	root  int // broadcast only
	// members holds the waiting ranks; joined counts the non-nil ones.
	members []*member
	joined  int
	timer   *time.Timer
}

// A member is one rank that joined.
type member struct {
	rank   int
	uid    uint32
	parked bool // it waited, counted in its uid's Parked
	fd     int  // the descriptor it brought, or -1; owned by the group
	// done receives the outcome exactly once, unless the member leaves.
	done chan outcome
}

// An outcome is what a member answers its peer.
type outcome struct {
	fds []int // to attach to the reply
	// shared holds fds open; release it once the reply is sent. Nil on
	// error.
	shared *sharedFDs
	err    error
}

// sharedFDs are the descriptors of a completed group, closed when every
// member has sent its reply.
type sharedFDs struct {
	q    *quota
	fds  []int
	refs atomic.Int32
}

func (s *sharedFDs) release() {
	if s.refs.Add(-1) == 0 {
		s.q.release(s.fds...)
	}
}

func newGroups(wait time.Duration, q *quota) *groups {
	return &groups{wait: wait, q: q, m: make(map[groupKey]*group)}
}

// join adds rank r.Rank to its group with fd (-1 for none), taking
// ownership of fd: it is released if join fails. A member that has to
// wait counts in its uid's Parked. The member's outcome arrives on its
// done channel, at once if it completed the group.
func (gs *groups) join(cred Cred, r *request, fd int) (*group, *member, error) {
	gs.mu.Lock()
	defer gs.mu.Unlock()
	key := keyOf(cred, r)
	g := gs.m[key]
	var err error
	if g == nil {
		g = &group{key: key, op: r.Op, world: r.World, root: r.Root, members: make([]*member, r.World)}
	} else {
		err = g.admit(r)
	}
	m := &member{rank: r.Rank, uid: cred.Uid, fd: fd, done: make(chan outcome, 1)}
	if err == nil && g.joined+1 < g.world {
		m.parked = true
		err = gs.q.take(cred.Uid, Limits{Parked: 1})
	}
	if err != nil {
		gs.q.release(fd)
		return nil, nil, err
	}
	g.members[r.Rank] = m
	g.joined++
	switch {
	case g.joined == g.world:
		gs.complete(g)
	case g.joined == 1:
		gs.m[key] = g
		g.timer = time.AfterFunc(gs.wait, func() { gs.expire(g) })
	}
	return g, m, nil
}

// admit checks that r may join g.
func (g *group) admit(r *request) error {
	switch {
	case r.Op != g.op:
		return protoErrorf(syscall.EINVAL, "group %q is running %s, not %s", g.key.name, g.op, r.Op)
	case r.World != g.world:
		return protoErrorf(syscall.EINVAL, "group %q has world %d, not %d", g.key.name, g.world, r.World)
	case g.op == opBroadcast && r.Root != g.root:
		return protoErrorf(syscall.EINVAL, "group %q has root %d, not %d", g.key.name, g.root, r.Root)
	case g.members[r.Rank] != nil:
		return protoErrorf(syscall.EINVAL, "group %q already has rank %d", g.key.name, r.Rank)
	}
	return nil
}

// unpark uncounts m's wait. gs.mu is held.
func (gs *groups) unpark(m *member) {
	if m.parked {
		gs.q.give(m.uid, Limits{Parked: 1})
	}
}

// complete hands every member of the full group g its outcome and frees
// the group's name. gs.mu is held.
func (gs *groups) complete(g *group) {
	if gs.m[g.key] == g {
		delete(gs.m, g.key)
	}
	if g.timer != nil {
		g.timer.Stop()
	}
	shared := &sharedFDs{q: gs.q}
	shared.refs.Store(int32(g.world))
	if g.op == opBroadcast {
		shared.fds = []int{g.members[g.root].fd}
	} else {
		for _, m := range g.members {
			shared.fds = append(shared.fds, m.fd)
		}
	}
	for _, m := range g.members {
		gs.unpark(m)
		o := outcome{fds: shared.fds, shared: shared}
		if g.op == opBroadcast && m.rank == g.root {
			o.fds = nil
		}
		m.done <- o
	}
}

// expire answers ETIMEDOUT to every member of g if it is still waiting.
func (gs *groups) expire(g *group) {
	gs.mu.Lock()
	defer gs.mu.Unlock()
	if gs.m[g.key] != g {
		return
	}
	delete(gs.m, g.key)
	err := protoErrorf(syscall.ETIMEDOUT, "group %q: %d of %d ranks joined within %v", g.key.name, g.joined, g.world, gs.wait)
	for _, m := range g.members {
		if m != nil {
			gs.unpark(m)
			gs.q.release(m.fd)
			m.done <- outcome{err: err}
		}
	}
}

// leave takes m out of g, closing its descriptor, and forgets g once it is
// empty. It reports false if m's outcome was already sent: the caller must
// then take it from m.done.
func (gs *groups) leave(g *group, m *member) bool {
	gs.mu.Lock()
	defer gs.mu.Unlock()
	if gs.m[g.key] != g || g.members[m.rank] != m {
		return false
	}
	g.members[m.rank] = nil
	g.joined--
	gs.unpark(m)
	gs.q.release(m.fd)
	if g.joined == 0 {
		delete(gs.m, g.key)
		g.timer.Stop()
	}
	return true
}
