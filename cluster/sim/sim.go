// Package sim runs the piece scheduler of package cluster (the code that
// picks, for every pull, which piece to fetch next and from which holder)
// on a simulated cluster: one seeder that holds a model, N nodes pulling
// it at once, some of them starting late and some dying mid-pull, over a
// network of per-node upload and download bandwidth and latency, with a
// virtual clock. Nothing runs in real time: a thousand nodes pulling a
// model take seconds.
//
// What is simulated, and how:
//   - A fetch asks its holder (one latency), then its bytes flow; it ends
//     one latency after its last byte left. Flows share each node's
//     uplink and downlink equally: a flow's rate is the lesser of its
//     sender's upload and its receiver's download, each divided by the
//     flows it has going. (Capacity one end leaves unused is not given
//     to the others, so times are a little pessimistic.)
//   - etcd as the real code uses it: a pulling node writes its holder
//     keys once when it starts (empty) and after each verified piece,
//     one transaction at a time, the changes made while one is in flight
//     coalesced into the next (Node.announce). A write commits after
//     Etcd, and reaches every node pulling the content (they watch its
//     holders) after Etcd more. A node starting its pull reads every
//     node key and every holder key of the model's contents.
//   - Or, with Membership, the design the real code runs (DESIGN.md
//     §10): etcd keeps membership only, one key per node per content,
//     written when its pull starts (partial) and when it ends (complete:
//     a seed, which every pulling node then knows holds every piece).
//     The scheduler (Scheduler.Key, Unkey) picks which of the members it
//     hears of to subscribe to (up to 32, a uniform sample), which send
//     it their bitmaps and then a message per piece they get, over the
//     transport (Latency; Scheduler.Told, ToldPiece).
//   - With SuperSeed, a node that holds every piece super-seeds as
//     Node.Piece does: asked for a piece with others accepted in its
//     place (the scheduler's claim names the pieces it lacks and has not
//     in flight, when it asks a content's only seed: the seeder, until a
//     node completes), it sends the one it has sent least of them
//     (cluster.SuperSeed), and the asker's scheduler takes it in place
//     of the one it asked for (Scheduler.Substitute), unless it is taken
//     meanwhile (the fetch then ends, as Pull's does).
//   - A node that dies breaks the fetches it serves at once (the pullers
//     see the peer unreachable and back off, as Pull does); its keys go
//     LeaseTTL later, and every pulling node hears of it then.
//
// What is counted: the time until every node that did not die has the
// model, the seeder's upload, etcd's load (holder keys, transactions and
// keys written, watch events delivered, keys read) and, with Membership,
// the transport's messages of which pieces a holder has.
package sim

import (
	"container/heap"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"tensorfs/cluster"
	"tensorfs/cluster/transport"
)

// Config describes a simulated cluster and what it pulls.
type Config struct {
	Nodes     int           // nodes pulling; the seeder is one more
	Model     int64         // bytes of the model
	Files     int           // contents the model is cut into, of equal size
	PieceSize int64         // bytes of a piece
	Up, Down  float64       // bytes per second each node can send, receive
	Latency   time.Duration // one way, between any two nodes
	Etcd      time.Duration // for a write to commit; then for its watch events to arrive
	Parallel  int           // fetches in flight per pull (cluster.Config.Parallel)
	PerPeer   int           // of them from one peer (cluster.Config.PerPeer)
	// MaxUploads is how many pieces a node sends at once; it refuses more
	// (transport.Config.MaxUploads).
	MaxUploads int
	LeaseTTL   time.Duration // how long a dead node's keys stay
	// Late is the share of nodes that start pulling late, each at a
	// random time in the first half of one pull's ideal time (Model/Down).
	Late float64
	// Die is the share of nodes that die mid-pull, each at a random time
	// in the first three quarters of one pull's ideal time.
	Die  float64
	Seed uint64 // of the random choices of the simulation (not the scheduler's)
	// Membership simulates etcd keeping membership only, pullers
	// learning what holders have from them (see the package comment).
	Membership bool
	// SuperSeed has every node that holds every piece send, asked for
	// a piece, the one it has sent least of those the asker accepts in
	// its place (cluster.SuperSeed), as the real code does.
	SuperSeed bool
}

// Defaults returns a configuration for n nodes: a 1 GiB model in 4 files
// of 8 MiB pieces, 1 Gbit/s links with 0.5 ms latency, etcd answering in
// 2 ms, the pull defaults of package cluster.
func Defaults(n int) Config {
	return Config{
		Nodes: n, Model: 1 << 30, Files: 4, PieceSize: cluster.DefaultPieceSize,
		Up: 125e6, Down: 125e6, Latency: 500 * time.Microsecond, Etcd: 2 * time.Millisecond,
		Parallel: cluster.DefaultParallel, PerPeer: cluster.DefaultPerPeer, MaxUploads: transport.DefaultMaxUploads, LeaseTTL: cluster.DefaultLeaseTTL, Seed: 1,
	}
}

// Result is what a simulation measured.
type Result struct {
	Config
	Pieces    int           // pieces of the model
	Done      time.Duration // until every node that did not die had the model
	Slowest   time.Duration // the longest pull of one node, its start to its end
	Completed int           // nodes that pulled the whole model
	Died      int           // nodes that died
	Seeded    float64       // the seeder's upload, in models
	Resent    int           // pieces the seeder sent again while it had not sent some piece yet
	Failed    int64         // fetches that failed (their holder died)
	Refused   int64         // fetches refused by a holder sending its MaxUploads
	// etcd's load.
	HolderKeys int   // holder keys at the end (one per node per content)
	Txns       int64 // holder-key transactions
	Puts       int64 // holder keys written or deleted
	Events     int64 // watch events delivered to pulling nodes
	Reads      int64 // keys read by pulls starting
	Messages   int64 // with Membership: bitmaps and pieces told over the transport
}

// String formats a result on one line.
func (r Result) String() string {
	return fmt.Sprintf("nodes %d (%s): done %v (slowest %v), %d complete, %d died; seeder sent %.2f models (%d pieces again before every piece once); %d failed fetches, %d refused; "+
		"etcd: %d holder keys, %d txns, %d puts, %d watch events, %d keys read; %d transport messages",
		r.Nodes, r.design(), r.Done.Round(time.Millisecond), r.Slowest.Round(time.Millisecond), r.Completed, r.Died, r.Seeded, r.Resent, r.Failed, r.Refused,
		r.HolderKeys, r.Txns, r.Puts, r.Events, r.Reads, r.Messages)
}

// design names what etcd keeps, and whether the seeder super-seeds.
func (c Config) design() string {
	switch {
	case c.Membership && c.SuperSeed:
		return "membership, super-seeding"
	case c.Membership:
		return "membership"
	case c.SuperSeed:
		return "holder keys, super-seeding"
	}
	return "holder keys"
}

// PerNodePiece returns x per pulling node per piece of the model.
func (r Result) PerNodePiece(x int64) float64 {
	return float64(x) / float64(r.Nodes) / float64(r.Pieces)
}

// Table formats results as a Markdown table, times against one node's
// pull alone (one).
func Table(one Result, rs []Result) string {
	var b strings.Builder
	fmt.Fprintf(&b, "| nodes | etcd keeps | late, died | all done | × one pull | slowest node | seeder sent (models) | failed, refused fetches | keys per node | txns per node per piece | keys written per node per piece | watch events per node per piece | keys read per node | transport messages per node per piece |\n")
	fmt.Fprintf(&b, "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
	for _, r := range rs {
		fmt.Fprintf(&b, "| %d | %s | %.0f%%, %d | %.2f s | %.2f | %.2f s | %.2f | %d, %d | %.2f | %.2f | %.2f | %.1f | %.0f | %.1f |\n",
			r.Nodes, r.design(), 100*r.Late, r.Died, r.Done.Seconds(), r.Done.Seconds()/one.Done.Seconds(), r.Slowest.Seconds(), r.Seeded,
			r.Failed, r.Refused, float64(r.HolderKeys)/float64(r.Nodes+1), r.PerNodePiece(r.Txns), r.PerNodePiece(r.Puts),
			r.PerNodePiece(r.Events), float64(r.Reads)/float64(r.Nodes), r.PerNodePiece(r.Messages))
	}
	return b.String()
}

// Sweep runs, all at once on the machine's CPUs, one node pulling alone
// and each of sizes as it is, with churn (late and die: Config.Late and
// Config.Die), with Membership, and with Membership and SuperSeed; it
// returns the lone node's result and the others in that order.
func Sweep(sizes []int, late, die float64) (Result, []Result) {
	cfgs := []Config{Defaults(1)}
	for _, n := range sizes {
		for _, run := range []struct{ churn, membership, super bool }{{false, false, false}, {true, false, false}, {false, true, false}, {false, true, true}} {
			cfg := Defaults(n)
			if run.churn {
				cfg.Late, cfg.Die = late, die
			}
			cfg.Membership, cfg.SuperSeed = run.membership, run.super
			cfgs = append(cfgs, cfg)
		}
	}
	rs := make([]Result, len(cfgs))
	var wg sync.WaitGroup
	for i, cfg := range cfgs {
		wg.Go(func() { rs[i] = Run(cfg) })
	}
	wg.Wait()
	return rs[0], rs[1:]
}

// Ideal returns one node's pull at the link's rate: Model/min(Up, Down).
func (c Config) Ideal() time.Duration {
	return time.Duration(float64(c.Model) / min(c.Up, c.Down) * float64(time.Second))
}

// tick is how often an idle pull looks again (Pull.next's timer); batch
// how long the watch events that reach a pull are gathered before it
// looks at them.
const (
	tick  = 250 * time.Millisecond
	batch = 5 * time.Millisecond
)

// epoch is the virtual clock's zero, for the scheduler's time.Time.
var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// node is one simulated node.
type node struct {
	id      int
	name    string
	s       *cluster.Scheduler // nil for the seeder
	alive   bool
	pulling bool // started, not done, alive: it watches the holders
	start   time.Duration
	end     time.Duration // when it had the whole model
	up      []*flow       // flows it sends
	down    []*flow       // flows it receives
	sent    int64         // bytes it sent
	// With Membership: the members it subscribed to, and those
	// subscribed to it.
	nbrs []*node
	subs []*node
	// sends counts the pieces it sent of each content while it held
	// every piece (super-seeding); nil before.
	sends [][]int32
	// announce: a write in flight, and contents changed since it began.
	writing  bool
	changed  map[int]bool
	waking   bool // a tick is due
	batching bool // a wake for watch events is due
}

// flow is one fetch's bytes moving from a holder to a puller.
type flow struct {
	from, to *node
	t        cluster.SimTask
	size     int64
	left     float64       // bytes still to send
	rate     float64       // bytes per second now
	at       time.Duration // when left and rate were last set
	ver      int           // of its end event: an older one is void
	gone     bool
}

// event kinds.
const (
	evStart   = iota // a node starts its pull
	evBegin          // a fetch's request reached its holder: the flow begins
	evEnd            // a flow's last byte arrives (if ver is current)
	evRefused        // a holder's refusal arrives
	evCommit         // a node's holder-key write commits
	evNotify         // a committed write reaches the watchers
	evDie            // a node dies
	evExpire         // a dead node's lease expires
	evTick           // an idle pull looks again
	evBatch          // a pull looks at the watch events of the last batch
	evHave           // a holder's bitmaps reach a subscriber (Membership)
)

type event struct {
	at   time.Duration
	seq  int64
	kind int
	n    *node
	f    *flow
	ver  int
	keys []key // evCommit, evNotify: the holder keys written; evHave: what a member told
	from *node // evHave: the member
}

// key is one holder key's new value (nil bits deletes it), or what a
// member told: its bitmap, or with bits nil a piece it got.
type key struct {
	content int
	bits    []byte
	piece   int
}

type events []*event

func (h events) Len() int { return len(h) }
func (h events) Less(i, j int) bool {
	return h[i].at < h[j].at || h[i].at == h[j].at && h[i].seq < h[j].seq
}
func (h events) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *events) Push(x any)   { *h = append(*h, x.(*event)) }
func (h *events) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

// world is a simulation under way.
type world struct {
	cfg      Config
	contents []cluster.SimContent
	pieces   int
	nodes    []*node // the pullers
	byName   map[string]*node
	seeder   *node
	holders  []map[*node][]byte // etcd's holder keys, per content
	unsent   int                // pieces the seeder has not sent yet
	now      time.Duration
	seq      int64
	queue    events
	res      Result
	rng      *rand.Rand
}

// Run simulates cfg and returns what it measured.
func Run(cfg Config) Result {
	w := &world{cfg: cfg, byName: map[string]*node{}, res: Result{Config: cfg}}
	size := cfg.Model / int64(cfg.Files)
	for range cfg.Files {
		c := cluster.SimContent{Size: size, PieceSize: cfg.PieceSize}
		w.contents = append(w.contents, c)
		w.pieces += int((c.Size + c.PieceSize - 1) / c.PieceSize)
		w.holders = append(w.holders, map[*node][]byte{})
	}
	w.res.Pieces, w.unsent = w.pieces, w.pieces
	w.seeder = &node{name: "seeder", alive: true}
	w.byName[w.seeder.name] = w.seeder
	for i, c := range w.contents {
		w.holders[i][w.seeder] = full(int((c.Size + c.PieceSize - 1) / c.PieceSize))
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 0))
	w.rng = rng
	ideal := cfg.Ideal()
	for i := range cfg.Nodes {
		n := &node{id: i, name: fmt.Sprintf("node%04d", i), alive: true, changed: map[int]bool{}}
		w.nodes = append(w.nodes, n)
		w.byName[n.name] = n
		if rng.Float64() < cfg.Late {
			n.start = time.Duration(rng.Int64N(int64(ideal / 2)))
		}
		w.push(&event{at: n.start, kind: evStart, n: n})
		if rng.Float64() < cfg.Die {
			w.push(&event{at: n.start + time.Duration(rng.Int64N(int64(ideal*3/4))), kind: evDie, n: n})
		}
	}
	limit := 100 * ideal
	for w.queue.Len() > 0 && w.now < limit {
		e := heap.Pop(&w.queue).(*event)
		w.now = e.at
		w.handle(e)
	}
	for _, n := range w.nodes {
		switch {
		case !n.alive:
			w.res.Died++
		case n.s != nil && n.s.Left() == 0:
			w.res.Completed++
			w.res.Done = max(w.res.Done, n.end)
			w.res.Slowest = max(w.res.Slowest, n.end-n.start)
		}
	}
	if w.res.Completed+w.res.Died < cfg.Nodes {
		w.res.Done, w.res.Slowest = limit, limit // some never completed
	}
	for _, hs := range w.holders {
		w.res.HolderKeys += len(hs)
	}
	w.res.Seeded = float64(w.seeder.sent) / float64(cfg.Model)
	return w.res
}

// full returns the bitmap of a holder of every one of pieces.
func full(pieces int) []byte {
	b := make([]byte, (pieces+7)/8)
	for i := range pieces {
		b[i/8] |= 1 << (i % 8)
	}
	return b
}

// push schedules e.
func (w *world) push(e *event) {
	w.seq++
	e.seq = w.seq
	heap.Push(&w.queue, e)
}

// clock returns the scheduler's time now.
func (w *world) clock() time.Time { return epoch.Add(w.now) }

func (w *world) handle(e *event) {
	n := e.n
	switch e.kind {
	case evStart:
		w.start(n)
	case evBegin:
		w.begin(e.f)
	case evRefused:
		w.res.Refused++
		e.f.to.s.Refused(e.f.t, w.clock())
		w.wake(e.f.to)
	case evEnd:
		if e.ver == e.f.ver && !e.f.gone {
			w.end(e.f)
		}
	case evCommit:
		w.commit(n, e.keys)
	case evNotify:
		w.notify(n, e.keys)
	case evDie:
		w.die(n)
	case evExpire:
		for i := range w.contents {
			delete(w.holders[i], n)
		}
		w.res.Puts += int64(len(w.contents))
		for _, m := range w.nodes {
			if m.pulling {
				m.s.DropPeer(n.name)
				for i := range w.contents {
					if w.cfg.Membership {
						w.act(m, "", m.s.Unkey(i, n.name))
					} else {
						m.s.DropHolder(i, n.name)
					}
				}
				w.res.Events += int64(1 + len(w.contents))
				w.soon(m)
			}
		}
	case evTick:
		n.waking = false
		w.wake(n)
	case evBatch:
		n.batching = false
		w.wake(n)
	case evHave:
		if n.pulling {
			for _, k := range e.keys {
				if k.bits != nil {
					n.s.Told(k.content, e.from.name, k.bits)
				} else {
					n.s.ToldPiece(k.content, e.from.name, k.piece)
				}
			}
			w.soon(n)
		}
	}
}

// start begins n's pull: it reads the node and holder keys, and
// announces that it holds nothing yet (Node.hold).
func (w *world) start(n *node) {
	if !n.alive {
		return
	}
	n.s = cluster.NewScheduler(n.name, w.cfg.PerPeer, w.contents, w.cfg.Seed+uint64(len(w.byName))*7919+uint64(n.id), w.clock())
	for _, m := range w.byName {
		if m.alive || m == n {
			n.s.SetPeer(m.name)
			w.res.Reads++
		}
	}
	n.pulling = true
	all := append([]*node{w.seeder}, w.nodes...) // in order: the sim is deterministic
	for i, hs := range w.holders {
		for _, m := range all {
			bits, ok := hs[m]
			switch {
			case !ok:
				continue
			case w.cfg.Membership:
				w.key(n, i, m, len(bits) > 0)
			default:
				n.s.SetHolder(i, m.name, bits)
			}
			w.res.Reads++
		}
	}
	for i := range w.contents {
		n.changed[i] = true
	}
	w.announce(n)
	w.wake(n)
}

// wake has n claim pieces while it has room for more fetches; when it has
// room and nothing to claim, it looks again after a tick.
func (w *world) wake(n *node) {
	if !n.pulling {
		return
	}
	for n.s.InFlight() < w.cfg.Parallel {
		t, ok := n.s.Claim(w.clock())
		if !ok {
			break
		}
		_, size := pieceRange(w.contents[t.Content], t.Piece)
		f := &flow{from: w.byName[t.Peer], to: n, t: t, size: size, left: float64(size)}
		w.push(&event{at: w.now + w.cfg.Latency, kind: evBegin, f: f})
	}
	if n.s.InFlight() < w.cfg.Parallel && !n.waking {
		n.waking = true
		w.push(&event{at: w.now + tick, kind: evTick, n: n})
	}
}

// soon wakes n after batch, with whatever else its watch brings meanwhile
// (a watch response carries the events of several writes).
func (w *world) soon(n *node) {
	if !n.batching && n.pulling && n.s.InFlight() < w.cfg.Parallel {
		n.batching = true
		w.push(&event{at: w.now + batch, kind: evBatch, n: n})
	}
}

// pieceRange returns piece i's offset and size in c.
func pieceRange(c cluster.SimContent, i int) (int64, int64) {
	off := int64(i) * c.PieceSize
	return off, min(c.PieceSize, c.Size-off)
}

// begin starts a flow whose request reached its holder; a dead holder
// fails the fetch, one sending its MaxUploads refuses it.
func (w *world) begin(f *flow) {
	switch {
	case !f.to.alive:
		return
	case !f.from.alive:
		w.fail(f)
		return
	case len(f.from.up) >= w.cfg.MaxUploads:
		w.push(&event{at: w.now + w.cfg.Latency, kind: evRefused, f: f})
		return
	}
	if !w.serve(f) {
		f.to.s.Taken(f.t, w.clock())
		w.wake(f.to)
		return
	}
	f.at = w.now
	f.from.up = append(f.from.up, f)
	f.to.down = append(f.to.down, f)
	w.reshare(f.from, f.to)
}

// serve has f's holder send its piece, counting it if the holder holds
// every piece, as Node.Piece does: with SuperSeed such a holder sends
// the piece f accepts that it has sent least of (cluster.SuperSeed),
// which f's puller takes in place of the one it asked for. False if the
// puller no longer takes it (taken meanwhile).
func (w *world) serve(f *flow) bool {
	from := f.from
	if from != w.seeder && from.s.Left() > 0 {
		return true
	}
	if from.sends == nil {
		for _, c := range w.contents {
			from.sends = append(from.sends, make([]int32, (c.Size+c.PieceSize-1)/c.PieceSize))
		}
	}
	sent := from.sends[f.t.Content]
	if w.cfg.SuperSeed && len(f.t.Accept) > 0 {
		if i := cluster.SuperSeed(sent, f.t.Piece, f.t.Accept, w.rng.IntN(len(sent))); i != f.t.Piece {
			t, ok := f.to.s.Substitute(f.t, i)
			if !ok {
				return false
			}
			f.t = t
			_, f.size = pieceRange(w.contents[t.Content], i)
			f.left = float64(f.size)
		}
	}
	if from == w.seeder {
		switch {
		case sent[f.t.Piece] == 0:
			w.unsent--
		case w.unsent > 0:
			w.res.Resent++
		}
	}
	sent[f.t.Piece]++
	return true
}

// reshare sets the rates of the flows a's uplink and b's downlink carry.
func (w *world) reshare(a, b *node) {
	for _, f := range a.up {
		w.rerate(f)
	}
	for _, f := range b.down {
		if f.from != a {
			w.rerate(f)
		}
	}
}

// rerate brings f's bytes up to now and sets its rate and end.
func (w *world) rerate(f *flow) {
	f.left = max(0, f.left-f.rate*(w.now-f.at).Seconds())
	f.at = w.now
	f.rate = min(w.cfg.Up/float64(len(f.from.up)), w.cfg.Down/float64(len(f.to.down)))
	f.ver++
	w.push(&event{at: w.now + time.Duration(f.left/f.rate*float64(time.Second)) + w.cfg.Latency, kind: evEnd, f: f, ver: f.ver})
}

// remove takes f off both its links and reshares them.
func (w *world) remove(f *flow) {
	f.gone = true
	f.from.up = without(f.from.up, f)
	f.to.down = without(f.to.down, f)
	w.reshare(f.from, f.to)
}

// without returns xs without x, in another order.
func without[T comparable](xs []T, x T) []T {
	if i := slices.Index(xs, x); i >= 0 {
		xs[i] = xs[len(xs)-1]
		return xs[:len(xs)-1]
	}
	return xs
}

// end completes f: the piece is held, announced, and n claims more.
func (w *world) end(f *flow) {
	w.remove(f)
	f.from.sent += f.size
	n := f.to
	n.s.Finish(f.t, true, w.clock())
	if !w.cfg.Membership || n.s.Left() == 0 {
		n.changed[f.t.Content] = true
		if w.cfg.Membership {
			for i := range w.contents {
				n.changed[i] = true // complete: a seed of every content
			}
		}
	}
	w.announce(n)
	w.tell(n, f.t.Content, f.t.Piece)
	if n.s.Left() == 0 {
		n.end, n.pulling = w.now, false
		return
	}
	w.wake(n)
}

// fail ends f's fetch as failed: its holder died.
func (w *world) fail(f *flow) {
	w.res.Failed++
	f.to.s.Finish(f.t, false, w.clock())
	w.wake(f.to)
}

// announce starts a holder-key write of what changed, unless one is in
// flight (its commit starts the next).
func (w *world) announce(n *node) {
	if n.writing || len(n.changed) == 0 || !n.alive {
		return
	}
	var keys []key
	for i := range n.changed {
		bits := n.s.Have(i)
		if w.cfg.Membership && n.s.Left() > 0 {
			bits = []byte{} // pulling: no bitmap
		}
		keys = append(keys, key{content: i, bits: bits})
	}
	clear(n.changed)
	n.writing = true
	w.push(&event{at: w.now + w.cfg.Etcd, kind: evCommit, n: n, keys: keys})
}

// commit applies n's write to etcd and sends its watch events.
func (w *world) commit(n *node, keys []key) {
	n.writing = false
	if !n.alive {
		return
	}
	w.res.Txns++
	w.res.Puts += int64(len(keys))
	for _, k := range keys {
		w.holders[k.content][n] = k.bits
	}
	w.push(&event{at: w.now + w.cfg.Etcd, kind: evNotify, n: n, keys: keys})
	w.announce(n)
}

// notify delivers n's committed holder keys to every pulling node; with
// Membership, a pulling member is one to consider subscribing to, and a
// complete one a seed.
func (w *world) notify(n *node, keys []key) {
	for _, m := range w.nodes {
		if !m.pulling || w.cfg.Membership && m == n {
			continue
		}
		w.res.Events += int64(len(keys))
		for _, k := range keys {
			if w.cfg.Membership {
				w.key(m, k.content, n, len(k.bits) > 0)
			} else {
				m.s.SetHolder(k.content, n.name, k.bits)
			}
		}
		w.soon(m)
	}
}

// key has n's scheduler apply m's holder key of content i (complete, or
// a member's), and n act on what it asks.
func (w *world) key(n *node, i int, m *node, complete bool) {
	sub, unsub := n.s.Key(i, m.name, complete)
	w.act(n, sub, unsub)
}

// act has n subscribe to the member sub and unsubscribe from unsub, as
// its scheduler asks ("" for none): a new subscription sends n the
// member's bitmaps.
func (w *world) act(n *node, sub, unsub string) {
	if m := w.byName[unsub]; unsub != "" {
		n.nbrs = without(n.nbrs, m)
		m.subs = without(m.subs, n)
	}
	if m := w.byName[sub]; sub != "" {
		n.nbrs = append(n.nbrs, m)
		m.subs = append(m.subs, n)
		for i := range w.contents {
			w.res.Messages++
			w.push(&event{at: w.now + w.cfg.Latency, kind: evHave, n: n, from: m, keys: []key{{content: i, bits: m.s.Have(i)}}})
		}
	}
}

// tell sends, with Membership, that n got piece of content i to the
// pulling nodes subscribed to it.
func (w *world) tell(n *node, i, piece int) {
	if !w.cfg.Membership {
		return
	}
	for _, m := range n.subs {
		if m.pulling {
			w.res.Messages++
			w.push(&event{at: w.now + w.cfg.Latency, kind: evHave, n: m, from: n, keys: []key{{content: i, piece: piece}}})
		}
	}
}

// die kills n: the flows it sends fail, those it receives stop.
func (w *world) die(n *node) {
	n.alive, n.pulling = false, false
	for len(n.up) > 0 {
		f := n.up[0]
		w.remove(f)
		w.fail(f)
	}
	for len(n.down) > 0 {
		w.remove(n.down[0])
	}
	w.push(&event{at: w.now + w.cfg.LeaseTTL, kind: evExpire, n: n})
}
