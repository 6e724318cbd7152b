package cluster

import (
	"crypto/sha256"
	"encoding/hex"
	"time"
)

// Scheduler is a pull's piece scheduler without the pull, for the
// simulation (package cluster/sim): the code that picks pieces and
// holders for Pull, with the holders, the peers, the outcomes of fetches
// and the clock given to it by the caller. Not safe for concurrent use.
type Scheduler struct{ s scheduler }

// SimContent is a content to schedule: its size and piece size.
type SimContent struct{ Size, PieceSize int64 }

// SimTask is a piece to fetch: piece Piece of content Content (an index
// of NewScheduler's contents) from node Peer, which, a seed, may send one
// of Accept instead (super-seeding: SuperSeed, Substitute).
type SimTask struct {
	Content, Piece int
	Peer           string
	Accept         []byte
	t              task
}

// NewScheduler returns the scheduler of node self pulling contents, at
// most perPeer fetches from one peer at once, its random choices drawn
// from seed. Content i gets an ID made from i, the same on every node.
func NewScheduler(self string, perPeer int, contents []SimContent, seed uint64, now time.Time) *Scheduler {
	s := &Scheduler{s: newScheduler(self, perPeer, seed, now)}
	for i, c := range contents {
		sum := sha256.Sum256([]byte{byte(i >> 24), byte(i >> 16), byte(i >> 8), byte(i)})
		g := newGroup(&Content{Size: c.Size, PieceSize: c.PieceSize, id: hex.EncodeToString(sum[:])})
		s.s.groups = append(s.s.groups, g)
		s.s.left += g.left
	}
	return s
}

// Claim picks the next piece to fetch and marks it in flight; false if
// none can be fetched now.
func (s *Scheduler) Claim(now time.Time) (SimTask, bool) {
	t, ok := s.s.claimLocked(now)
	if !ok {
		return SimTask{}, false
	}
	return SimTask{Content: s.index(t.g), Piece: t.i, Peer: t.peer.Name, Accept: t.accept, t: t}, true
}

// index returns the index of g among the contents.
func (s *Scheduler) index(g *group) int {
	for i, h := range s.s.groups {
		if h == g {
			return i
		}
	}
	return -1
}

// Finish records that t's piece was fetched and verified (ok), or that
// its peer was unreachable.
func (s *Scheduler) Finish(t SimTask, ok bool, now time.Time) {
	o := failed
	if ok {
		o = fetched
	}
	s.s.finishLocked(t.t, o, now)
}

// Refused records that t's peer refused it: it sends as many pieces as it
// may (transport.ErrBusy).
func (s *Scheduler) Refused(t SimTask, now time.Time) { s.s.finishLocked(t.t, busy, now) }

// Taken records that t's peer sent a piece in its place that was taken
// meanwhile (Substitute false): its bytes were not taken.
func (s *Scheduler) Taken(t SimTask, now time.Time) { s.s.finishLocked(t.t, cancelled, now) }

// SetPeer records a live node; DropPeer forgets a dead one.
func (s *Scheduler) SetPeer(node string) {
	if node != s.s.self {
		s.s.peers[node] = "sim:" + node
	}
}

// DropPeer forgets a node that died.
func (s *Scheduler) DropPeer(node string) { delete(s.s.peers, node) }

// SetHolder records that node holds the pieces in bits of content i
// (the holder keys of the design before membership, which carried
// bitmaps), which the scheduler keeps and the caller must not change.
func (s *Scheduler) SetHolder(i int, node string, bits []byte) {
	s.s.setHolderLocked(s.s.groups[i], node, bitmap(bits))
}

// DropHolder forgets node as a holder of content i.
func (s *Scheduler) DropHolder(i int, node string) { s.s.dropHolderLocked(s.s.groups[i], node) }

// Key applies node's holder key of content i (complete, or a member
// that holds part), as Pull does: it returns the member to subscribe to
// and the one to unsubscribe from ("" for none).
func (s *Scheduler) Key(i int, node string, complete bool) (sub, unsub string) {
	return s.s.keyLocked(s.s.groups[i], node, complete)
}

// Unkey applies that node's holder key of content i is gone: it returns
// the member to unsubscribe from, if any.
func (s *Scheduler) Unkey(i int, node string) (unsub string) {
	return s.s.unkeyLocked(s.s.groups[i], node)
}

// Told applies the bitmap of content i a member subscribed to sent.
func (s *Scheduler) Told(i int, node string, bits []byte) { s.s.toldLocked(s.s.groups[i], node, bits) }

// ToldPiece applies a member's word that it got piece of content i.
func (s *Scheduler) ToldPiece(i int, node string, piece int) {
	s.s.toldPieceLocked(s.s.groups[i], node, piece)
}

// Have returns a copy of the pieces of content i held: what this node's
// holder key says.
func (s *Scheduler) Have(i int) []byte { return append([]byte(nil), s.s.groups[i].have...) }

// Left returns the number of pieces missing; InFlight those in flight.
func (s *Scheduler) Left() int { return s.s.left }

// InFlight returns the number of fetches in flight.
func (s *Scheduler) InFlight() int { return s.s.inFlights }

// Substitute has t, in flight, fetch piece of its content instead (its
// holder sent another piece than the one asked for), as Pull does: false
// if t did not accept it, or it is held or in flight meanwhile.
func (s *Scheduler) Substitute(t SimTask, piece int) (SimTask, bool) {
	if !s.s.substituteLocked(&t.t, piece) {
		return t, false
	}
	t.Piece = piece
	return t, true
}
