package cluster

import (
	"io"
	"math"
	mbits "math/bits"
	"math/rand/v2"
	"os"
	"slices"
	"time"

	"tensorfs/cluster/transport"
)

// maxStrikes is how many bad pieces a peer may send before a pull stops
// asking it for anything.
const maxStrikes = 3

// maxAvail is how many holders of a content a pick considers at most: a
// sample, drawn anew at every pick, keeps a pick's work bounded however
// many nodes hold the content, and spreads the pulls over the holders.
const maxAvail = 32

// busyWait is how long a pull leaves alone a peer that refused a fetch
// because it sends as many pieces as it may (transport.ErrBusy).
const busyWait = 250 * time.Millisecond

// scheduler decides which piece a pull fetches next and from which
// holder, and keeps the books on the outcomes. It runs no goroutine, holds
// no lock and reads no clock: Pull calls it under Pull.mu with time.Now;
// the simulation (package cluster/sim, through Scheduler) calls it with a
// virtual clock. What it knows of holders comes from their holder keys
// in etcd (Pull.load and the watch, through keyLocked and unkeyLocked:
// complete holders, and members, which hold some pieces), and from the
// members it subscribes to (a sample, chosen here), which tell it which
// pieces they hold over the transport (toldLocked, toldPieceLocked).
type scheduler struct {
	self      string                // this node's name
	perPeer   int                   // fetches in flight from one peer, at most
	rng       *rand.Rand            // its random choices
	groups    []*group              // one per distinct content
	peers     map[string]string     // live nodes: name to address
	state     map[string]*peerState // the fetches' record of each peer asked or holding
	byPeer    map[string]int64      // verified bytes per peer
	bytes     int64                 // verified bytes
	left      int                   // pieces missing
	lastStep  time.Time             // last piece held, or holder news
	inFlights int                   // fetches in flight
	cands     []candidate           // pickLocked's

	// The members (holders of part of a content, by their holder keys)
	// heard of: by node, of how many contents; those subscribed to (at
	// most maxAvail, a uniform sample of those heard of); how many were
	// heard of.
	members map[string]int
	subs    []string
	heard   int

	// After a pick that found nothing: nothing changed since (idle), the
	// peers then, and when the first peer left alone comes back.
	idle      bool
	idlePeers int
	idleUntil time.Time
}

// newScheduler returns the scheduler of node self, with no groups yet,
// its random choices drawn from seed.
func newScheduler(self string, perPeer int, seed uint64, now time.Time) scheduler {
	return scheduler{
		self: self, perPeer: perPeer, rng: rand.New(rand.NewPCG(seed, 0)),
		peers: map[string]string{}, state: map[string]*peerState{}, byPeer: map[string]int64{},
		members: map[string]int{}, lastStep: now,
	}
}

// peerState is what the fetches from one peer tell of it.
type peerState struct {
	inflight int       // fetches in flight from it
	fails    int       // consecutive failures
	down     time.Time // not asked before this
	strikes  int       // bad pieces it sent
}

// stateLocked returns node's record, made empty on first use.
func (s *scheduler) stateLocked(node string) *peerState {
	st := s.state[node]
	if st == nil {
		st = &peerState{}
		s.state[node] = st
	}
	return st
}

// holding is one holder of a group's content: its node, the pieces it
// has (by its holder key, or as it told), and its record.
type holding struct {
	node  string
	bits  bitmap
	seed  bool // it has every piece (and is not this node)
	keyed bool // its holder key says it has every piece
	st    *peerState
}

// group is one distinct content of a pull and where it goes.
type group struct {
	c       *Content
	dsts    []*os.File
	local   io.ReaderAt         // a complete copy this node holds already
	holders map[string]*holding // by node
	members map[string]bool     // nodes whose holder key says they hold part
	order   []*holding          // the same, in the order availLocked samples them
	seeds   int                 // holders other than this node that have every piece
	counts  []int               // holders other than this node of each piece
	have    bitmap              // pieces written and verified
	full    bitmap              // every piece: the bits of each holder whose key says complete (shared, never changed)
	busy    map[int]bool        // pieces in flight
	bad     map[int][]string    // peers that sent a bad copy of a piece
	left    int                 // pieces missing
	done    chan struct{}       // closed when complete
	wanted  int                 // the jobs that want it, less those dropped (Pull.Drop)
	dropped bool                // no job wants it any more: it is not fetched, nor done

	// availLocked's: the holders that may be asked now (avail), and
	// whether a piece this node lacks is held by seeds alone (seedOnly).
	avail    []*holding
	seedOnly bool
}

// newGroup returns the group of content c, nothing held yet.
func newGroup(c *Content) *group {
	pieces := c.Pieces()
	full := newBitmap(pieces)
	full.fill(pieces)
	return &group{c: c, holders: map[string]*holding{}, members: map[string]bool{}, counts: make([]int, pieces),
		have: newBitmap(pieces), full: full, busy: map[int]bool{}, bad: map[int][]string{}, left: pieces,
		done: make(chan struct{})}
}

// task is one piece to fetch from one peer; from the content's only
// seed, with the pieces it may send in its place (accept: those neither
// held nor in flight when it was claimed), of which it sends one
// (super-seeding).
type task struct {
	g      *group
	i      int
	peer   transport.Peer
	accept bitmap
}

// outcome is how a fetch ended.
type outcome int

const (
	fetched   outcome = iota // verified and written
	notServed                // the peer does not serve the piece
	busy                     // the peer sends as many pieces as it may
	failed                   // the peer is unreachable, dead or refusing
	badPiece                 // the bytes failed verification
	cancelled                // the pull ended meanwhile
)

// claimLocked picks the next task and marks it in flight; false if no
// piece can be fetched now. After a pick that found nothing, it answers
// false at once until something changes: a fetch ends, a holder announces
// a piece this node lacks, the peers change, or a peer left alone may be
// asked again.
func (s *scheduler) claimLocked(now time.Time) (task, bool) {
	if s.idle && len(s.peers) == s.idlePeers && now.Before(s.idleUntil) {
		return task{}, false
	}
	t, ok := s.pickLocked(now)
	if !ok {
		s.idle, s.idlePeers, s.idleUntil = true, len(s.peers), now.Add(time.Hour)
		for _, st := range s.state {
			if st.down.After(now) && st.down.Before(s.idleUntil) {
				s.idleUntil = st.down
			}
		}
		return task{}, false
	}
	t.g.busy[t.i] = true
	s.stateLocked(t.peer.Name).inflight++
	s.inFlights++
	if t.g.holders[t.peer.Name].seed && t.g.seeds == 1 {
		t.accept = t.g.acceptable() // super-seeding: see Node.Piece
	}
	return t, true
}

// acceptable returns the pieces of g neither held nor in flight; nil if none.
func (g *group) acceptable() bitmap {
	var b bitmap
	for i := range g.c.Pieces() {
		if !g.have.has(i) && !g.busy[i] {
			if b == nil {
				b = newBitmap(g.c.Pieces())
			}
			b.set(i)
		}
	}
	return b
}

// substituteLocked has t, in flight, fetch piece i of its group instead
// (its holder sends another piece than the one asked for): false if t
// did not accept i, or i is held or in flight meanwhile.
func (s *scheduler) substituteLocked(t *task, i int) bool {
	g := t.g
	if !t.accept.has(i) || g.have.has(i) || g.busy[i] {
		return false
	}
	delete(g.busy, t.i)
	g.busy[i] = true
	t.i = i
	return true
}

// pickLocked chooses the next piece and its holder: a holder first, then
// the rarest piece it offers. Holders are tried in turn among those that
// may be asked now (availLocked's sample): seeds first while they alone
// hold a piece this node lacks (so that a publisher's upload goes to new
// pieces), then the others, the least busy first, ties at random, and
// seeds last. Choosing the holder first spreads the pullers over all the
// holders instead of crowding the few that hold the rarest pieces. Of
// the pieces the holder has, this node lacks and has not in flight, one
// held by the fewest holders (rarest first, so that pieces spread before
// they are copied again), ties at random. A holder that refuses because
// it sends as many pieces as it may (ErrBusy) is left alone for
// busyWait.
func (s *scheduler) pickLocked(now time.Time) (task, bool) {
	cands := s.cands[:0]
	for _, g := range s.groups {
		if g.left == 0 || g.local != nil || !s.availLocked(g, now) {
			continue
		}
		for _, h := range g.avail {
			rank := 1 + h.st.inflight
			if h.seed {
				rank = 0
				if !g.seedOnly {
					rank = 1 + s.perPeer + h.st.inflight
				}
			}
			cands = append(cands, candidate{g: g, h: h, rank: rank})
		}
	}
	s.cands = cands
	// Shuffled, then sorted stably: equal ranks in random order, the
	// groups' holders mixed.
	s.rng.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
	slices.SortStableFunc(cands, func(a, b candidate) int { return a.rank - b.rank })
	for _, c := range cands {
		if i := s.rarestLocked(c.g, c.h); i >= 0 {
			return task{g: c.g, i: i, peer: transport.Peer{Name: c.h.node, Addr: s.peers[c.h.node]}}, true
		}
	}
	return task{}, false
}

// candidate is a holder pickLocked may ask, and its rank: lower first.
type candidate struct {
	g    *group
	h    *holding
	rank int
}

// rarestLocked returns the piece of g that h may be asked for with the
// fewest holders, ties at random: one h holds, this node lacks and has
// not in flight, h did not send bad, and (h being a seed) seedsMay. -1 if
// none.
func (s *scheduler) rarestLocked(g *group, h *holding) int {
	pieces := len(g.counts)
	best, ties, rarity := -1, 0, math.MaxInt
	i0 := s.rng.IntN(pieces)
	for j := range pieces {
		i := (i0 + j) % pieces
		r := g.counts[i]
		if r > rarity || g.have.has(i) || !h.bits.has(i) || g.busy[i] || h.seed && !g.seedsMay(i) || slices.Contains(g.bad[i], h.node) {
			continue
		}
		if r < rarity {
			rarity, ties = r, 0
		}
		if ties++; s.rng.IntN(ties) == 0 {
			best = i
		}
	}
	return best
}

// availLocked finds up to maxAvail holders of g that may be asked for a
// piece now (g.avail: live, not left alone, not struck out, with room for
// another fetch, holding a piece this node lacks), a random sample (drawn
// by shuffling g.order as far as it looks), and whether seeds alone hold
// a piece this node lacks (g.seedOnly). False if none may be asked.
func (s *scheduler) availLocked(g *group, now time.Time) bool {
	g.avail, g.seedOnly = g.avail[:0], false
	for k := 0; k < len(g.order) && len(g.avail) < maxAvail; k++ {
		j := k + s.rng.IntN(len(g.order)-k)
		g.order[k], g.order[j] = g.order[j], g.order[k]
		h := g.order[k]
		if h.st.inflight >= s.perPeer || h.st.down.After(now) || h.st.strikes >= maxStrikes || !g.lacks(h.bits) || s.peers[h.node] == "" {
			continue
		}
		g.avail = append(g.avail, h)
	}
	for i, r := range g.counts {
		if r <= g.seeds && !g.have.has(i) {
			g.seedOnly = true
			break
		}
	}
	return len(g.avail) > 0
}

// lacks reports whether bits has a piece this node lacks.
func (g *group) lacks(bits bitmap) bool {
	for k := range min(len(bits), len(g.have)) {
		if bits[k]&^g.have[k] != 0 {
			return true
		}
	}
	return false
}

// seedsMay reports whether g's seeds may be asked for piece i: while
// seeds alone hold a piece this node lacks, they are asked only for such
// pieces, so that their upload goes to pieces the others do not have.
func (g *group) seedsMay(i int) bool {
	return !g.seedOnly || g.counts[i] <= g.seeds
}

// finishLocked records how task t ended, and returns how long its peer is
// left alone when the failure is a new one (0 otherwise).
func (s *scheduler) finishLocked(t task, o outcome, now time.Time) (backoff time.Duration) {
	g, peer, st := t.g, t.peer.Name, s.stateLocked(t.peer.Name)
	st.inflight--
	s.inFlights--
	s.idle = false
	delete(g.busy, t.i)
	switch o {
	case notServed:
		g.bad[t.i] = append(g.bad[t.i], peer)
	case busy:
		if until := now.Add(busyWait); until.After(st.down) {
			st.down = until
		}
	case failed:
		if st.down.After(now) && st.fails > 0 {
			return 0 // the fetches in flight when it failed: one failure
		}
		st.fails++
		backoff = min(time.Second<<min(st.fails-1, 4), 10*time.Second)
		st.down = now.Add(backoff)
	case badPiece:
		st.strikes++
		g.bad[t.i] = append(g.bad[t.i], peer)
	case fetched:
		_, size := g.c.PieceRange(t.i)
		st.fails = 0
		g.have.set(t.i)
		g.left--
		s.left--
		s.bytes += size
		s.byPeer[peer] += size
		s.lastStep = now
	}
	return backoff
}

// setHolderLocked records that node holds the pieces in bits of g.
func (s *scheduler) setHolderLocked(g *group, node string, bits bitmap) {
	h := g.holders[node]
	if h == nil {
		h = &holding{node: node, st: s.stateLocked(node)}
		g.holders[node] = h
		g.order = append(g.order, h)
	}
	old := h.bits
	s.tallyLocked(g, h, -1)
	h.bits = bits
	s.tallyLocked(g, h, 1)
	if node == s.self {
		return
	}
	for k := range max(len(old), len(bits)) {
		was, is := byteAt(old, k), byteAt(bits, k)
		for x := was ^ is; x != 0; x &= x - 1 {
			i := k*8 + mbits.TrailingZeros8(x)
			switch {
			case i >= len(g.counts):
			case is&(1<<(i%8)) != 0:
				g.counts[i]++
				if !g.have.has(i) {
					s.idle = false // a piece this node lacks
				}
			default:
				g.counts[i]--
			}
		}
	}
}

// byteAt returns byte k of b, 0 past its end.
func byteAt(b bitmap, k int) byte {
	if k < len(b) {
		return b[k]
	}
	return 0
}

// dropHolderLocked forgets node as a holder of g.
func (s *scheduler) dropHolderLocked(g *group, node string) {
	h := g.holders[node]
	if h == nil {
		return
	}
	s.setHolderLocked(g, node, nil)
	delete(g.holders, node)
	k := slices.Index(g.order, h)
	g.order[k] = g.order[len(g.order)-1]
	g.order = g.order[:len(g.order)-1]
}

// keyLocked applies node's holder key for g: it holds every piece
// (complete: a seed), or some (a member, which may be subscribed to). It
// returns the member to subscribe to, if any, and the one to unsubscribe
// from ("" for none).
func (s *scheduler) keyLocked(g *group, node string, complete bool) (sub, unsub string) {
	if node == s.self {
		return "", ""
	}
	if complete {
		if g.members[node] {
			delete(g.members, node)
			unsub = s.leaveLocked(node)
		}
		// One bitmap for all of them: a key of a few bytes (any holder
		// of a cluster certificate writes as many as etcd takes, for
		// nodes that do not exist) made a bitmap of the content's
		// (2 KiB at 16384 pieces) at every node pulling it.
		s.setHolderLocked(g, node, g.full)
		g.holders[node].keyed = true
		return "", unsub
	}
	if h := g.holders[node]; h != nil && h.keyed {
		s.dropHolderLocked(g, node) // no longer complete: it tells which pieces it has
	}
	if g.members[node] {
		return "", ""
	}
	g.members[node] = true
	return s.joinLocked(node)
}

// unkeyLocked forgets node as a holder of g (its key is gone), and
// returns the member to unsubscribe from, if any.
func (s *scheduler) unkeyLocked(g *group, node string) (unsub string) {
	if g.members[node] {
		delete(g.members, node)
		unsub = s.leaveLocked(node)
	}
	s.dropHolderLocked(g, node)
	return unsub
}

// joinLocked counts node a member of one content more. A member heard of
// for the first time is subscribed to while fewer than maxAvail are,
// then in place of a random one with the share maxAvail of those heard
// of (reservoir sampling: the subscriptions are a uniform sample). It
// returns whom to subscribe to and unsubscribe from ("" for none).
func (s *scheduler) joinLocked(node string) (sub, unsub string) {
	if s.members[node]++; s.members[node] > 1 {
		return "", ""
	}
	s.heard++
	if len(s.subs) < maxAvail {
		s.subs = append(s.subs, node)
		return node, ""
	}
	if s.rng.IntN(s.heard) >= maxAvail {
		return "", ""
	}
	k := s.rng.IntN(len(s.subs))
	unsub = s.subs[k]
	s.subs[k] = node
	s.forgetLocked(unsub)
	return node, unsub
}

// leaveLocked counts node a member of one content fewer; at none, it is
// unsubscribed from (returned, "" if it was not) and what it told is
// forgotten.
func (s *scheduler) leaveLocked(node string) string {
	if s.members[node]--; s.members[node] > 0 {
		return ""
	}
	delete(s.members, node)
	k := slices.Index(s.subs, node)
	if k < 0 {
		return ""
	}
	s.subs = slices.Delete(s.subs, k, k+1)
	s.forgetLocked(node)
	return node
}

// forgetLocked forgets what node told of every group (not what its keys
// say).
func (s *scheduler) forgetLocked(node string) {
	for _, g := range s.groups {
		if h := g.holders[node]; h != nil && !h.keyed {
			s.dropHolderLocked(g, node)
		}
	}
}

// toldLocked applies what node, subscribed to, told of g: the pieces in
// bits (clipped to g's), or none (nil: it holds g no more). Ignored from
// a node not subscribed to, or one whose key says it is complete.
func (s *scheduler) toldLocked(g *group, node string, bits []byte) {
	h := g.holders[node]
	if !slices.Contains(s.subs, node) || h != nil && h.keyed {
		return
	}
	if bits == nil {
		s.dropHolderLocked(g, node)
		return
	}
	b := newBitmap(len(g.counts))
	copy(b, bits)
	if r := len(g.counts) % 8; r != 0 {
		b[len(b)-1] &= 1<<r - 1
	}
	s.setHolderLocked(g, node, b)
}

// toldPieceLocked applies that node, subscribed to, told it got piece i
// of g.
func (s *scheduler) toldPieceLocked(g *group, node string, i int) {
	h := g.holders[node]
	switch {
	case !slices.Contains(s.subs, node) || i < 0 || i >= len(g.counts) || h != nil && (h.keyed || h.bits.has(i)):
	case h == nil:
		b := newBitmap(len(g.counts))
		b.set(i)
		s.setHolderLocked(g, node, b)
	default:
		s.tallyLocked(g, h, -1)
		h.bits.set(i)
		s.tallyLocked(g, h, 1)
		g.counts[i]++
		if !g.have.has(i) {
			s.idle = false
		}
	}
}

// tallyLocked adds (d = 1) or takes away (d = -1) h as a seed of g if
// its bits have every piece.
func (s *scheduler) tallyLocked(g *group, h *holding, d int) {
	if h.node == s.self || h.bits.count() < len(g.counts) {
		return
	}
	h.seed = d > 0
	g.seeds += d
}
