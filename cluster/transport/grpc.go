package transport

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"

	"tensorfs/cluster/transport/piecepb"
)

// ChunkSize is the size of the messages a piece is streamed in.
const ChunkSize = 1 << 20

// ConnectParams bound gRPC's reconnection backoff to a few seconds, so that
// a peer (or etcd) that comes back is reached again at once, not after a
// backoff grown to minutes.
func ConnectParams() grpc.ConnectParams {
	return grpc.ConnectParams{
		Backoff:           backoff.Config{BaseDelay: 250 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 2 * time.Second},
		MinConnectTimeout: 5 * time.Second,
	}
}

// Defaults of Config.
const (
	// DefaultIdle is how long a fetch may receive nothing before it fails.
	DefaultIdle = 10 * time.Second
	// DefaultMaxUploads is how many pieces a node sends at once.
	DefaultMaxUploads = 4
)

// Config says where a GRPC transport listens and how it authenticates.
type Config struct {
	// Listen is the host:port to listen on (port 0 picks one); "" for a
	// transport that only fetches.
	Listen string
	// Listener, if set, is the socket to serve on instead of a new one
	// on Listen: an earlier daemon's, which its successor takes over.
	Listener net.Listener
	// Advertise is the host:port peers reach this node at; default the
	// address Listen bound, which must then name a host.
	Advertise string
	// Credentials authenticate this node to its peers and them to it.
	Credentials *Credentials
	// Idle ends a fetch that has received nothing for this long
	// (DefaultIdle if 0).
	Idle time.Duration
	// MaxUploads is how many pieces the server sends at once; it refuses
	// more (ErrBusy to the peer). DefaultMaxUploads if 0.
	MaxUploads int
	// Log receives what the transport does (nothing if nil).
	Log *slog.Logger
}

// GRPC is the gRPC implementation of Transport: one server per node, one
// client connection per peer, a server stream per piece fetched. Every
// connection is mutual TLS with the cluster's credentials.
type GRPC struct {
	cfg Config

	mu     sync.Mutex
	conns  map[Peer]*grpc.ClientConn // peers dialled, by name and address
	server *grpc.Server              // nil until Start
	addr   string                    // advertised address; "" until Start
	// listener is the server's socket, once started.
	listener net.Listener
	closed   bool
}

var _ Transport = (*GRPC)(nil)

// ListenerFile returns a duplicate of the socket the server listens on,
// for a successor daemon to serve on (Config.Listener).
func (g *GRPC) ListenerFile() (*os.File, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	tl, ok := g.listener.(*net.TCPListener)
	if !ok {
		return nil, errors.New("transport: not listening on TCP")
	}
	return tl.File()
}

// NewGRPC returns a gRPC transport configured by cfg. It refuses a listen
// address that names no host (0.0.0.0, ::) without an Advertise address.
func NewGRPC(cfg Config) (*GRPC, error) {
	if cfg.Credentials == nil {
		return nil, errors.New("transport: no credentials")
	}
	if cfg.Listen != "" && cfg.Advertise == "" {
		host, _, err := net.SplitHostPort(cfg.Listen)
		if ip := net.ParseIP(host); err != nil || host == "" || ip != nil && ip.IsUnspecified() {
			return nil, fmt.Errorf("transport: the piece server listens on %s: set the address peers reach it at (Advertise)", cfg.Listen)
		}
	}
	if cfg.Idle <= 0 {
		cfg.Idle = DefaultIdle
	}
	if cfg.MaxUploads <= 0 {
		cfg.MaxUploads = DefaultMaxUploads
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	return &GRPC{cfg: cfg, conns: map[Peer]*grpc.ClientConn{}}, nil
}

// Start implements Transport: it listens on Config.Listen.
func (g *GRPC) Start(src Source) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case g.closed:
		return net.ErrClosed
	case g.server != nil:
		return errors.New("transport: already started")
	case g.cfg.Listen == "" && g.cfg.Listener == nil:
		return errors.New("transport: no listen address")
	}
	l := g.cfg.Listener
	if l == nil {
		var err error
		if l, err = net.Listen("tcp", g.cfg.Listen); err != nil {
			return fmt.Errorf("transport: piece server: %w", err)
		}
	}
	g.listener = l
	g.addr = g.cfg.Advertise
	if g.addr == "" {
		g.addr = l.Addr().String()
	}
	g.server = grpc.NewServer(
		grpc.Creds(credentials.NewTLS(g.cfg.Credentials.ServerConfig())),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
		grpc.ForceServerCodecV2(pieceCodec{}),
	)
	piecepb.RegisterPiecesServer(g.server, &pieceServer{src: src, log: g.cfg.Log, slots: make(chan struct{}, g.cfg.MaxUploads)})
	go func() {
		if err := g.server.Serve(l); err != nil {
			g.cfg.Log.Warn("cluster: piece server stopped", "addr", l.Addr(), "err", err)
		}
	}()
	return nil
}

// Addr implements Transport.
func (g *GRPC) Addr() string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.addr
}

// Fetch implements Transport.
func (g *GRPC) Fetch(ctx context.Context, peer Peer, p Piece, dst Dest) (int64, error) {
	conn, err := g.conn(peer)
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	idle := time.AfterFunc(g.cfg.Idle, func() { cancel(fmt.Errorf("%w: nothing received for %v", ErrUnreachable, g.cfg.Idle)) })
	defer idle.Stop()
	stream, err := piecepb.NewPiecesClient(conn).Fetch(ctx, &piecepb.FetchRequest{Content: p.Content, Index: uint32(p.Index)})
	if err != nil {
		return 0, fetchError(ctx, peer, p, err)
	}
	var n int64
	var c chunk // received into a pooled buffer (pieceCodec), freed once written
	for {
		err := stream.RecvMsg(&c)
		if err == io.EOF {
			return n, nil
		}
		if err != nil {
			c.free()
			return n, fetchError(ctx, peer, p, err)
		}
		idle.Reset(g.cfg.Idle)
		k, err := dst.WriteAt(c.data, n)
		c.free()
		n += int64(k)
		if err != nil {
			return n, fmt.Errorf("fetch piece %d of %.12s from %s: %w", p.Index, p.Content, peer.Name, err)
		}
	}
}

// fetchError wraps a gRPC error in ErrNotServed or ErrUnreachable, or in
// the context's error when the caller gave up.
func fetchError(ctx context.Context, peer Peer, p Piece, err error) error {
	kind := ErrUnreachable
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("fetch piece %d of %.12s from %s: %w", p.Index, p.Content, peer.Name, context.Cause(ctx))
	case status.Code(err) == codes.NotFound:
		kind = ErrNotServed
	case status.Code(err) == codes.ResourceExhausted:
		kind = ErrBusy
	}
	return fmt.Errorf("fetch piece %d of %.12s from %s (%s): %w: %s", p.Index, p.Content, peer.Name, peer.Addr, kind, status.Convert(err).Message())
}

// conn returns the connection to peer, dialling it the first time. gRPC
// connects lazily and reconnects by itself.
func (g *GRPC) conn(peer Peer) (*grpc.ClientConn, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return nil, net.ErrClosed
	}
	if c := g.conns[peer]; c != nil {
		return c, nil
	}
	c, err := grpc.NewClient("passthrough:///"+peer.Addr,
		grpc.WithTransportCredentials(credentials.NewTLS(g.cfg.Credentials.ClientConfig(peer.Name))),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(2*ChunkSize), grpc.ForceCodecV2(pieceCodec{})),
		grpc.WithConnectParams(ConnectParams()),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 10 * time.Second, Timeout: 5 * time.Second, PermitWithoutStream: true}),
	)
	if err != nil {
		return nil, fmt.Errorf("peer %s (%s): %w: %v", peer.Name, peer.Addr, ErrUnreachable, err)
	}
	g.conns[peer] = c
	return c, nil
}

// Close implements Transport.
func (g *GRPC) Close() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return nil
	}
	g.closed = true
	if g.server != nil {
		g.server.Stop()
	}
	for _, c := range g.conns {
		c.Close()
	}
	g.conns = nil
	return nil
}

// pieceServer answers Fetch from a Source.
type pieceServer struct {
	piecepb.UnimplementedPiecesServer
	src   Source
	log   *slog.Logger
	slots chan struct{} // one per piece being sent
}

// Fetch streams the piece the request names, in chunks of ChunkSize, or
// refuses it (ResourceExhausted) while every slot is taken.
func (s *pieceServer) Fetch(req *piecepb.FetchRequest, stream grpc.ServerStreamingServer[piecepb.Chunk]) error {
	select {
	case s.slots <- struct{}{}:
		defer func() { <-s.slots }()
	default:
		return status.Error(codes.ResourceExhausted, "sending as many pieces as it may")
	}
	p := Piece{Content: req.Content, Index: int(req.Index)}
	b, err := s.src.Piece(p)
	if err != nil {
		s.log.Info("cluster: refused a piece", "content", p.Content, "piece", p.Index, "err", err)
		return status.Error(codes.NotFound, err.Error())
	}
	for len(b) > 0 {
		// Slices of the piece, never written: gRPC may hold a message
		// after Send.
		n := min(len(b), ChunkSize)
		if err := stream.Send(&piecepb.Chunk{Data: b[:n]}); err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}
