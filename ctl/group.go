package ctl

import (
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// groups is the rendezvous of all_gather and broadcast requests, by group
// name.
type groups struct {
	wait time.Duration // how long a group may take to fill

	mu sync.Mutex
	m  map[string]*group
}

// A group is one round of a collective that has not completed yet.
type group struct {
	name  string
	op    string
	uid   uint32
	world int
	root  int // broadcast only
	// members holds the waiting ranks; joined counts the non-nil ones.
	members []*member
	joined  int
	timer   *time.Timer
}

// A member is one waiting rank.
type member struct {
	rank int
	fd   int // the descriptor it brought, or -1; owned by the group
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
	fds  []int
	refs atomic.Int32
}

func (s *sharedFDs) release() {
	if s.refs.Add(-1) == 0 {
		closeFDs(s.fds)
	}
}

func newGroups(wait time.Duration) *groups {
	return &groups{wait: wait, m: make(map[string]*group)}
}

// join adds rank r.Rank to its group with fd (-1 for none), taking
// ownership of fd: it is closed if join fails. The member's outcome
// arrives on its done channel, at once if it completed the group.
func (gs *groups) join(cred Cred, r *request, fd int) (*group, *member, error) {
	gs.mu.Lock()
	defer gs.mu.Unlock()
	g := gs.m[r.Group]
	if g == nil {
		g = &group{name: r.Group, op: r.Op, uid: cred.Uid, world: r.World, root: r.Root, members: make([]*member, r.World)}
	} else if err := g.admit(cred, r); err != nil {
		if fd >= 0 {
			closeFDs([]int{fd})
		}
		return nil, nil, err
	}
	m := &member{rank: r.Rank, fd: fd, done: make(chan outcome, 1)}
	g.members[r.Rank] = m
	g.joined++
	switch {
	case g.joined == g.world:
		gs.complete(g)
	case g.joined == 1:
		gs.m[g.name] = g
		g.timer = time.AfterFunc(gs.wait, func() { gs.expire(g) })
	}
	return g, m, nil
}

// admit checks that r may join g.
func (g *group) admit(cred Cred, r *request) error {
	switch {
	case cred.Uid != g.uid && cred.Uid != 0:
		return protoErrorf(syscall.EPERM, "group %q belongs to uid %d", g.name, g.uid)
	case r.Op != g.op:
		return protoErrorf(syscall.EINVAL, "group %q is running %s, not %s", g.name, g.op, r.Op)
	case r.World != g.world:
		return protoErrorf(syscall.EINVAL, "group %q has world %d, not %d", g.name, g.world, r.World)
	case g.op == opBroadcast && r.Root != g.root:
		return protoErrorf(syscall.EINVAL, "group %q has root %d, not %d", g.name, g.root, r.Root)
	case g.members[r.Rank] != nil:
		return protoErrorf(syscall.EINVAL, "group %q already has rank %d", g.name, r.Rank)
	}
	return nil
}

// complete hands every member of the full group g its outcome and frees
// the group's name. gs.mu is held.
func (gs *groups) complete(g *group) {
	if gs.m[g.name] == g {
		delete(gs.m, g.name)
	}
	if g.timer != nil {
		g.timer.Stop()
	}
	shared := &sharedFDs{}
	shared.refs.Store(int32(g.world))
	if g.op == opBroadcast {
		shared.fds = []int{g.members[g.root].fd}
	} else {
		for _, m := range g.members {
			shared.fds = append(shared.fds, m.fd)
		}
	}
	for _, m := range g.members {
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
	if gs.m[g.name] != g {
		return
	}
	delete(gs.m, g.name)
	err := protoErrorf(syscall.ETIMEDOUT, "group %q: %d of %d ranks joined within %v", g.name, g.joined, g.world, gs.wait)
	for _, m := range g.members {
		if m != nil {
			if m.fd >= 0 {
				closeFDs([]int{m.fd})
			}
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
	if gs.m[g.name] != g || g.members[m.rank] != m {
		return false
	}
	g.members[m.rank] = nil
	g.joined--
	if m.fd >= 0 {
		closeFDs([]int{m.fd})
	}
	if g.joined == 0 {
		delete(gs.m, g.name)
		g.timer.Stop()
	}
	return true
}
