package cluster

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"tensorfs/cluster/transport"
)

// Pull defaults (Config).
const (
	DefaultParallel     = 8
	DefaultPerPeer      = 2
	DefaultNoHolderWait = 30 * time.Second
	// fetchIdle ends a fetch that has received nothing for this long.
	fetchIdle = 10 * time.Second
	// maxStrikes is how many bad pieces a peer may send before a pull
	// stops asking it for anything.
	maxStrikes = 3
)

// Job is one content to pull into a destination file.
type Job struct {
	// Content is what to fetch, from Version: every piece is checked
	// against its hash before it is written off as held.
	Content *Content
	// Dst is the segment's backing file, already Content.Size bytes long.
	// Pieces are written straight into it at their offsets, and nowhere
	// else; once verified, this node serves them from it.
	Dst *os.File
}

// Progress is where a pull stands.
type Progress struct {
	Bytes, Total int64            // verified bytes so far, and in all
	Rate         float64          // bytes per second since the pull began
	ETA          time.Duration    // at Rate; 0 when done or unknown
	Peers        int              // peers with a fetch in flight now
	Elapsed      time.Duration    // since the pull began, until it ended
	ByPeer       map[string]int64 // verified bytes fetched from each peer
}

// Pull is a transfer of contents from the nodes that hold them.
type Pull struct {
	n      *Node
	ctx    context.Context
	cancel context.CancelFunc
	groups []*group // one per distinct content
	jobs   []*group // job i's group
	done   chan struct{}

	mu        sync.Mutex
	err       error                // why the pull failed
	changed   chan struct{}        // closed and replaced at every change
	peers     map[string]string    // live nodes: name to address
	inflight  map[string]int       // fetches in flight per peer
	fails     map[string]int       // consecutive failures per peer
	down      map[string]time.Time // do not ask a peer before this
	strikes   map[string]int       // bad pieces per peer
	byPeer    map[string]int64     // verified bytes per peer
	bytes     int64                // verified bytes
	total     int64                // bytes of all groups
	left      int                  // pieces missing
	start     time.Time            // when the pull began
	end       time.Time            // when it ended (zero until then)
	lastStep  time.Time            // last piece held, or holder news
	inFlights int                  // fetches in flight
	scratch   []string             // holderLocked's
}

// group is one distinct content of a pull and where it goes.
type group struct {
	c       *Content
	dsts    []*os.File
	local   io.ReaderAt       // a complete copy this node holds already
	holders map[string]bitmap // node to the pieces it holds
	seeds   map[string]bool   // holders that have every piece
	have    bitmap            // pieces written and verified
	busy    map[int]bool      // pieces in flight
	bad     map[int][]string  // peers that sent a bad copy of a piece
	left    int               // pieces missing
	done    chan struct{}     // closed when complete

	// This node's share of the pieces one node holds: those with
	// (index+offset) % shares == share (see mine).
	share, shares, offset int
}

// Pull starts fetching jobs from the nodes that hold them and returns: Done
// tells when each job is complete, Wait when all are, Progress how far it
// got. Pieces are fetched several at once, rarest first, each from the
// least busy of its holders; a piece that fails verification is fetched
// again from another holder (and logged); a holder that dies is left for
// the others. Each verified piece is served to peers and announced at once.
// Jobs with equal contents are fetched once and written to each
// destination. Ends with ctx or Close; a pull that fails or is cancelled
// stops serving what it had not completed. Fails at once with
// ErrUnavailable when etcd does not answer, ErrBusy when this node is
// pulling one of the contents already.
func (n *Node) Pull(ctx context.Context, jobs []Job) (*Pull, error) {
	p := &Pull{
		n: n, done: make(chan struct{}), changed: make(chan struct{}),
		peers: map[string]string{}, inflight: map[string]int{}, fails: map[string]int{},
		down: map[string]time.Time{}, strikes: map[string]int{}, byPeer: map[string]int64{},
		start: time.Now(), lastStep: time.Now(),
	}
	byID := map[string]*group{}
	for i, j := range jobs {
		if j.Content == nil || !validID(j.Content.ID()) || j.Dst == nil {
			return nil, fmt.Errorf("%w: pull job %d: no content or no destination", ErrInvalid, i)
		}
		st, err := j.Dst.Stat()
		if err != nil {
			return nil, fmt.Errorf("cluster: pull job %d: %w", i, err)
		}
		if st.Size() != j.Content.Size {
			return nil, fmt.Errorf("%w: pull job %d: destination %s has %d bytes, the content %d", ErrInvalid, i, j.Dst.Name(), st.Size(), j.Content.Size)
		}
		g := byID[j.Content.ID()]
		if g == nil {
			pieces := j.Content.Pieces()
			g = &group{c: j.Content, holders: map[string]bitmap{}, seeds: map[string]bool{}, have: newBitmap(pieces),
				busy: map[int]bool{}, bad: map[int][]string{}, left: pieces, done: make(chan struct{}),
				offset: int(j.Content.ID()[0])} // spreads the first shares of many contents
			byID[j.Content.ID()] = g
			p.groups = append(p.groups, g)
			p.total += j.Content.Size
		}
		g.dsts = append(g.dsts, j.Dst)
		p.jobs = append(p.jobs, g)
	}
	var held []*group
	undo := func() {
		for _, g := range held {
			n.endPull(g.c.ID(), false)
		}
	}
	for _, g := range p.groups {
		if g.local = n.completeSource(g.c.ID()); g.local != nil {
			continue
		}
		if err := n.hold(g.c, g.dsts[0], newBitmap(g.c.Pieces()), true); err != nil {
			undo()
			return nil, fmt.Errorf("cluster: pull: %w", err)
		}
		held = append(held, g)
		p.left += g.left
		if g.left == 0 {
			close(g.done) // an empty file
		}
	}
	p.ctx, p.cancel = context.WithCancel(ctx)
	stop := context.AfterFunc(n.ctx, p.cancel)
	if err := p.load(); err != nil {
		stop()
		p.cancel()
		undo()
		return nil, err
	}
	n.mu.Lock()
	closed := n.closed
	if !closed {
		n.wg.Add(1) // Close waits for the pull to end
	}
	n.mu.Unlock()
	if closed {
		stop()
		p.cancel()
		undo()
		return nil, ErrClosed
	}
	go func() {
		defer n.wg.Done()
		defer stop()
		p.run()
	}()
	return p, nil
}

// Done returns a channel closed when job i is complete.
func (p *Pull) Done(i int) <-chan struct{} { return p.jobs[i].done }

// Wait waits for the pull to end and returns why it failed, if it did.
func (p *Pull) Wait() error {
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// Progress returns where the pull stands.
func (p *Pull) Progress() Progress {
	p.mu.Lock()
	defer p.mu.Unlock()
	end := p.end
	if end.IsZero() {
		end = time.Now()
	}
	pr := Progress{Bytes: p.bytes, Total: p.total, Elapsed: end.Sub(p.start), ByPeer: map[string]int64{}}
	for peer, b := range p.byPeer {
		pr.ByPeer[peer] = b
	}
	for _, k := range p.inflight {
		if k > 0 {
			pr.Peers++
		}
	}
	if s := pr.Elapsed.Seconds(); s > 0 {
		pr.Rate = float64(pr.Bytes) / s
	}
	if pr.Rate > 0 && pr.Bytes < pr.Total {
		pr.ETA = time.Duration(float64(pr.Total-pr.Bytes) / pr.Rate * float64(time.Second))
	}
	return pr
}

// String formats a progress line: bytes, rate, ETA, peers.
func (pr Progress) String() string {
	const mib = 1 << 20
	s := fmt.Sprintf("%.1f/%.1f MiB  %.1f MiB/s  %d peers", float64(pr.Bytes)/mib, float64(pr.Total)/mib, pr.Rate/mib, pr.Peers)
	if pr.ETA > 0 {
		s += fmt.Sprintf("  ETA %s", pr.ETA.Round(time.Second))
	}
	return s
}

// run copies the contents held locally, fetches the rest, and ends the
// pull.
func (p *Pull) run() {
	var wg sync.WaitGroup
	for range p.n.cfg.Parallel {
		wg.Go(p.worker)
	}
	for _, g := range p.groups {
		if g.local != nil {
			p.copyLocal(g)
		}
	}
	wg.Wait()
	p.cancel()
	p.mu.Lock()
	if p.err == nil && p.left > 0 {
		p.err = fmt.Errorf("cluster: pull: %w", context.Cause(p.ctx))
		if p.n.ctx.Err() != nil {
			p.err = fmt.Errorf("cluster: pull: %w", ErrClosed)
		}
	}
	for _, g := range p.groups {
		if g.local == nil {
			p.n.endPull(g.c.ID(), g.left == 0)
		}
	}
	err := p.err
	p.end = time.Now()
	p.mu.Unlock()
	pr := p.Progress()
	if err != nil {
		p.n.log.Warn("cluster: pull failed", "err", err, "bytes", pr.Bytes, "total", pr.Total)
	} else {
		p.n.log.Info("cluster: pull complete", "bytes", pr.Total, "seconds", pr.Elapsed.Seconds(), "from", pr.ByPeer)
	}
	close(p.done)
}

// copyLocal fills g's destinations from the complete copy this node has,
// verifying it first: a copy that fails is no longer served (distrust),
// and the pull fails with ErrBadCopy; pulled again, the content is
// fetched from peers.
func (p *Pull) copyLocal(g *group) {
	buf := make([]byte, verifyBuf)
	for i := range g.c.Pieces() {
		if err := g.c.verifyPiece(g.local, i, buf); err != nil {
			p.n.distrust(g.c.ID(), g.local, i, err)
			p.fail(fmt.Errorf("cluster: pull: the copy of content %.12s held here: %w", g.c.ID(), err))
			return
		}
	}
	for _, dst := range g.dsts {
		if _, err := io.Copy(io.NewOffsetWriter(dst, 0), io.NewSectionReader(g.local, 0, g.c.Size)); err != nil {
			p.fail(fmt.Errorf("cluster: pull: copying content %.12s held here: %w", g.c.ID(), err))
			return
		}
	}
	p.mu.Lock()
	p.bytes += g.c.Size
	p.mu.Unlock()
	close(g.done)
}

// fail ends the pull with err (the first error wins).
func (p *Pull) fail(err error) {
	p.mu.Lock()
	if p.err == nil {
		p.err = err
	}
	p.mu.Unlock()
	p.cancel()
}

// signalLocked wakes the workers waiting for a change; p.mu is held.
func (p *Pull) signalLocked() {
	close(p.changed)
	p.changed = make(chan struct{})
}

// task is one piece to fetch from one peer.
type task struct {
	g    *group
	i    int
	peer transport.Peer
}

func (p *Pull) worker() {
	for {
		t, ok := p.next()
		if !ok {
			return
		}
		p.fetch(t)
	}
}

// next waits for a piece that can be fetched now and claims it; false when
// the pull is over.
func (p *Pull) next() (task, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		if p.ctx.Err() != nil || p.left == 0 {
			return task{}, false
		}
		if t, ok := p.pickLocked(); ok {
			t.g.busy[t.i] = true
			p.inflight[t.peer.Name]++
			p.inFlights++
			return t, true
		}
		if p.inFlights == 0 && time.Since(p.lastStep) > p.n.cfg.NoHolderWait {
			p.err = fmt.Errorf("cluster: pull: %w: %s", ErrNoHolder, p.missingLocked())
			p.cancel()
			return task{}, false
		}
		ch := p.changed
		p.mu.Unlock()
		t := time.NewTimer(250 * time.Millisecond) // peers come out of backoff
		select {
		case <-ch:
		case <-t.C:
		case <-p.ctx.Done():
		}
		t.Stop()
		p.mu.Lock()
	}
}

// missingLocked describes a piece no live holder has, for the error.
func (p *Pull) missingLocked() string {
	for _, g := range p.groups {
		for i := range g.c.Pieces() {
			if !g.have.has(i) {
				var holders []string
				for node, bits := range g.holders {
					if bits.has(i) {
						holders = append(holders, node)
					}
				}
				return fmt.Sprintf("piece %d of content %.12s waited %v; holders known: %v (bad copies from %v)",
					i, g.c.ID(), p.n.cfg.NoHolderWait, holders, g.bad[i])
			}
		}
	}
	return ""
}

// pickLocked chooses the next piece: among the missing pieces not in
// flight, one with the fewest usable holders (rarest first, so pieces
// spread before they are copied again), ties broken at random; from its
// least busy usable holder. A piece only one node holds is fetched by one
// of the nodes pulling it (each takes its share, see group.mine), so that
// its holder sends it once; the others fetch it from that puller. Another
// puller's share is taken only when there is nothing else to do. p.mu is
// held.
func (p *Pull) pickLocked() (task, bool) {
	var (
		best, other task
		bestRarity  = math.MaxInt
		ties        int
		haveOther   bool
		now         = time.Now()
	)
	gi0 := rand.IntN(len(p.groups))
	for k := range p.groups {
		g := p.groups[(gi0+k)%len(p.groups)]
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
			rarity, peer := p.holderLocked(g, i, now)
			if peer == "" {
				continue
			}
			t := task{g: g, i: i, peer: transport.Peer{Name: peer, Addr: p.peers[peer]}}
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
	return other, haveOther && p.inFlights == 0
}

// mine reports whether piece i is this node's share of the pieces of g
// that only one node holds: the nodes pulling g (those whose bitmaps are
// incomplete) split them by index.
func (g *group) mine(i int) bool {
	return g.shares <= 1 || (i+g.offset)%g.shares == g.share
}

// holdersChangedLocked recomputes, after a change to g's holders, which
// of them have it all (g.seeds), and this node's share of g among the
// nodes pulling it (those whose bitmaps are incomplete). p.mu is held.
func (p *Pull) holdersChangedLocked(g *group) {
	names := []string{p.n.cfg.Node}
	clear(g.seeds)
	for node, bits := range g.holders {
		switch {
		case node == p.n.cfg.Node:
		case bits.count() < g.c.Pieces():
			names = append(names, node)
		default:
			g.seeds[node] = true
		}
	}
	slices.Sort(names)
	g.shares, g.share = len(names), slices.Index(names, p.n.cfg.Node)
}

// holderLocked returns how many usable holders piece i of g has, and the
// least busy of them with room for another fetch ("" if none). Holders
// that have the whole content (the publisher, nodes done pulling) count as
// busier by PerPeer for a piece others hold too: their upload is kept for
// the pieces only they have. p.mu is held.
func (p *Pull) holderLocked(g *group, i int, now time.Time) (int, string) {
	usable := p.scratch[:0]
	for node, bits := range g.holders {
		if bits.has(i) && p.peers[node] != "" && !p.down[node].After(now) && p.strikes[node] < maxStrikes && !slices.Contains(g.bad[i], node) {
			usable = append(usable, node)
		}
	}
	p.scratch = usable
	chosen, least, ties := "", math.MaxInt, 0
	for _, node := range usable {
		load := p.inflight[node]
		if load >= p.n.cfg.PerPeer {
			continue
		}
		if len(usable) > 1 && g.seeds[node] {
			load += p.n.cfg.PerPeer
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

// fetch fetches one piece into its destinations, verifies it and records
// the outcome.
func (p *Pull) fetch(t task) {
	g, id := t.g, t.g.c.ID()
	off, size := g.c.PieceRange(t.i)
	w := &pieceWriter{dsts: g.dsts, off: off, end: off + size, h: sha256.New()}
	ctx, cancel := context.WithCancelCause(p.ctx)
	idle := time.AfterFunc(fetchIdle, func() { cancel(fmt.Errorf("nothing received for %v", fetchIdle)) })
	w.progress = func() { idle.Reset(fetchIdle) }
	got, err := p.n.tr.Fetch(ctx, t.peer, transport.Piece{Content: id, Index: t.i}, w)
	idle.Stop()
	cancel(nil)
	sum := w.h.Sum(nil)

	p.mu.Lock()
	defer p.mu.Unlock()
	p.inflight[t.peer.Name]--
	p.inFlights--
	delete(g.busy, t.i)
	defer p.signalLocked()
	log := p.n.log.With("content", id, "piece", t.i, "peer", t.peer.Name)
	switch {
	case w.err != nil:
		p.err = cmpErr(p.err, fmt.Errorf("cluster: pull: writing piece %d of %.12s: %w", t.i, id, w.err))
		p.cancel()
	case p.ctx.Err() != nil:
	case err != nil:
		p.n.stats.failedFetches.Add(1)
		if errors.Is(err, transport.ErrNotServed) {
			g.bad[t.i] = append(g.bad[t.i], t.peer.Name)
			log.Info("cluster: peer does not serve a piece it announced; asking another", "err", err)
			break
		}
		if p.down[t.peer.Name].After(time.Now()) {
			break // the fetches in flight when it failed: one failure
		}
		p.fails[t.peer.Name]++
		backoff := min(time.Second<<min(p.fails[t.peer.Name]-1, 4), 10*time.Second)
		p.down[t.peer.Name] = time.Now().Add(backoff)
		log.Warn("cluster: fetch failed; asking other holders", "retry_in", backoff, "err", err)
	case got != size || !bytes.Equal(sum, g.c.pieceHash(t.i)):
		p.n.stats.badPieces.Add(1)
		p.strikes[t.peer.Name]++
		g.bad[t.i] = append(g.bad[t.i], t.peer.Name)
		log.Warn("cluster: piece failed verification; fetching it from another holder",
			"bytes", got, "want_bytes", size, "sha256", fmt.Sprintf("%x", sum), "want_sha256", fmt.Sprintf("%x", g.c.pieceHash(t.i)),
			"peer_strikes", p.strikes[t.peer.Name])
	default:
		p.fails[t.peer.Name] = 0
		g.have.set(t.i)
		g.left--
		p.left--
		p.bytes += size
		p.byPeer[t.peer.Name] += size
		p.lastStep = time.Now()
		p.n.stats.piecesFetched.Add(1)
		p.n.stats.bytesFetched.Add(size)
		p.n.holdPiece(id, t.i)
		if g.left == 0 {
			close(g.done)
		}
	}
}

// pieceWriter writes a piece's bytes, as they arrive, to each destination
// at the piece's offset, and hashes them. It never writes past the piece.
type pieceWriter struct {
	dsts     []*os.File
	off, end int64
	h        hash.Hash
	progress func()
	err      error // a local write failure (ENOSPC, EIO): fatal to the pull
}

func (w *pieceWriter) Write(b []byte) (int, error) {
	if int64(len(b)) > w.end-w.off {
		return 0, fmt.Errorf("peer sent more than the piece's %d bytes", w.end)
	}
	for _, f := range w.dsts {
		if _, err := f.WriteAt(b, w.off); err != nil {
			w.err = err
			return 0, err
		}
	}
	w.h.Write(b)
	w.off += int64(len(b))
	w.progress()
	return len(b), nil
}

// load reads the live nodes and the holders of every group, and watches
// both from then on (watchPrefix, from what was read).
func (p *Pull) load() error {
	n := p.n
	ctx, cancel := n.timeout(p.ctx)
	defer cancel()
	resp, err := n.etcd.Get(ctx, n.keys.nodes(), clientv3.WithPrefix())
	if err != nil {
		return n.etcdErr("list nodes", err)
	}
	for _, kv := range resp.Kvs {
		p.setPeerLocked(string(kv.Key), kv.Value)
	}
	go n.watchPrefix(p.ctx, n.keys.nodes(), revisions(resp.Kvs), resp.Header.Revision+1, p.onNode)
	var pending []*group
	for _, g := range p.groups {
		if g.local == nil {
			pending = append(pending, g)
		}
	}
	for len(pending) > 0 {
		batch := pending[:min(len(pending), maxTxnOps)]
		pending = pending[len(batch):]
		ops := make([]clientv3.Op, len(batch))
		for i, g := range batch {
			ops[i] = clientv3.OpGet(n.keys.holders(g.c.ID()), clientv3.WithPrefix())
		}
		resp, err := n.etcd.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return n.etcdErr("list holders", err)
		}
		for i, g := range batch {
			kvs := resp.Responses[i].GetResponseRange().Kvs
			for _, kv := range kvs {
				g.holders[strings.TrimPrefix(string(kv.Key), n.keys.holders(g.c.ID()))] = bitmap(kv.Value)
			}
			p.holdersChangedLocked(g)
			go n.watchPrefix(p.ctx, n.keys.holders(g.c.ID()), revisions(kvs), resp.Header.Revision+1, func(ev *clientv3.Event) bool { return p.onHolder(g, ev) })
		}
	}
	return nil
}

// revisions returns the ModRevision of each of kvs, by key: what
// watchPrefix is told the caller knows.
func revisions(kvs []*mvccpb.KeyValue) map[string]int64 {
	known := make(map[string]int64, len(kvs))
	for _, kv := range kvs {
		known[string(kv.Key)] = kv.ModRevision
	}
	return known
}

// onNode applies a change to the live nodes; true while the pull runs.
func (p *Pull) onNode(ev *clientv3.Event) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if ev.Type == clientv3.EventTypeDelete {
		delete(p.peers, strings.TrimPrefix(string(ev.Kv.Key), p.n.keys.nodes()))
	} else {
		p.setPeerLocked(string(ev.Kv.Key), ev.Kv.Value)
	}
	p.lastStep = time.Now()
	p.signalLocked()
	return p.ctx.Err() == nil
}

// setPeerLocked records a node's address from its key and value.
func (p *Pull) setPeerLocked(key string, value []byte) {
	name := strings.TrimPrefix(key, p.n.keys.nodes())
	var info nodeInfo
	if err := json.Unmarshal(value, &info); err != nil || info.Addr == "" || name == p.n.cfg.Node {
		return
	}
	p.peers[name] = info.Addr
}

// onHolder applies a change to the holders of g; true while the pull
// runs.
func (p *Pull) onHolder(g *group, ev *clientv3.Event) bool {
	node := strings.TrimPrefix(string(ev.Kv.Key), p.n.keys.holders(g.c.ID()))
	p.mu.Lock()
	defer p.mu.Unlock()
	if ev.Type == clientv3.EventTypeDelete {
		delete(g.holders, node)
	} else {
		g.holders[node] = bitmap(ev.Kv.Value)
	}
	p.holdersChangedLocked(g)
	p.lastStep = time.Now()
	p.signalLocked()
	return p.ctx.Err() == nil
}
