package cluster

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"math/rand/v2"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"tensorfs/cluster/transport"
)

// maxTxnOps bounds the operations of one transaction (etcd's default limit
// is 128).
const maxTxnOps = 64

// bitmap is a set of piece indexes: bit i of byte i/8.
type bitmap []byte

func newBitmap(pieces int) bitmap { return make(bitmap, (pieces+7)/8) }

func (b bitmap) has(i int) bool { return i >= 0 && i/8 < len(b) && b[i/8]&(1<<(i%8)) != 0 }
func (b bitmap) set(i int)      { b[i/8] |= 1 << (i % 8) }
func (b bitmap) clear(i int)    { b[i/8] &^= 1 << (i % 8) }

// count returns the number of pieces in b.
func (b bitmap) count() int {
	n := 0
	for _, x := range b {
		n += bits.OnesCount8(x)
	}
	return n
}

// fill sets pieces 0..pieces-1.
func (b bitmap) fill(pieces int) {
	for i := range pieces {
		b.set(i)
	}
}

// Holder key values (doc.go): the node holds every piece of the
// content, or some (a member: pulling, or having lost a piece).
const (
	holderComplete = "complete"
	holderPartial  = "partial"
)

// held is a content this node serves, and how much of it etcd knows.
type held struct {
	content *Content    // nil until an offered content is resolved
	src     io.ReaderAt // where its bytes are
	size    int64       // offered: the size src must have
	bits    bitmap      // pieces held and verified; nil until resolved
	pulling bool        // a Pull is filling it
	dropped bool        // to be deleted from etcd, then forgotten
	gen     uint64      // Node.gen at the last change to its holder key's value
	written uint64      // gen that etcd has
	sent    []int32     // times each piece was sent while complete (super-seeding); nil before
}

// complete reports whether h holds every piece of its content.
func (h *held) complete() bool {
	return h.content != nil && h.bits.count() == h.content.Pieces()
}

// Piece implements transport.Source: only pieces of published contents
// that this node holds are served, each read once into memory and
// verified there against its published hash as it is asked for, so that
// what is sent is what was verified. A piece whose bytes here no longer
// match (its file was changed under the node) is not served, logged, and
// no longer held. A node that holds every piece super-seeds: asked with
// pieces accepted in place (a puller asks so of a content's only seed),
// it sends the one it has sent least of (SuperSeed).
func (n *Node) Piece(p transport.Piece, accept []byte) (int, []byte, error) {
	n.mu.Lock()
	h := n.held[p.Content]
	switch {
	case h == nil && !n.offered || h != nil && !h.dropped && h.content == nil:
		// A successor taking over from a daemon that died serves on
		// its socket at once: a peer asks again later.
		n.mu.Unlock()
		return 0, nil, fmt.Errorf("content %.12s: %w (this daemon is starting: what it holds is not known yet)", p.Content, transport.ErrBusy)
	case h == nil || h.dropped || h.content == nil:
		n.mu.Unlock()
		return 0, nil, fmt.Errorf("content %.12s: %w (not held here)", p.Content, transport.ErrNotServed)
	case !h.bits.has(p.Index) || p.Index >= h.content.Pieces():
		n.mu.Unlock()
		return 0, nil, fmt.Errorf("piece %d of %.12s: %w (not held, or not verified yet)", p.Index, p.Content, transport.ErrNotServed)
	}
	i := p.Index
	if h.complete() {
		if h.sent == nil {
			h.sent = make([]int32, h.content.Pieces())
		}
		if len(accept) > 0 {
			i = SuperSeed(h.sent, i, accept, rand.IntN(len(h.sent)))
		}
		h.sent[i]++
	}
	c, src := h.content, h.src
	n.mu.Unlock()
	b, err := c.readPiece(src, i)
	if err != nil {
		n.distrust(p.Content, src, i, err)
		return 0, nil, fmt.Errorf("piece %d of %.12s: %w (it fails verification here)", i, p.Content, transport.ErrNotServed)
	}
	n.stats.piecesServed.Add(1)
	n.stats.bytesServed.Add(int64(len(b)))
	return i, b, nil
}

// SuperSeed returns the piece a holder of every piece sends when asked
// for piece asked by a puller that takes any of accept in its place
// (bit i of byte i/8): of asked and those, the one it has sent least of
// (sent, by piece), asked on a tie with it, else the first from piece
// start on (a random start breaks ties at random). So no piece goes out
// twice before every piece a puller asked or accepted went out once.
func SuperSeed(sent []int32, asked int, accept []byte, start int) int {
	best := asked
	for k := range len(sent) {
		i := (start + k) % len(sent)
		if sent[i] < sent[best] && bitmap(accept).has(i) {
			best = i
		}
	}
	return best
}

// distrust stops serving piece i of content id from src, whose bytes
// failed verification (err): it is logged, and the node no longer holds
// it (its watchers are told; its holder key no longer says complete).
func (n *Node) distrust(id string, src io.ReaderAt, i int, err error) {
	n.log.Warn("cluster: a piece held here fails verification; it is not served", "content", id, "piece", i, "err", err)
	n.stats.badPieces.Add(1)
	n.mu.Lock()
	defer n.mu.Unlock()
	if h := n.held[id]; h != nil && h.src == src && h.bits.has(i) {
		was := h.complete()
		h.bits.clear(i)
		n.changedLocked(id, h, was)
	}
}

// changedLocked records a change to the pieces of content id held (h):
// its watchers are told, and its holder key is written again if it no
// longer says what it said (wasComplete). n.mu is held.
func (n *Node) changedLocked(id string, h *held, wasComplete bool) {
	n.tellLocked(id)
	if h.complete() != wasComplete {
		h.gen = n.nextGen()
		n.kick()
	}
}

// Offer serves a complete content this node holds, reading it from src
// (size bytes), and announces it: the call a restarted daemon makes for
// each pulled or published segment it recovered whole. It returns at once;
// the content is looked up in etcd (and served, announced) when etcd
// answers. A content that is not published, or whose size is not size, is
// logged and never served.
func (n *Node) Offer(id string, src io.ReaderAt, size int64) error {
	if !validID(id) {
		return fmt.Errorf("%w: content ID %q", ErrInvalid, id)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return ErrClosed
	}
	if h := n.held[id]; h != nil && !h.dropped {
		return fmt.Errorf("%w: content %.12s is served already", ErrInvalid, id)
	}
	n.held[id] = &held{src: src, size: size, gen: n.nextGen()}
	n.kick()
	return nil
}

// Offered says the daemon has offered every content it recovered: from
// now on the node refuses a piece of any other (ErrNotServed), where
// before, taking over from an earlier daemon (Config.Resume), it asks the
// peer to come back (ErrBusy).
func (n *Node) Offered() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.offered = true
}

// Drop stops serving a content (its segment is gone from this node) and
// removes its holder key.
func (n *Node) Drop(id string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if h := n.held[id]; h != nil {
		h.dropped = true
		h.src = nil
		h.gen = n.nextGen()
		n.tellLocked(id)
		n.kick()
	}
}

// Serve reads content id, which this node holds, from src from now on:
// where the caller keeps it once a pull or publish that handed the node
// another reader is done with that one. A content not held is left
// alone.
func (n *Node) Serve(id string, src io.ReaderAt) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if h := n.held[id]; h != nil && !h.dropped {
		h.src = src
	}
}

// hold registers a content this node serves from src, with the pieces in
// bits held; pulling marks a content a Pull is filling.
func (n *Node) hold(c *Content, src io.ReaderAt, bits bitmap, pulling bool) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if h := n.held[c.ID()]; h != nil && !h.dropped {
		if h.pulling {
			return fmt.Errorf("%w: %.12s", ErrBusy, c.ID())
		}
		return fmt.Errorf("%w: content %.12s is served already", ErrInvalid, c.ID())
	}
	n.held[c.ID()] = &held{content: c, src: src, size: c.Size, bits: bits, pulling: pulling, gen: n.nextGen()}
	n.tellLocked(c.ID())
	n.kick()
	return nil
}

// holdPiece marks piece i of a content held: its watchers are told at
// once, and etcd once the node holds every piece.
func (n *Node) holdPiece(id string, i int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if h := n.held[id]; h != nil && !h.dropped {
		was := h.complete()
		h.bits.set(i)
		n.changedLocked(id, h, was)
	}
}

// endPull marks a pulled content complete, or drops it if incomplete.
func (n *Node) endPull(id string, complete bool) {
	n.mu.Lock()
	h := n.held[id]
	if h != nil {
		h.pulling = false
	}
	n.mu.Unlock()
	if h != nil && !complete {
		n.Drop(id)
	}
}

// completeSource returns the source of a content this node holds whole.
func (n *Node) completeSource(id string) io.ReaderAt {
	n.mu.Lock()
	defer n.mu.Unlock()
	h := n.held[id]
	if h == nil || h.dropped || h.pulling || h.content == nil {
		return nil
	}
	for i := range h.content.Pieces() {
		if !h.bits.has(i) {
			return nil
		}
	}
	return h.src
}

// nextGen returns a new generation number for a change to n.held; n.mu
// is held.
func (n *Node) nextGen() uint64 {
	n.gen++
	return n.gen
}

// kick wakes the announcer.
func (n *Node) kick() {
	select {
	case n.wake <- struct{}{}:
	default:
	}
}

// rewriteAll marks every content unwritten (a new lease has none of them)
// and wakes the announcer.
func (n *Node) rewriteAll() {
	n.mu.Lock()
	n.epoch++
	for _, h := range n.held {
		h.written = 0
	}
	n.mu.Unlock()
	n.kick()
}

// announce writes what this node holds to etcd whenever it changes,
// coalescing the changes made while a write is in flight. On failure it
// retries after Backoff; a new lease rewrites everything.
func (n *Node) announce() {
	defer n.wg.Done()
	for try := 0; ; {
		select {
		case <-n.wake:
		case <-n.ctx.Done():
			return
		}
		err := n.flush()
		if err == nil {
			try = 0
			continue
		}
		if n.ctx.Err() != nil {
			return
		}
		n.log.Warn("cluster: announcing held pieces failed; retrying", "node", n.cfg.Node, "err", err)
		sleep(n.ctx, Backoff(try))
		try++
		n.kick()
	}
}

// pending is one holder key to write.
type pending struct {
	id       string
	gen      uint64
	complete bool // it says holderComplete, else holderPartial
	delete   bool // delete the key instead
}

// flush writes every changed holder key, maxTxnOps at a time.
func (n *Node) flush() error {
	n.flushMu.Lock()
	defer n.flushMu.Unlock()
	for {
		if err := n.resolveOffers(); err != nil {
			return err
		}
		n.mu.Lock()
		s, epoch := n.sess, n.epoch
		var batch []pending
		for id, h := range n.held {
			if h.gen == h.written || h.content == nil && !h.dropped {
				continue
			}
			p := pending{id: id, gen: h.gen, complete: h.complete(), delete: h.dropped}
			if batch = append(batch, p); len(batch) == maxTxnOps {
				break
			}
		}
		n.mu.Unlock()
		if s == nil || len(batch) == 0 {
			return nil // run() rewrites everything once joined
		}
		if err := n.writeHolders(s, batch); err != nil {
			return err
		}
		n.mu.Lock()
		for _, p := range batch {
			if h := n.held[p.id]; h != nil && n.epoch == epoch {
				h.written = max(h.written, p.gen)
				if h.dropped && h.written == h.gen {
					delete(n.held, p.id)
				}
			}
		}
		n.mu.Unlock()
	}
}

// writeHolders writes a batch of holder keys under s's lease (each says
// whether this node holds the whole content: its membership, not which
// pieces), in one transaction that checks this node's key still carries
// that lease.
func (n *Node) writeHolders(s *concurrency.Session, batch []pending) error {
	ops := make([]clientv3.Op, 0, len(batch))
	for _, p := range batch {
		key := n.keys.holder(p.id, n.cfg.Node)
		if p.delete {
			ops = append(ops, clientv3.OpDelete(key))
		} else {
			value := holderPartial
			if p.complete {
				value = holderComplete
			}
			ops = append(ops, clientv3.OpPut(key, value, clientv3.WithLease(s.Lease())))
		}
	}
	ctx, cancel := n.timeout(n.ctx)
	defer cancel()
	resp, err := n.etcd.Txn(ctx).
		If(clientv3.Compare(clientv3.LeaseValue(n.keys.node(n.cfg.Node)), "=", int64(s.Lease()))).
		Then(ops...).
		Commit()
	if err != nil {
		return n.etcdErr("announce held pieces", err)
	}
	if !resp.Succeeded {
		s.Orphan() // our name is no longer under this lease: join again
		return fmt.Errorf("%w: node %s's key no longer carries its lease", ErrUnavailable, n.cfg.Node)
	}
	return nil
}

// resolveOffers looks up offered contents in etcd; those found (and of the
// offered size) are served and announced in full, the others dropped.
func (n *Node) resolveOffers() error {
	n.mu.Lock()
	var ids []string
	for id, h := range n.held {
		if h.content == nil && !h.dropped {
			ids = append(ids, id)
		}
	}
	n.mu.Unlock()
	for _, id := range ids {
		c, err := n.Content(n.ctx, id)
		n.mu.Lock()
		h := n.held[id]
		switch {
		case h == nil || h.dropped || h.content != nil:
		case err == nil && c.Size == h.size:
			h.content, h.bits = c, newBitmap(c.Pieces())
			h.bits.fill(c.Pieces())
			h.gen = n.nextGen()
			n.tellLocked(id)
			n.log.Info("cluster: serving a recovered content", "content", id, "bytes", c.Size)
		case err == nil || errors.Is(err, ErrNotPublished) || errors.Is(err, ErrCorrupt):
			if err == nil {
				err = fmt.Errorf("offered %d bytes, published %d", h.size, c.Size)
			}
			n.log.Warn("cluster: not serving an offered content", "content", id, "err", err)
			delete(n.held, id)
		default:
			n.mu.Unlock()
			return err
		}
		n.mu.Unlock()
	}
	return nil
}

// watcher is a peer's watch of contents this node holds
// (transport.Watcher); the transport bounds how many there are.
type watcher struct {
	n   *Node
	ids []string
	ch  chan struct{} // buffered, 1
}

// Holding implements transport.Source: a watcher told of every change to
// the pieces held of ids.
func (n *Node) Holding(ids []string) (transport.Watcher, error) {
	w := &watcher{n: n, ids: ids, ch: make(chan struct{}, 1)}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return nil, ErrClosed
	}
	for _, id := range ids {
		if n.watchers[id] == nil {
			n.watchers[id] = map[*watcher]bool{}
		}
		n.watchers[id][w] = true
	}
	return w, nil
}

// Bits implements transport.Watcher: the pieces of content i held and
// verified, nil if none is served (not held, dropped, not resolved yet).
func (w *watcher) Bits(i int) []byte {
	w.n.mu.Lock()
	defer w.n.mu.Unlock()
	h := w.n.held[w.ids[i]]
	if h == nil || h.dropped || h.content == nil {
		return nil
	}
	return bytes.Clone(h.bits)
}

// Changed implements transport.Watcher.
func (w *watcher) Changed() <-chan struct{} { return w.ch }

// Stop implements transport.Watcher.
func (w *watcher) Stop() {
	w.n.mu.Lock()
	defer w.n.mu.Unlock()
	for _, id := range w.ids {
		if delete(w.n.watchers[id], w); len(w.n.watchers[id]) == 0 {
			delete(w.n.watchers, id)
		}
	}
}

// tellLocked tells the watchers of content id that it changed. n.mu is
// held.
func (n *Node) tellLocked(id string) {
	for w := range n.watchers[id] {
		select {
		case w.ch <- struct{}{}:
		default:
		}
	}
}
