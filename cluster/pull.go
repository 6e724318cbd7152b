package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"tensorfs/cluster/transport"
)

// Pull defaults (Config).
const (
	DefaultParallel     = 4
	DefaultPerPeer      = 2
	DefaultNoHolderWait = 30 * time.Second
)

// errTaken fails a fetch whose peer sent, in place of the piece asked, a
// piece this node got or began to fetch meanwhile (super-seeding): the
// bytes are not taken, and the piece asked is free to be asked again.
var errTaken = errors.New("the piece sent instead is taken meanwhile")

// Job is one content to pull into a destination file.
type Job struct {
	// Content is what to fetch, from Version: every piece is checked
	// against its hash before it is written off as held.
	Content *Content
	// Dst is the segment's backing file, already Content.Size bytes long.
	// The transport places pieces straight into it at their offsets, and
	// nowhere else; once verified, this node serves them from it.
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
	jobs   []*group // job i's group
	done   chan struct{}
	// watched are the groups fetched from peers (at most
	// transport.MaxWatched: those past it learn of complete holders
	// only), ids their content IDs: what a watch of a member asks for.
	watched  []*group
	ids      []string
	watching sync.WaitGroup // the watches' goroutines

	mu        sync.Mutex
	scheduler                               // what to fetch next, from whom; the groups
	err       error                         // why the pull failed
	watches   map[string]context.CancelFunc // ends the watch of each member subscribed to
	changed   chan struct{}                 // closed and replaced at every change
	total     int64                         // bytes of all groups
	start     time.Time                     // when the pull began
	end       time.Time                     // when it ended (zero until then)
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
		n: n, done: make(chan struct{}), changed: make(chan struct{}), watches: map[string]context.CancelFunc{},
		scheduler: newScheduler(n.cfg.Node, n.cfg.PerPeer, rand.Uint64(), time.Now()), start: time.Now(),
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
			g = newGroup(j.Content)
			byID[j.Content.ID()] = g
			p.groups = append(p.groups, g)
			p.total += j.Content.Size
		}
		g.dsts = append(g.dsts, j.Dst)
		g.wanted++
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
		if len(p.watched) < transport.MaxWatched {
			p.watched = append(p.watched, g)
			p.ids = append(p.ids, g.c.ID())
		}
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

// Drop stops fetching job i's content once no other job of the pull
// wants it (its destination is no longer wanted: the segment was
// replaced or removed), and reports whether it did: its Done never
// closes, the pull ends without it, and what it holds of the content is
// served no more. False for a job complete or copied from this node. Call
// it once per job.
func (p *Pull) Drop(i int) bool {
	g := p.jobs[i]
	p.mu.Lock()
	g.wanted--
	drop := g.wanted == 0 && g.left > 0 && g.local == nil
	if drop {
		g.dropped = true
		for j := range g.c.Pieces() {
			if !g.have.has(j) {
				_, size := g.c.PieceRange(j)
				p.total -= size
			}
		}
		p.left -= g.left
		g.left = 0
		p.signalLocked()
	}
	p.mu.Unlock()
	if drop {
		p.n.endPull(g.c.ID(), false)
	}
	return drop
}

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
	for _, st := range p.state {
		if st.inflight > 0 {
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
	p.watching.Wait()
	p.mu.Lock()
	if p.err == nil && p.left > 0 {
		p.err = fmt.Errorf("cluster: pull: %w", context.Cause(p.ctx))
		if p.n.ctx.Err() != nil {
			p.err = fmt.Errorf("cluster: pull: %w", ErrClosed)
		}
	}
	for _, g := range p.groups {
		// A dropped group's pull ended at its Drop: the content may be
		// another pull's since (held anew), which is not to be ended.
		if g.local == nil && !g.dropped {
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
		if t, ok := p.claimLocked(time.Now()); ok {
			return t, true
		}
		if p.inFlights == 0 && time.Since(p.lastStep) > p.n.cfg.NoHolderWait {
			p.err = fmt.Errorf("cluster: pull: %w: %s; pull again once a node that holds it (its publisher, or one that pulled it) is up", ErrNoHolder, p.missingLocked())
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
			if !g.have.has(i) && !g.dropped {
				var holders []string
				for node, h := range g.holders {
					if h.bits.has(i) {
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

// fetch fetches one piece into the first destination, verifies it there,
// copies it to the others and records the outcome. A seed may send
// another piece of those t accepts (super-seeding): t becomes its fetch,
// unless that piece is held or in flight meanwhile (errTaken).
func (p *Pull) fetch(t task) {
	g, id := t.g, t.g.c.ID()
	off, size := g.c.PieceRange(t.i)
	dst := newHashedDest(g.dsts[0], off)
	d := transport.Dest{File: dst, Off: off, Len: size, Accept: t.accept}
	d.For = func(i int) (transport.Dest, error) {
		p.mu.Lock()
		ok := p.substituteLocked(&t, i)
		p.mu.Unlock()
		if !ok {
			return transport.Dest{}, fmt.Errorf("piece %d of %.12s: %w", i, id, errTaken)
		}
		off, size = g.c.PieceRange(i)
		dst = newHashedDest(g.dsts[0], off)
		return transport.Dest{File: dst, Off: off, Len: size}, nil
	}
	got, err := p.n.tr.Fetch(p.ctx, t.peer, transport.Piece{Content: id, Index: t.i}, d)
	o, err := p.settle(t, dst, got, err)

	p.mu.Lock()
	defer p.mu.Unlock()
	defer p.signalLocked()
	if g.dropped {
		o = cancelled // its destination may be gone: nothing of it counts
		err = nil
	}
	if o == cancelled && err != nil {
		p.err = cmpErr(p.err, fmt.Errorf("cluster: pull: writing piece %d of %.12s: %w", t.i, id, err))
		p.cancel()
	}
	backoff := p.finishLocked(t, o, time.Now())
	log := p.n.log.With("content", id, "piece", t.i, "peer", t.peer.Name)
	switch o {
	case notServed:
		p.n.stats.failedFetches.Add(1)
		log.Info("cluster: peer does not serve a piece it announced; asking another", "err", err)
	case failed:
		p.n.stats.failedFetches.Add(1)
		if backoff > 0 {
			log.Warn("cluster: fetch failed; asking other holders", "retry_in", backoff, "err", err)
		}
	case badPiece:
		p.n.stats.badPieces.Add(1)
		log.Warn("cluster: piece failed verification; fetching it from another holder", "err", err, "peer_strikes", p.state[t.peer.Name].strikes)
	case fetched:
		p.n.stats.piecesFetched.Add(1)
		p.n.stats.bytesFetched.Add(size)
		p.n.holdPiece(id, t.i)
		if g.left == 0 {
			close(g.done)
		}
	}
}

// settle classifies a fetch of task t that wrote got bytes through dst and
// returned err: it verifies the piece in the first destination (from what
// dst hashed as it was written) and copies it to the others. The error says why a fetch failed or its piece is bad; with
// cancelled, it is a local failure (a write the destination refused,
// reading it back), fatal to the pull.
func (p *Pull) settle(t task, dst *hashedDest, got int64, err error) (outcome, error) {
	g := t.g
	off, size := g.c.PieceRange(t.i)
	switch {
	case errors.Is(err, transport.ErrDest):
		return cancelled, err
	case p.ctx.Err() != nil || errors.Is(err, errTaken):
		return cancelled, nil
	case errors.Is(err, transport.ErrNotServed):
		return notServed, err
	case errors.Is(err, transport.ErrBusy):
		return busy, err
	case err != nil:
		return failed, err
	case got != size:
		return badPiece, fmt.Errorf("%d bytes of %d", got, size)
	}
	if err := dst.verifyPiece(g.c, g.dsts[0], t.i); err != nil {
		if !errors.Is(err, ErrBadCopy) {
			return cancelled, err
		}
		return badPiece, err
	}
	for _, dst := range g.dsts[1:] {
		if _, err := io.Copy(io.NewOffsetWriter(dst, off), io.NewSectionReader(g.dsts[0], off, size)); err != nil {
			return cancelled, err
		}
	}
	return fetched, nil
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
			p.mu.Lock() // the watches of the groups before it run
			for _, kv := range kvs {
				p.keyLocked(g, strings.TrimPrefix(string(kv.Key), n.keys.holders(g.c.ID())), kv.Value)
			}
			p.mu.Unlock()
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
		p.unwatchLocked(p.unkeyLocked(g, node))
	} else {
		p.keyLocked(g, node, ev.Kv.Value)
	}
	p.lastStep = time.Now()
	p.signalLocked()
	return p.ctx.Err() == nil
}

// keyLocked applies node's holder key of g (its value), and starts and
// ends the watches the scheduler asks for.
func (p *Pull) keyLocked(g *group, node string, value []byte) {
	sub, unsub := p.scheduler.keyLocked(g, node, string(value) == holderComplete)
	p.unwatchLocked(unsub)
	if sub != "" && len(p.ids) > 0 {
		ctx, cancel := context.WithCancel(p.ctx)
		p.watches[sub] = cancel
		p.watching.Go(func() { p.watch(ctx, sub) })
	}
}

// unwatchLocked ends the watch of node, if any ("" for none).
func (p *Pull) unwatchLocked(node string) {
	if cancel := p.watches[node]; cancel != nil {
		cancel()
		delete(p.watches, node)
	}
}

// watch subscribes to what member node holds of the watched groups, and
// hands the scheduler what it tells, until ctx ends: the watch is tried
// again after Backoff when it fails or the node's address is not known
// yet (a failure is logged once).
func (p *Pull) watch(ctx context.Context, node string) {
	logged := false
	for try := 0; ctx.Err() == nil; try++ {
		p.mu.Lock()
		addr := p.peers[node]
		p.mu.Unlock()
		if addr != "" {
			err := p.n.tr.Watch(ctx, transport.Peer{Name: node, Addr: addr}, p.ids, func(u transport.Update) { p.told(node, u) })
			if err != nil && !logged && ctx.Err() == nil {
				p.n.log.Info("cluster: watching what a peer holds failed; retrying", "peer", node, "err", err)
				logged = true
			}
		}
		sleep(ctx, Backoff(try))
	}
}

// told applies update u from node to the scheduler.
func (p *Pull) told(node string, u transport.Update) {
	g := p.watched[u.Content]
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case u.Gone:
		p.toldLocked(g, node, nil)
	case u.Bits != nil:
		p.toldLocked(g, node, u.Bits)
	default:
		p.toldPieceLocked(g, node, u.Piece)
	}
	p.lastStep = time.Now()
	p.signalLocked()
}
