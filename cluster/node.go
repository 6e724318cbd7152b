package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"tensorfs/cluster/transport"
)

// Defaults of Config.
const (
	DefaultLeaseTTL = 10 * time.Second
	DefaultTimeout  = 3 * time.Second
	DefaultPort     = "7070"
)

// Config says how a node joins a cluster.
type Config struct {
	// Endpoints are etcd's client URLs, e.g. https://10.0.0.1:2379.
	Endpoints []string
	// Node is this node's name, unique among live nodes; Credentials'
	// certificate must carry it as a DNS name.
	Node string
	// Listen is the host:port the piece server listens on (port 0
	// picks one). Default: DefaultPort on the address this host reaches
	// the first endpoint from. Unused with another Transport.
	Listen string
	// Listener, if set, is the piece server's socket, bound by an
	// earlier daemon of this node (a takeover): Listen is not bound again.
	Listener net.Listener
	// Resume, if not 0, is the lease of an earlier daemon of this node
	// (a takeover): the node keeps it alive, and the keys under it stay,
	// if this node's key still carries it; else it joins afresh.
	Resume int64
	// OnLease, if set, is told of every lease the node joins under.
	OnLease func(lease int64)
	// Advertise is the host:port peers reach the piece server at;
	// default the address Listen bound, which must then name a host.
	Advertise string
	// Credentials authenticate this node to etcd and to its peers, and
	// them to it (required: the cluster runs on mutual TLS only).
	Credentials *transport.Credentials
	// Prefix is the prefix of every key (DefaultPrefix if empty).
	Prefix string
	// LeaseTTL is the life of this node's keys after it stops renewing
	// them (DefaultLeaseTTL if 0; whole seconds).
	LeaseTTL time.Duration
	// Timeout bounds each call to etcd (DefaultTimeout if 0).
	Timeout time.Duration
	// PieceSize is the piece size of what this node publishes
	// (DefaultPieceSize if 0).
	PieceSize int64
	// Parallel is how many pieces a pull fetches at once
	// (DefaultParallel if 0); PerPeer how many of them from one peer
	// (DefaultPerPeer if 0).
	Parallel, PerPeer int
	// MaxUploads is how many pieces the Stream piece server sends at once
	// (transport.DefaultMaxUploads if 0); it refuses more, and the peer
	// asks another holder.
	MaxUploads int
	// NoHolderWait is how long a pull waits, with nothing in flight, for
	// a holder of a piece it misses before it fails with ErrNoHolder
	// (DefaultNoHolderWait if 0).
	NoHolderWait time.Duration
	// Transport moves pieces: a Stream transport on Listen and Advertise
	// over Credentials if nil. Join starts it and peers reach the node at
	// its Addr; Join (when it fails) or Close closes it.
	Transport transport.Transport
	// Log receives what the node does (nothing if nil).
	Log *slog.Logger
}

// Node is this daemon's membership of a cluster: its lease, the contents
// it serves, its piece server and the pulls it runs.
type Node struct {
	cfg  Config
	log  *slog.Logger
	keys keys
	etcd *clientv3.Client
	tr   transport.Transport
	addr string // where peers reach this node: the transport's Addr

	ctx    context.Context // ends at Close
	cancel context.CancelFunc
	wg     sync.WaitGroup // run, announce and the pulls

	wake    chan struct{} // tells announce to write (buffered, 1)
	flushMu sync.Mutex    // one flush at a time

	mu         sync.Mutex
	sess       *concurrency.Session         // nil while not joined
	sessErr    error                        // why not joined, while sess is nil
	sessChange chan struct{}                // closed and replaced when sess changes
	held       map[string]*held             // contents served, by ID
	watchers   map[string]map[*watcher]bool // peers' watches, by content ID
	// offered: the daemon has offered what it recovered (Offered), or
	// takes over from none (Config.Resume 0); until then a content not
	// held may be one not offered yet.
	offered bool
	gen     uint64 // last generation given to a change of held
	epoch   uint64 // counts leases: a write under an older one is void
	closed  bool

	// last is the lease of run's last session, which Close revokes (run
	// sets it as it ends: Close reads it once run has).
	last clientv3.LeaseID

	stats stats
}

// Stats counts what a node has moved since it joined.
type Stats struct {
	PiecesServed, BytesServed   int64 // handed to peers' fetches
	PiecesFetched, BytesFetched int64 // fetched, verified and held
	BadPieces                   int64 // pieces that failed verification: fetched, or held here
	FailedFetches               int64 // fetches that failed (peer unreachable, dead, refusing)
}

type stats struct {
	piecesServed, bytesServed, piecesFetched, bytesFetched, badPieces, failedFetches atomic.Int64
}

// nodeInfo is the value of a node's key.
type nodeInfo struct {
	Addr string `json:"addr"`
}

// etcdConnectParams bound gRPC's reconnection backoff to etcd to a few
// seconds, so that etcd, back, is reached again at once, not after a
// backoff grown to minutes.
var etcdConnectParams = grpc.ConnectParams{
	Backoff:           backoff.Config{BaseDelay: 250 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 2 * time.Second},
	MinConnectTimeout: 5 * time.Second,
}

// Join makes this daemon a node of the cluster cfg names: it starts the
// piece server and returns; the node registers itself, renews its lease and
// announces what it holds in the background, and keeps trying while etcd
// is unreachable or its name is held by another live daemon (calls that
// need the lease meanwhile fail with ErrUnavailable or ErrNameInUse).
// Close leaves the cluster.
func Join(cfg Config) (*Node, error) {
	if err := cfg.fill(); err != nil {
		if cfg.Transport != nil {
			cfg.Transport.Close()
		}
		return nil, err
	}
	etcd, err := clientv3.New(clientv3.Config{
		Endpoints:            cfg.Endpoints,
		DialTimeout:          cfg.Timeout,
		DialKeepAliveTime:    cfg.Timeout,
		DialKeepAliveTimeout: cfg.Timeout,
		TLS:                  cfg.Credentials.ClientConfig(""),
		Logger:               zap.NewNop(), // failures are logged here, with what they stop
		DialOptions:          []grpc.DialOption{grpc.WithConnectParams(etcdConnectParams)},
	})
	if err != nil {
		cfg.Transport.Close()
		return nil, fmt.Errorf("cluster: etcd %v: %w", cfg.Endpoints, err)
	}
	n := &Node{
		cfg:        cfg,
		log:        cfg.Log,
		keys:       keys{cfg.Prefix},
		etcd:       etcd,
		tr:         cfg.Transport,
		wake:       make(chan struct{}, 1),
		sessErr:    fmt.Errorf("%w: node %s has not joined yet (it joins in the background: tensorfs status says when it has)", ErrUnavailable, cfg.Node),
		sessChange: make(chan struct{}),
		held:       map[string]*held{},
		watchers:   map[string]map[*watcher]bool{},
		offered:    cfg.Resume == 0,
	}
	n.ctx, n.cancel = context.WithCancel(context.Background())
	if err := n.tr.Start(n); err != nil {
		n.tr.Close()
		etcd.Close()
		return nil, fmt.Errorf("cluster: piece server: %w", err)
	}
	n.addr = n.tr.Addr()
	n.wg.Add(2)
	go n.run()
	go n.announce()
	return n, nil
}

// fill checks cfg and sets its defaults.
func (cfg *Config) fill() error {
	if len(cfg.Endpoints) == 0 {
		return fmt.Errorf("%w: cluster: no etcd endpoints", ErrInvalid)
	}
	if err := checkNodeName(cfg.Node); err != nil {
		return err
	}
	if cfg.Credentials == nil {
		return fmt.Errorf("%w: cluster: no credentials: the cluster CA, and a certificate and key for node %s, are required", ErrInvalid, cfg.Node)
	}
	if err := cfg.Credentials.CheckName(cfg.Node); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if cfg.Listen == "" && cfg.Transport == nil {
		ip, err := localAddrToward(cfg.Endpoints[0])
		if err != nil {
			return fmt.Errorf("%w: cluster: no piece server address given, and %v", ErrInvalid, err)
		}
		cfg.Listen = net.JoinHostPort(ip, DefaultPort)
	}
	if cfg.Prefix == "" {
		cfg.Prefix = DefaultPrefix
	}
	if err := checkPrefix(cfg.Prefix); err != nil {
		return err
	}
	if cfg.LeaseTTL == 0 {
		cfg.LeaseTTL = DefaultLeaseTTL
	}
	if cfg.LeaseTTL < time.Second {
		return fmt.Errorf("%w: cluster: lease TTL %v is under a second", ErrInvalid, cfg.LeaseTTL)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.PieceSize == 0 {
		cfg.PieceSize = DefaultPieceSize
	}
	if cfg.PieceSize < 64<<10 || cfg.PieceSize > DefaultPieceSize {
		return fmt.Errorf("%w: cluster: piece size %d is under 64 KiB or over %d (peers refuse larger pieces than DefaultPieceSize makes)", ErrInvalid, cfg.PieceSize, DefaultPieceSize)
	}
	if cfg.Parallel <= 0 {
		cfg.Parallel = DefaultParallel
	}
	if cfg.PerPeer <= 0 {
		cfg.PerPeer = DefaultPerPeer
	}
	if cfg.NoHolderWait <= 0 {
		cfg.NoHolderWait = DefaultNoHolderWait
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Transport == nil {
		tr, err := transport.NewStream(transport.Config{Listen: cfg.Listen, Listener: cfg.Listener, Advertise: cfg.Advertise, Credentials: cfg.Credentials, MaxUploads: cfg.MaxUploads, Log: cfg.Log})
		if err != nil {
			return fmt.Errorf("%w: cluster: %v", ErrInvalid, err)
		}
		cfg.Transport = tr
	}
	return nil
}

// localAddrToward returns the address this host sends from to reach an
// etcd endpoint (a URL or host:port): the route's source, found by
// connecting a UDP socket, which sends nothing.
func localAddrToward(endpoint string) (string, error) {
	hostport := endpoint
	if u, err := url.Parse(endpoint); err == nil && u.Host != "" {
		hostport = u.Host
	}
	c, err := net.Dial("udp", hostport)
	if err != nil {
		return "", fmt.Errorf("no route to etcd endpoint %s: %v", endpoint, err)
	}
	defer c.Close()
	return c.LocalAddr().(*net.UDPAddr).IP.String(), nil
}

// Name returns this node's name.
func (n *Node) Name() string { return n.cfg.Node }

// Addr returns the address peers reach this node's piece server at.
func (n *Node) Addr() string { return n.addr }

// Stats returns what this node has moved so far.
func (n *Node) Stats() Stats {
	return Stats{
		PiecesServed: n.stats.piecesServed.Load(), BytesServed: n.stats.bytesServed.Load(),
		PiecesFetched: n.stats.piecesFetched.Load(), BytesFetched: n.stats.bytesFetched.Load(),
		BadPieces: n.stats.badPieces.Load(), FailedFetches: n.stats.failedFetches.Load(),
	}
}

// run keeps the node joined: a lease, the node's key, and everything it
// holds announced under that lease, renewed until Close; joined again when
// the lease is lost. It leaves the last lease it held for Close to revoke
// (Node.last).
func (n *Node) run() {
	defer n.wg.Done()
	prev := clientv3.LeaseID(n.cfg.Resume) // the last lease, which may outlive its session
	var held clientv3.LeaseID              // the last lease this daemon had a session of
	defer func() { n.last = held }()
	s := n.resume(prev)
	var lastErr string
	for try := 0; n.ctx.Err() == nil; {
		var err error
		if s == nil {
			s, err = n.join(prev)
		}
		if s != nil {
			prev, held = s.Lease(), s.Lease()
		}
		if n.ctx.Err() != nil {
			return // closing: a session joined meanwhile ends unused, and Close revokes its lease
		}
		if err != nil {
			n.setSession(nil, err)
			if err.Error() != lastErr {
				n.log.Warn("cluster: cannot join; retrying", "node", n.cfg.Node, "err", err)
				lastErr = err.Error()
			}
			sleep(n.ctx, Backoff(try))
			try++
			continue
		}
		lastErr, try = "", 0
		if n.cfg.OnLease != nil {
			n.cfg.OnLease(int64(s.Lease()))
		}
		n.setSession(s, nil)
		n.log.Info("cluster: joined", "node", n.cfg.Node, "addr", n.addr, "lease", fmt.Sprintf("%x", int64(s.Lease())))
		n.rewriteAll()
		select {
		case <-s.Done():
		case <-n.ctx.Done():
		}
		// Close ends the session too: only a session that ended while
		// the node runs is a lost lease.
		if n.ctx.Err() != nil {
			return
		}
		n.setSession(nil, fmt.Errorf("%w: node %s lost its etcd lease; joining again", ErrUnavailable, n.cfg.Node))
		n.log.Warn("cluster: lease lost; joining again", "node", n.cfg.Node)
		s = nil
	}
}

// resume takes over lease id (Config.Resume) with the keys under it: nil
// if id is 0, or if etcd no longer has it with this node's key under it
// (it expired, or was revoked), which the log says.
func (n *Node) resume(id clientv3.LeaseID) *concurrency.Session {
	if id == clientv3.NoLease {
		return nil
	}
	ctx, cancel := context.WithTimeout(n.ctx, n.cfg.Timeout)
	defer cancel()
	resp, err := n.etcd.Get(ctx, n.keys.node(n.cfg.Node))
	if err == nil && (len(resp.Kvs) != 1 || clientv3.LeaseID(resp.Kvs[0].Lease) != id) {
		err = fmt.Errorf("node %s's key no longer carries it", n.cfg.Node)
	}
	var s *concurrency.Session
	if err == nil {
		s, err = concurrency.NewSession(n.etcd, concurrency.WithLease(id), concurrency.WithContext(n.ctx))
	}
	if err != nil {
		n.log.Warn("cluster: the lease of the daemon before is gone; joining afresh", "node", n.cfg.Node, "lease", fmt.Sprintf("%x", int64(id)), "err", err)
		return nil
	}
	return s
}

// Lease returns the lease the node is joined under, 0 while not joined.
func (n *Node) Lease() int64 {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.sess == nil {
		return 0
	}
	return int64(n.sess.Lease())
}

// Joined returns nil while the node is joined (it can publish and
// announce), else why it is not: ErrUnavailable, ErrNameInUse or
// ErrClosed, with what to wait for.
func (n *Node) Joined() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	switch {
	case n.closed:
		return ErrClosed
	case n.sess == nil:
		return n.sessErr
	}
	return nil
}

// ListenerFile returns a duplicate of the piece server's socket, for a
// successor daemon (Config.Listener).
func (n *Node) ListenerFile() (*os.File, error) {
	lf, ok := n.tr.(interface{ ListenerFile() (*os.File, error) })
	if !ok {
		return nil, errors.New("cluster: the transport has no socket to hand over")
	}
	return lf.ListenerFile()
}

// join grants a lease and claims this node's name under it. A name still
// held by prev (this daemon's own lease from before) is taken back; one
// held by another lease is ErrNameInUse until that lease ends.
func (n *Node) join(prev clientv3.LeaseID) (*concurrency.Session, error) {
	ctx, cancel := context.WithTimeout(n.ctx, n.cfg.Timeout)
	defer cancel()
	grant, err := n.etcd.Grant(ctx, int64(n.cfg.LeaseTTL/time.Second))
	if err != nil {
		return nil, n.etcdErr("grant a lease", err)
	}
	info, _ := json.Marshal(nodeInfo{Addr: n.addr})
	key := n.keys.node(n.cfg.Node)
	resp, err := n.etcd.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
		Then(clientv3.OpPut(key, string(info), clientv3.WithLease(grant.ID))).
		Else(clientv3.OpGet(key)).
		Commit()
	if err == nil && !resp.Succeeded {
		kv := resp.Responses[0].GetResponseRange().Kvs[0]
		owner := clientv3.LeaseID(kv.Lease)
		if owner == prev && prev != clientv3.NoLease {
			// Our own key from before the session was lost: revoke that
			// lease (and the keys under it) and claim the name again.
			if _, err = n.etcd.Revoke(ctx, prev); err == nil {
				resp, err = n.etcd.Txn(ctx).
					If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
					Then(clientv3.OpPut(key, string(info), clientv3.WithLease(grant.ID))).
					Commit()
			}
		}
		if err == nil && !resp.Succeeded {
			n.revoke(grant.ID)
			ttl := "?"
			if t, err := n.etcd.TimeToLive(ctx, owner); err == nil {
				ttl = fmt.Sprintf("%ds", t.TTL)
			}
			return nil, fmt.Errorf("%w: node name %s is held by another live daemon (%s), whose lease ends in %s unless it is alive: this node joins once it ends (a daemon of this node that died); if another node runs under this name, mount one of them with another --node", ErrNameInUse, n.cfg.Node, kv.Value, ttl)
		}
	}
	if err != nil {
		// The put may have committed even so (a timeout, or Close, cut the
		// answer off): the lease's revoke deletes the key with it.
		n.revoke(grant.ID)
		return nil, n.etcdErr("register node "+n.cfg.Node, err)
	}
	s, err := concurrency.NewSession(n.etcd, concurrency.WithLease(grant.ID), concurrency.WithContext(n.ctx))
	if err != nil {
		n.revoke(grant.ID)
		return nil, n.etcdErr("keep the lease alive", err)
	}
	return s, nil
}

// revoke revokes lease id, and with it the keys under it, in a call of its
// own (Close ends the node's context first); a lease already gone is no
// failure.
func (n *Node) revoke(id clientv3.LeaseID) error {
	ctx, cancel := context.WithTimeout(context.Background(), n.cfg.Timeout)
	defer cancel()
	_, err := n.etcd.Revoke(ctx, id)
	if errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return nil
	}
	return err
}

// setSession records the current session, or why there is none, and wakes
// whoever waits for it.
func (n *Node) setSession(s *concurrency.Session, err error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.sess, n.sessErr = s, err
	close(n.sessChange)
	n.sessChange = make(chan struct{})
}

// lease returns the current lease, waiting for the node to join for at
// most the configured timeout.
func (n *Node) lease(ctx context.Context) (clientv3.LeaseID, error) {
	ctx, cancel := context.WithTimeout(ctx, n.cfg.Timeout)
	defer cancel()
	for {
		n.mu.Lock()
		s, err, ch, closed := n.sess, n.sessErr, n.sessChange, n.closed
		n.mu.Unlock()
		switch {
		case closed:
			return 0, ErrClosed
		case s != nil:
			return s.Lease(), nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return 0, err
		}
	}
}

// etcdErr wraps a failed etcd call as ErrUnavailable, saying whether etcd
// did not answer in time or could not be reached; ErrClosed when the node
// is closing.
func (n *Node) etcdErr(what string, err error) error {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		if n.ctx.Err() != nil {
			return fmt.Errorf("cluster: %s: %w", what, ErrClosed)
		}
		return fmt.Errorf("%w: cluster: %s: etcd %v did not answer within %v (down, unreachable, or refusing this node's certificate)", ErrUnavailable, what, n.cfg.Endpoints, n.cfg.Timeout)
	}
	if status.Code(err) == codes.Unavailable { // the connection failed before the deadline
		return fmt.Errorf("%w: cluster: %s: etcd %v is unreachable (down, or refusing this node's certificate): %v", ErrUnavailable, what, n.cfg.Endpoints, err)
	}
	return fmt.Errorf("%w: cluster: %s: etcd %v: %v", ErrUnavailable, what, n.cfg.Endpoints, err)
}

// timeout returns ctx bounded by the configured timeout.
func (n *Node) timeout(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, n.cfg.Timeout)
}

// Close leaves the cluster: it revokes the lease (so peers stop asking this
// node at once), ends the pulls in flight, stops the piece server and
// closes the connection to etcd.
func (n *Node) Close() error {
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		return nil
	}
	n.closed = true
	n.mu.Unlock()
	n.cancel()
	n.wg.Wait()
	if n.last != clientv3.NoLease {
		if err := n.revoke(n.last); err != nil {
			n.log.Warn("cluster: revoking the lease failed; its keys go when it expires", "node", n.cfg.Node, "lease", fmt.Sprintf("%x", int64(n.last)), "err", err)
		}
	}
	n.tr.Close()
	return n.etcd.Close()
}

// sleep waits d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}
