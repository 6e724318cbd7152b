package cluster

import (
	"io"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"time"

	"tensorfs/cluster/transport"
)

// maxStrikes is how many bad pieces a peer may send before a pull stops
// asking it for anything.
const maxStrikes = 3

// scheduler decides which piece a pull fetches next and from which
// holder, and keeps the books on the outcomes. It runs no goroutine, holds
// no lock and reads no clock: Pull calls it under Pull.mu with time.Now;
// the simulation (package cluster/sim, through Scheduler) calls it with a
// virtual clock. What it knows of holders comes from etcd (Pull.load and
// the watch), through setHolderLocked and dropHolderLocked.
type scheduler struct {
	self      string               // this node's name
	perPeer   int                  // fetches in flight from one peer, at most
	groups    []*group             // one per distinct content
	peers     map[string]string    // live nodes: name to address
	inflight  map[string]int       // fetches in flight per peer
	fails     map[string]int       // consecutive failures per peer
	down      map[string]time.Time // do not ask a peer before this
	strikes   map[string]int       // bad pieces per peer
	byPeer    map[string]int64     // verified bytes per peer
	bytes     int64                // verified bytes
	left      int                  // pieces missing
	lastStep  time.Time            // last piece held, or holder news
	inFlights int                  // fetches in flight
	scratch   []string             // holderLocked's
}

// newScheduler returns the scheduler of node self, with no groups yet.
func newScheduler(self string, perPeer int, now time.Time) scheduler {
	return scheduler{
		self: self, perPeer: perPeer,
		peers: map[string]string{}, inflight: map[string]int{}, fails: map[string]int{},
		down: map[string]time.Time{}, strikes: map[string]int{}, byPeer: map[string]int64{},
		lastStep: now,
	}
}

// group is one distinct content of a pull and where it goes.
type group struct {
	c       *Content
	dsts    []*os.File
	local   io.ReaderAt       // a complete copy this node holds already
	holders map[string]bitmap // node to the pieces it holds
	seeds   map[string]bool   // holders other than this node that have every piece
	have    bitmap            // pieces written and verified
	busy    map[int]bool      // pieces in flight
	bad     map[int][]string  // peers that sent a bad copy of a piece
	left    int               // pieces missing
	done    chan struct{}     // closed when complete

	// This node's share of the pieces one node holds: those with
	// (index+offset) % (pullers+1) == below (see mine). pullers counts
	// the holders other than this node whose bitmaps are incomplete,
	// below those of them named before this node.
	pullers, below, offset int
}

// newGroup returns the group of content c, nothing held yet.
func newGroup(c *Content) *group {
	pieces := c.Pieces()
	return &group{c: c, holders: map[string]bitmap{}, seeds: map[string]bool{}, have: newBitmap(pieces),
		busy: map[int]bool{}, bad: map[int][]string{}, left: pieces, done: make(chan struct{}),
		offset: int(c.ID()[0])} // spreads the first shares of many contents
}

// task is one piece to fetch from one peer.
type task struct {
	g    *group
	i    int
	peer transport.Peer
}

// outcome is how a fetch ended.
type outcome int

const (
	fetched   outcome = iota // verified and written
	notServed                // the peer does not serve the piece
	failed                   // the peer is unreachable, dead or refusing
	badPiece                 // the bytes failed verification
	cancelled                // the pull ended meanwhile
)

// claimLocked picks the next task and marks it in flight; false if no
// piece can be fetched now.
func (s *scheduler) claimLocked(now time.Time) (task, bool) {
	t, ok := s.pickLocked(now)
	if ok {
		t.g.busy[t.i] = true
		s.inflight[t.peer.Name]++
		s.inFlights++
	}
	return t, ok
}

// pickLocked chooses the next piece: among the missing pieces not in
// flight, one with the fewest usable holders (rarest first, so pieces
// spread before they are copied again), ties broken at random; from its
// least busy usable holder. A piece only one node holds is fetched by one
// of the nodes pulling it (each takes its share, see group.mine), so that
// its holder sends it once; the others fetch it from that puller. Another
// puller's share is taken only when there is nothing else to do.
func (s *scheduler) pickLocked(now time.Time) (task, bool) {
	var (
		best, other task
		bestRarity  = math.MaxInt
		ties        int
		haveOther   bool
	)
	gi0 := rand.IntN(len(s.groups))
	for k := range s.groups {
		g := s.groups[(gi0+k)%len(s.groups)]
		if g.left == 0 || g.local != nil {
			continue
		}
		pieces := g.c.Pieces()
		i0 := rand.IntN(pieces)
		for j := range pieces {
			i := (i0 + j) % pieces
			if g.have.has(i) || g.busy[i] {
				continue
			}
			rarity, peer := s.holderLocked(g, i, now)
			if peer == "" {
				continue
			}
			t := task{g: g, i: i, peer: transport.Peer{Name: peer, Addr: s.peers[peer]}}
			switch {
			case rarity == 1 && !g.mine(i):
				other, haveOther = t, true
			case rarity < bestRarity:
				best, bestRarity, ties = t, rarity, 1
			case rarity == bestRarity:
				if ties++; rand.IntN(ties) == 0 {
					best = t
				}
			}
			if bestRarity == 1 {
				return best, true // nothing is rarer; the random start spreads the picks
			}
		}
	}
	if bestRarity != math.MaxInt {
		return best, true
	}
	return other, haveOther && s.inFlights == 0
}

// mine reports whether piece i is this node's share of the pieces of g
// that only one node holds: the nodes pulling g (those whose bitmaps are
// incomplete) split them by index.
func (g *group) mine(i int) bool {
	return g.pullers == 0 || (i+g.offset)%(g.pullers+1) == g.below
}

// holderLocked returns how many usable holders piece i of g has, and the
// least busy of them with room for another fetch ("" if none). Holders
// that have the whole content (the publisher, nodes done pulling) count as
// busier by perPeer for a piece others hold too: their upload is kept for
// the pieces only they have.
func (s *scheduler) holderLocked(g *group, i int, now time.Time) (int, string) {
	usable := s.scratch[:0]
	for node, bits := range g.holders {
		if bits.has(i) && s.peers[node] != "" && !s.down[node].After(now) && s.strikes[node] < maxStrikes && !slices.Contains(g.bad[i], node) {
			usable = append(usable, node)
		}
	}
	s.scratch = usable
	chosen, least, ties := "", math.MaxInt, 0
	for _, node := range usable {
		load := s.inflight[node]
		if load >= s.perPeer {
			continue
		}
		if len(usable) > 1 && g.seeds[node] {
			load += s.perPeer
		}
		if load < least {
			chosen, least, ties = node, load, 1
		} else if load == least {
			if ties++; rand.IntN(ties) == 0 {
				chosen = node
			}
		}
	}
	return len(usable), chosen
}

// finishLocked records how task t ended, and returns how long its peer is
// left alone when the failure is a new one (0 otherwise).
func (s *scheduler) finishLocked(t task, o outcome, now time.Time) (backoff time.Duration) {
	g, peer := t.g, t.peer.Name
	s.inflight[peer]--
	s.inFlights--
	delete(g.busy, t.i)
	switch o {
	case notServed:
		g.bad[t.i] = append(g.bad[t.i], peer)
	case failed:
		if s.down[peer].After(now) {
			return 0 // the fetches in flight when it failed: one failure
		}
		s.fails[peer]++
		backoff = min(time.Second<<min(s.fails[peer]-1, 4), 10*time.Second)
		s.down[peer] = now.Add(backoff)
	case badPiece:
		s.strikes[peer]++
		g.bad[t.i] = append(g.bad[t.i], peer)
	case fetched:
		_, size := g.c.PieceRange(t.i)
		s.fails[peer] = 0
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
	s.dropHolderLocked(g, node)
	g.holders[node] = bits
	s.countHolderLocked(g, node, bits, 1)
}

// dropHolderLocked forgets node as a holder of g.
func (s *scheduler) dropHolderLocked(g *group, node string) {
	if bits, ok := g.holders[node]; ok {
		s.countHolderLocked(g, node, bits, -1)
		delete(g.holders, node)
	}
}

// holdersChangedLocked recomputes what g's scheduler derives from its
// holders (seeds, this node's share) after g.holders was replaced.
func (s *scheduler) holdersChangedLocked(g *group) {
	clear(g.seeds)
	g.pullers, g.below = 0, 0
	for node, bits := range g.holders {
		s.countHolderLocked(g, node, bits, 1)
	}
}

// countHolderLocked adds (d = 1) or takes away (d = -1) what node's bits
// count for in g: a seed, or one of the nodes pulling it.
func (s *scheduler) countHolderLocked(g *group, node string, bits bitmap, d int) {
	switch {
	case node == s.self:
	case bits.count() >= g.c.Pieces():
		if d > 0 {
			g.seeds[node] = true
		} else {
			delete(g.seeds, node)
		}
	default:
		g.pullers += d
		if node < s.self {
			g.below += d
		}
	}
}
