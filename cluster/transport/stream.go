package transport

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"time"
)

// Defaults of Config.
const (
	// DefaultIdle is how long a fetch may receive nothing before it
	// fails, or take to receive one readChunk of its piece.
	DefaultIdle = 10 * time.Second
	// DefaultMaxUploads is how many pieces a node sends at once.
	DefaultMaxUploads = 4
)

// Connection timeouts and buffers.
const (
	// handshakeTimeout bounds a TLS handshake, on either side.
	handshakeTimeout = 10 * time.Second
	// serverIdle is how long a server keeps a connection that asks for
	// nothing; keptIdle, shorter, how long a client keeps one unused.
	serverIdle = 2 * time.Minute
	keptIdle   = time.Minute
	// maxPendingPerHost is how many connections from one host (an
	// address; every loopback address is one host, an IPv6 /64 one) may
	// be in their handshake at once: a new one past it ends the oldest.
	// A process with no certificate that reaches the port holds that many
	// of maxServed at most, and delays only handshakes from its own host.
	maxPendingPerHost = 64
	// maxPerPeer is how many connections a node has to one peer at most:
	// fetches past it wait for one (the peer sends at most MaxUploads
	// pieces at once anyway). A server holds at most twice as many of
	// one member's (a new one past it ends its oldest, which a member
	// that lost its network and came back has no use for): one member cannot take
	// the maxServed of every other.
	maxPerPeer = 8
	// sendSlice is how much of a piece one write sends (the write
	// deadline is the idle timeout, for each).
	sendSlice = 1 << 20
	// readChunk is how much of a piece is read before it is written to
	// its destination: small enough to stay in the CPU's cache between
	// the two (the destination may hash it as it writes).
	readChunk = 256 << 10
	// maxWatches is how many watches the server serves at once, and
	// maxPeerWatches how many of them one peer (by its certificate's
	// name) holds; it refuses more (statusBusy). Each holds a connection
	// (of maxServed), two goroutines and a copy of the bitmaps it told.
	maxWatches     = 256
	maxPeerWatches = 4
	// watchAlive is how often a watch with nothing to tell says it is
	// alive; a client that hears nothing for three times as long ends it.
	watchAlive = 10 * time.Second
)

// maxServed is how many connections the server holds at once; it closes
// more as it accepts them. A variable, so that tests flood a smaller one.
var maxServed = 512

// Config says where a Stream transport listens and how it authenticates.
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
	// Idle ends a fetch that has received nothing for this long, or
	// less than readChunk of its piece (DefaultIdle if 0).
	Idle time.Duration
	// MaxUploads is how many pieces the server sends at once, half of
	// them (at least one) to one peer; it refuses more (ErrBusy to the
	// peer). DefaultMaxUploads if 0.
	MaxUploads int
	// Log receives what the transport does (nothing if nil).
	Log *slog.Logger
}

// Stream is the transport of tensorfs's nodes: the piece protocol
// (Protocol, frame.go) over mutual-TLS connections with the cluster's
// credentials, one fetch at a time on each, kept open between fetches.
// The piece's bytes go from the server's buffer through TLS into the
// client's destination with no framing but one header, written a batch
// of records a system call (batchConn) and read by the fetching
// goroutine itself.
type Stream struct {
	cfg    Config
	server *tls.Config   // with Protocol
	slots  chan struct{} // one per piece being sent
	served chan struct{} // one per connection served

	watchMu   sync.Mutex
	watching  map[string]int // watches served, by peer
	watches   int            // watches served in all
	uploading map[string]int // pieces being sent, by peer (a slot each)

	mu       sync.Mutex
	src      Source                 // nil until Start
	listener net.Listener           // nil until Start
	addr     string                 // advertised address; "" until Start
	idle     map[Peer][]*streamConn // client connections kept for the next fetch
	open     map[net.Conn]bool      // every connection, either side, until closed
	pending  map[string][]net.Conn  // the server's connections in their handshake, by host, oldest first
	members  map[string][]net.Conn  // the server's connections past their handshake, by peer, oldest first
	perPeer  map[Peer]chan struct{} // a token per connection to a peer (maxPerPeer), while a fetch uses it
	watchers map[Peer]chan struct{} // a token per watch of a peer (maxPeerWatches), while it runs
	closed   bool
	serving  sync.WaitGroup // the server's goroutines
}

var _ Transport = (*Stream)(nil)

// streamConn is a client connection to a peer.
type streamConn struct {
	*tls.Conn
	raw  net.Conn  // the TCP connection, closed to end a fetch at once
	kept time.Time // when it was last kept idle
}

// NewStream returns a Stream transport configured by cfg. It refuses a
// listen address that names no host (0.0.0.0, ::) without an Advertise
// address.
func NewStream(cfg Config) (*Stream, error) {
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
	server := cfg.Credentials.ServerConfig()
	server.NextProtos = []string{Protocol}
	server.DynamicRecordSizingDisabled = true
	return &Stream{cfg: cfg, server: server, slots: make(chan struct{}, cfg.MaxUploads), served: make(chan struct{}, maxServed),
		watching: map[string]int{}, uploading: map[string]int{}, idle: map[Peer][]*streamConn{}, open: map[net.Conn]bool{}, pending: map[string][]net.Conn{},
		members: map[string][]net.Conn{}, perPeer: map[Peer]chan struct{}{}, watchers: map[Peer]chan struct{}{}}, nil
}

// ListenerFile returns a duplicate of the socket the server listens on,
// for a successor daemon to serve on (Config.Listener).
func (s *Stream) ListenerFile() (*os.File, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	tl, ok := s.listener.(*net.TCPListener)
	if !ok {
		return nil, errors.New("transport: not listening on TCP")
	}
	return tl.File()
}

// Start implements Transport: it listens on Config.Listen.
func (s *Stream) Start(src Source) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return net.ErrClosed
	case s.listener != nil:
		return errors.New("transport: already started")
	case s.cfg.Listen == "" && s.cfg.Listener == nil:
		return errors.New("transport: no listen address")
	}
	l := s.cfg.Listener
	if l == nil {
		var err error
		if l, err = net.Listen("tcp", s.cfg.Listen); err != nil {
			return fmt.Errorf("transport: piece server: %w", err)
		}
	}
	s.src, s.listener = src, l
	s.addr = s.cfg.Advertise
	if s.addr == "" {
		s.addr = l.Addr().String()
	}
	s.serving.Add(1)
	go s.accept(l)
	return nil
}

// Addr implements Transport.
func (s *Stream) Addr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.addr
}

// accept serves the connections l accepts until it is closed.
func (s *Stream) accept(l net.Listener) {
	defer s.serving.Done()
	for {
		raw, err := l.Accept()
		if err != nil {
			if s.isClosed() || errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of descriptors, say: the connections served end and
			// free some.
			s.cfg.Log.Warn("cluster: the piece server cannot accept a connection", "addr", l.Addr(), "err", err)
			time.Sleep(100 * time.Millisecond)
			continue
		}
		select {
		case s.served <- struct{}{}:
		default:
			s.cfg.Log.Warn("cluster: the piece server holds as many connections as it may; closed a new one", "remote", raw.RemoteAddr(), "max", maxServed)
			raw.Close()
			continue
		}
		if !s.track(raw) {
			<-s.served
			return
		}
		s.serving.Add(1)
		go s.serve(raw)
	}
}

// serve answers the requests of one connection until it ends: fails its
// handshake, asks for nothing for serverIdle, breaks the protocol, or the
// transport closes.
func (s *Stream) serve(raw net.Conn) {
	defer s.serving.Done()
	defer func() { <-s.served }()
	defer s.untrack(raw)
	bc := newBatchConn(raw, 4<<10)
	c := tls.Server(bc, s.server)
	raw.SetDeadline(time.Now().Add(handshakeTimeout))
	key := s.handshaking(raw)
	err := c.Handshake()
	s.handshook(key, raw)
	if err != nil {
		s.cfg.Log.Info("cluster: refused a peer's connection", "remote", raw.RemoteAddr(), "err", err)
		return
	}
	peer := peerName(c.ConnectionState().PeerCertificates[0])
	s.member(peer, raw)
	defer s.memberGone(peer, raw)
	for {
		raw.SetDeadline(time.Now().Add(serverIdle))
		req, err := readRequest(c)
		if err != nil {
			if !errors.Is(err, io.EOF) && !s.isClosed() {
				s.cfg.Log.Info("cluster: ended a peer's connection", "peer", peer, "remote", raw.RemoteAddr(), "err", err)
			}
			return
		}
		if req.Watch != nil {
			if err := s.watch(c, raw, peer, req.Watch); err != nil && !s.isClosed() {
				s.cfg.Log.Info("cluster: a peer's watch ended", "peer", peer, "err", err)
			}
			return
		}
		if err := s.send(c, bc, raw, peer, req); err != nil {
			if !s.isClosed() {
				s.cfg.Log.Info("cluster: sending a piece failed", "peer", peer, "content", req.Piece.Content, "piece", req.Piece.Index, "err", err)
			}
			return
		}
	}
}

// peerName returns the name of the member a client certificate is
// issued to, as the server counts its connections and watches: its DNS
// names, which name the node (Credentials.CheckName; a node checks a
// peer's so), else its subject's common name. (The common name alone,
// which a CA may leave empty or give every node alike, made every member
// one peer: 16 connections and 4 watches for the whole cluster, each new
// connection of one member ending another's.)
func peerName(cert *x509.Certificate) string {
	if len(cert.DNSNames) > 0 {
		return strings.Join(cert.DNSNames, ",")
	}
	return cert.Subject.CommonName
}

// hostKey returns the host a connection comes from, as the server
// counts its handshakes: its address, every loopback address as one (a
// local process may bind any of 127.0.0.0/8) and an IPv6 address by its
// /64.
func hostKey(a net.Addr) string {
	ta, ok := a.(*net.TCPAddr)
	if !ok {
		return a.String()
	}
	ip, ok := netip.AddrFromSlice(ta.IP)
	if !ok {
		return ta.IP.String()
	}
	ip = ip.Unmap()
	switch {
	case ip.IsLoopback():
		return "loopback"
	case ip.Is6():
		p, _ := ip.Prefix(64)
		return p.String()
	}
	return ip.String()
}

// handshaking records raw as in its handshake, ending the oldest of its
// host's past maxPendingPerHost, and returns its host's key.
func (s *Stream) handshaking(raw net.Conn) string {
	key := hostKey(raw.RemoteAddr())
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pending == nil { // closed
		return key
	}
	q := append(s.pending[key], raw)
	if len(q) > maxPendingPerHost {
		s.cfg.Log.Warn("cluster: the piece server ended the oldest handshake of a host that has as many under way as it may", "remote", q[0].RemoteAddr(), "max", maxPendingPerHost)
		q[0].Close()
		q = q[1:]
	}
	s.pending[key] = q
	return key
}

// handshook forgets raw as in its handshake.
func (s *Stream) handshook(key string, raw net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	forget(s.pending, key, raw)
}

// forget removes raw from conns[key], and the key once it has none.
func forget(conns map[string][]net.Conn, key string, raw net.Conn) {
	q := conns[key]
	if i := slices.Index(q, raw); i >= 0 {
		q = slices.Delete(q, i, i+1)
	}
	if len(q) == 0 {
		delete(conns, key)
	} else {
		conns[key] = q
	}
}

// member records raw as a connection of peer past its handshake, ending
// the oldest of peer's past 2*maxPerPeer.
func (s *Stream) member(peer string, raw net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.members == nil { // closed
		return
	}
	q := append(s.members[peer], raw)
	if len(q) > 2*maxPerPeer {
		s.cfg.Log.Warn("cluster: the piece server ended the oldest connection of a peer that has as many as it may", "peer", peer, "remote", q[0].RemoteAddr(), "max", 2*maxPerPeer)
		q[0].Close()
		q = q[1:]
	}
	s.members[peer] = q
}

// memberGone forgets raw as a connection of peer.
func (s *Stream) memberGone(peer string, raw net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	forget(s.members, peer, raw)
}

// watch serves peer's watch of contents on c until the peer closes it, a
// write fails, or the transport closes: the updates of what the source
// holds (Updates), as they come, and statusAlive every watchAlive. It is
// refused (statusBusy) past maxWatches, or maxPeerWatches of one peer.
func (s *Stream) watch(c *tls.Conn, raw net.Conn, peer string, contents []string) error {
	if !s.startWatch(peer) {
		return refuse(c, statusBusy, "watched by as many peers as it may")
	}
	defer s.endWatch(peer)
	w, err := s.src.Holding(contents)
	if err != nil {
		return refuse(c, statusBusy, err.Error())
	}
	defer w.Stop()
	// The peer sends nothing more: a read returns once it closes.
	gone := make(chan struct{})
	raw.SetReadDeadline(time.Time{})
	s.serving.Add(1)
	go func() {
		defer s.serving.Done()
		c.Read(make([]byte, 1))
		close(gone)
	}()
	defer raw.Close() // ends the read, if the peer did not
	alive := time.NewTicker(watchAlive)
	defer alive.Stop()
	sent := make([][]byte, len(contents))
	for {
		b := appendUpdates(nil, Updates(w, sent))
		if len(b) > 0 {
			raw.SetWriteDeadline(time.Now().Add(s.cfg.Idle))
			if _, err := c.Write(b); err != nil {
				return err
			}
		}
		select {
		case <-w.Changed():
		case <-alive.C:
			raw.SetWriteDeadline(time.Now().Add(s.cfg.Idle))
			if _, err := c.Write(appendReplyHeader(nil, replyHeader{status: statusAlive})); err != nil {
				return err
			}
		case <-gone:
			return nil
		}
	}
}

// startWatch takes a watch for peer; false past maxWatches, or
// maxPeerWatches of peer's.
func (s *Stream) startWatch(peer string) bool {
	s.watchMu.Lock()
	defer s.watchMu.Unlock()
	if s.watches >= maxWatches || s.watching[peer] >= maxPeerWatches {
		return false
	}
	s.watches++
	s.watching[peer]++
	return true
}

// endWatch gives back a watch of peer's.
func (s *Stream) endWatch(peer string) {
	s.watchMu.Lock()
	defer s.watchMu.Unlock()
	s.watches--
	if s.watching[peer]--; s.watching[peer] == 0 {
		delete(s.watching, peer)
	}
}

// startUpload takes one of the upload slots one peer may hold, half of
// MaxUploads (at least one); false past them. A member that asked for
// every slot and took each piece as slowly as the write deadlines let it
// (a MiB per idle timeout), asking again as each ended, held them all:
// the node sent nothing to any other, its publisher's content reached
// no one.
func (s *Stream) startUpload(peer string) bool {
	s.watchMu.Lock()
	defer s.watchMu.Unlock()
	if s.uploading[peer] >= max(1, s.cfg.MaxUploads/2) {
		return false
	}
	s.uploading[peer]++
	return true
}

// endUpload gives back an upload slot of peer's.
func (s *Stream) endUpload(peer string) {
	s.watchMu.Lock()
	defer s.watchMu.Unlock()
	if s.uploading[peer]--; s.uploading[peer] == 0 {
		delete(s.uploading, peer)
	}
}

// appendUpdates appends the frames of us to b.
func appendUpdates(b []byte, us []Update) []byte {
	for _, u := range us {
		switch {
		case u.Gone:
			b = appendReplyHeader(b, replyHeader{status: statusGone, index: u.Content})
		case u.Bits != nil:
			b = append(appendReplyHeader(b, replyHeader{status: statusBitmap, index: u.Content, length: int64(len(u.Bits))}), u.Bits...)
		default:
			b = binary.BigEndian.AppendUint32(appendReplyHeader(b, replyHeader{status: statusHave, index: u.Content, length: 4}), uint32(u.Piece))
		}
	}
	return b
}

// send answers peer's request on c: the piece's bytes (the one asked, or
// one of those accepted in its place that the source chose), or a
// refusal (statusBusy while every slot is taken, or half of them by
// peer; statusNotServed for a piece the source does not serve). A peer
// that takes nothing for the idle timeout fails it.
func (s *Stream) send(c *tls.Conn, bc *batchConn, raw net.Conn, peer string, req request) error {
	p := req.Piece
	raw.SetDeadline(time.Now().Add(s.cfg.Idle))
	if !s.startUpload(peer) {
		return refuse(c, statusBusy, "sending a peer as many pieces as it may")
	}
	defer s.endUpload(peer)
	select {
	case s.slots <- struct{}{}:
		defer func() { <-s.slots }()
	default:
		return refuse(c, statusBusy, "sending as many pieces as it may")
	}
	index, b, err := s.src.Piece(p, req.Accept)
	if err != nil {
		s.cfg.Log.Info("cluster: refused a piece", "content", p.Content, "piece", p.Index, "err", err)
		if errors.Is(err, ErrBusy) {
			return refuse(c, statusBusy, err.Error())
		}
		return refuse(c, statusNotServed, err.Error())
	}
	bc.batch()
	defer bc.flush()
	if _, err := c.Write(appendReplyHeader(nil, replyHeader{status: statusOK, index: index, length: int64(len(b))})); err != nil {
		return err
	}
	for len(b) > 0 {
		n := min(len(b), sendSlice)
		raw.SetWriteDeadline(time.Now().Add(s.cfg.Idle))
		if _, err := c.Write(b[:n]); err != nil {
			return err
		}
		b = b[n:]
	}
	return bc.flush()
}

// refuse writes a refusal of status with msg (cut to maxMessage).
func refuse(c *tls.Conn, status byte, msg string) error {
	msg = msg[:min(len(msg), maxMessage)]
	_, err := c.Write(append(appendReplyHeader(nil, replyHeader{status: status, length: int64(len(msg))}), msg...))
	return err
}

// Fetch implements Transport. A connection kept from an earlier fetch
// that fails before the reply begins (the peer closed it while idle, or
// restarted) is dropped and the request sent again on another.
func (s *Stream) Fetch(ctx context.Context, peer Peer, p Piece, dst Dest) (int64, error) {
	req, err := appendFetch(nil, p, dst.Accept)
	if err != nil {
		return 0, fmt.Errorf("fetch piece %d of %.12s from %s: %w: %v", p.Index, p.Content, peer.Name, ErrNotServed, err)
	}
	release, err := s.acquire(ctx, s.perPeer, maxPerPeer, peer)
	if err != nil {
		return 0, s.fetchError(ctx, peer, p, err)
	}
	defer release()
	for {
		c, kept, err := s.conn(ctx, peer)
		if err != nil {
			return 0, s.fetchError(ctx, peer, p, err)
		}
		n, replied, err := s.fetchOn(ctx, c, req, p.Index, dst)
		if ctx.Err() == nil && (err == nil || errors.Is(err, ErrNotServed) || errors.Is(err, ErrBusy)) {
			s.keep(peer, c)
		} else {
			s.untrack(c.raw)
			if kept && !replied && ctx.Err() == nil {
				continue
			}
		}
		if err != nil {
			return n, s.fetchError(ctx, peer, p, err)
		}
		return n, nil
	}
}

// acquire waits for one of the size tokens of peer in tokens (made on
// first use): perPeer's are the maxPerPeer connections to peer a node has
// for fetches (a fetch holds its token while it uses the connection, and
// a kept one is idle, so that no more than maxPerPeer are open: a new one
// is dialled only where none is kept), watchers' its maxPeerWatches
// watches of peer, each on a connection of its own. The returned function
// gives it back.
func (s *Stream) acquire(ctx context.Context, tokens map[Peer]chan struct{}, size int, peer Peer) (func(), error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, net.ErrClosed
	}
	ch := tokens[peer]
	if ch == nil {
		ch = make(chan struct{}, size)
		tokens[peer] = ch
	}
	s.mu.Unlock()
	select {
	case ch <- struct{}{}:
		return func() { <-ch }, nil
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
}

// fetchOn sends req, for piece asked, on c and places the piece it
// receives in dst (or where dst.For says). It says whether the peer
// began its reply. A cancelled ctx closes c.
func (s *Stream) fetchOn(ctx context.Context, c *streamConn, req []byte, asked int, dst Dest) (n int64, replied bool, err error) {
	stop := context.AfterFunc(ctx, func() { c.raw.Close() })
	defer func() {
		if !stop() && err == nil {
			err = ctx.Err() // closed: not to be kept
		}
	}()
	c.raw.SetDeadline(time.Now().Add(s.cfg.Idle))
	if _, err := c.Write(req); err != nil {
		return 0, false, err
	}
	h, err := readReplyHeader(c)
	if err != nil {
		return 0, false, err
	}
	switch h.status {
	case statusOK:
	case statusNotServed, statusBusy:
		return 0, true, readRefusal(c, h)
	default:
		return 0, true, fmt.Errorf("%w: %w: status %d answers a fetch", ErrUnreachable, errFrame, h.status)
	}
	if dst, err = dst.Place(asked, h.index); err != nil {
		return 0, true, err
	}
	if h.length > dst.Len {
		return 0, true, fmt.Errorf("%w: the peer sends %d bytes for a piece of %d", ErrUnreachable, h.length, dst.Len)
	}
	n, err = s.receive(c, h.length, dst)
	return n, true, err
}

// readReplyHeader reads and parses a reply header from c; a malformed
// one is ErrUnreachable.
func readReplyHeader(c io.Reader) (replyHeader, error) {
	var b [replyHeaderSize]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return replyHeader{}, err
	}
	h, err := parseReplyHeader(b)
	if err != nil {
		return replyHeader{}, fmt.Errorf("%w: %w", ErrUnreachable, err)
	}
	return h, nil
}

// readRefusal reads the message of refusal h from c and returns it as
// ErrNotServed or ErrBusy.
func readRefusal(c io.Reader, h replyHeader) error {
	msg := make([]byte, h.length)
	if _, err := io.ReadFull(c, msg); err != nil {
		return err
	}
	kind := ErrNotServed
	if h.status == statusBusy {
		kind = ErrBusy
	}
	return fmt.Errorf("%w: %s", kind, msg)
}

// Watch implements Transport, on a connection of its own that is never
// kept for fetches. A node runs at most maxPeerWatches watches of one
// peer at once, as many as the peer serves it: one past them waits for
// one of them to end. (Each pull watches the members it subscribes to:
// a node's users' pulls made a connection each, past the 16 of its
// connections the peer holds, so that each new one ended the node's
// oldest, fetches in flight included; and the peer refused all but 4,
// which were dialled again every 2 s.)
func (s *Stream) Watch(ctx context.Context, peer Peer, contents []string, update func(Update)) error {
	req, err := appendWatch(nil, contents)
	if err != nil {
		return fmt.Errorf("watch %d contents of %s: %w", len(contents), peer.Name, err)
	}
	release, err := s.acquire(ctx, s.watchers, maxPeerWatches, peer)
	if err == nil {
		defer release()
	}
	var c *streamConn
	if err == nil {
		c, err = s.dial(ctx, peer)
	}
	if err == nil {
		defer s.untrack(c.raw)
		err = s.watchOn(ctx, c, req, len(contents), update)
	}
	if ctx.Err() != nil {
		return nil
	}
	return fmt.Errorf("watch %d contents of %s (%s): %w", len(contents), peer.Name, peer.Addr, s.cause(ctx, err))
}

// watchOn sends the watch request req, of n contents, on c and hands
// each update it receives to update until ctx ends or c fails.
func (s *Stream) watchOn(ctx context.Context, c *streamConn, req []byte, n int, update func(Update)) error {
	defer context.AfterFunc(ctx, func() { c.raw.Close() })()
	c.raw.SetDeadline(time.Now().Add(s.cfg.Idle))
	if _, err := c.Write(req); err != nil {
		return err
	}
	for {
		c.raw.SetReadDeadline(time.Now().Add(3 * watchAlive))
		h, err := readReplyHeader(c)
		if err != nil {
			return err
		}
		u, err := readUpdate(c, h, n)
		if err != nil {
			return err
		}
		if h.status != statusAlive {
			update(u)
		}
	}
}

// readUpdate reads the update that watch frame h begins from c, for a
// watch of n contents: a refusal is its error, a frame a watch does not
// carry ErrUnreachable.
func readUpdate(c io.Reader, h replyHeader, n int) (Update, error) {
	u := Update{Content: h.index}
	switch {
	case h.status == statusNotServed || h.status == statusBusy:
		return u, readRefusal(c, h)
	case h.status == statusAlive:
		return u, nil
	case h.status == statusOK || h.index >= n:
		return u, fmt.Errorf("%w: %w: status %d for content %d of %d in a watch", ErrUnreachable, errFrame, h.status, h.index, n)
	}
	b := make([]byte, h.length)
	if _, err := io.ReadFull(c, b); err != nil {
		return u, err
	}
	switch h.status {
	case statusBitmap:
		u.Bits = b
	case statusHave:
		u.Piece = int(binary.BigEndian.Uint32(b))
	case statusGone:
		u.Gone = true
	}
	return u, nil
}

// receive reads length bytes of a piece from c into dst, a readChunk at a
// time, failing if a chunk does not come whole within the idle timeout:
// a peer that sends a byte now and then, each inside the timeout, holds
// the piece in flight (asked of nobody else) for at most length/readChunk
// timeouts, not for ever.
func (s *Stream) receive(c *streamConn, length int64, dst Dest) (int64, error) {
	buf := readBufs.Get().(*[]byte)
	defer readBufs.Put(buf)
	var n int64
	for n < length {
		b := (*buf)[:min(int64(len(*buf)), length-n)]
		c.raw.SetReadDeadline(time.Now().Add(s.cfg.Idle))
		for k := 0; k < len(b); {
			r, err := c.Read(b[k:])
			k += r
			if err == io.EOF {
				return n, io.ErrUnexpectedEOF
			}
			if err != nil {
				return n, err
			}
		}
		w, err := dst.WriteAt(b, n)
		n += int64(w)
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// readBufs are the buffers a piece is received in.
var readBufs = sync.Pool{New: func() any {
	b := make([]byte, readChunk)
	return &b
}}

// fetchError says which fetch failed, with why (cause).
func (s *Stream) fetchError(ctx context.Context, peer Peer, p Piece, err error) error {
	return fmt.Errorf("fetch piece %d of %.12s from %s (%s): %w", p.Index, p.Content, peer.Name, peer.Addr, s.cause(ctx, err))
}

// cause wraps err in ErrUnreachable unless it is one of Fetch's errors
// already, or is the context's cause when the caller gave up.
func (s *Stream) cause(ctx context.Context, err error) error {
	switch {
	case ctx.Err() != nil:
		err = context.Cause(ctx)
	case errors.Is(err, os.ErrDeadlineExceeded):
		err = fmt.Errorf("%w: nothing received for %v (or less than %d KiB of a piece)", ErrUnreachable, s.cfg.Idle, readChunk>>10)
	case !errors.Is(err, ErrNotServed) && !errors.Is(err, ErrBusy) && !errors.Is(err, ErrUnreachable) && !errors.Is(err, ErrDest):
		err = fmt.Errorf("%w: %w", ErrUnreachable, err)
	}
	return err
}

// conn returns a connection to peer: one kept from an earlier fetch
// (kept), or a new one.
func (s *Stream) conn(ctx context.Context, peer Peer) (c *streamConn, kept bool, err error) {
	if c := s.kept(peer); c != nil {
		return c, true, nil
	}
	c, err = s.dial(ctx, peer)
	return c, false, err
}

// dial returns a new connection to peer.
func (s *Stream) dial(ctx context.Context, peer Peer) (*streamConn, error) {
	d := net.Dialer{Timeout: handshakeTimeout}
	raw, err := d.DialContext(ctx, "tcp", peer.Addr)
	if err != nil {
		return nil, err
	}
	if !s.track(raw) {
		return nil, net.ErrClosed
	}
	cfg := s.cfg.Credentials.ClientConfig(peer.Name)
	cfg.MinVersion = tls.VersionTLS13
	cfg.NextProtos = []string{Protocol}
	tc := tls.Client(newBatchConn(raw, batchSize), cfg)
	hctx, cancel := context.WithTimeout(ctx, handshakeTimeout)
	defer cancel()
	if err := tc.HandshakeContext(hctx); err != nil {
		s.untrack(raw)
		return nil, err
	}
	if proto := tc.ConnectionState().NegotiatedProtocol; proto != Protocol {
		s.untrack(raw)
		return nil, fmt.Errorf("the peer speaks %q, not %s", proto, Protocol)
	}
	return &streamConn{Conn: tc, raw: raw}, nil
}

// kept returns the connection to peer kept last, if any (one kept longer
// than keptIdle fails before its reply begins at worst, and is replaced).
func (s *Stream) kept(peer Peer) *streamConn {
	s.mu.Lock()
	defer s.mu.Unlock()
	cs := s.idle[peer]
	if len(cs) == 0 {
		return nil
	}
	s.idle[peer] = cs[:len(cs)-1]
	return cs[len(cs)-1]
}

// keep keeps c for the next fetch from peer, or closes it if the
// transport is closed; it closes the connections to any peer kept for
// keptIdle or longer.
func (s *Stream) keep(peer Peer, c *streamConn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		c.raw.Close()
		return
	}
	for p, cs := range s.idle {
		fresh := cs[:0]
		for _, k := range cs {
			if time.Since(k.kept) < keptIdle {
				fresh = append(fresh, k)
			} else {
				k.raw.Close()
				delete(s.open, k.raw)
			}
		}
		if s.idle[p] = fresh; len(fresh) == 0 {
			delete(s.idle, p)
		}
	}
	c.kept = time.Now()
	s.idle[peer] = append(s.idle[peer], c)
}

// track records c as open, so that Close closes it; false (and c closed)
// if the transport is closed.
func (s *Stream) track(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		c.Close()
		return false
	}
	s.open[c] = true
	return true
}

// untrack closes c and forgets it.
func (s *Stream) untrack(c net.Conn) {
	c.Close()
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.open, c)
}

// isClosed reports whether Close was called.
func (s *Stream) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// Close implements Transport: it closes the listener and every
// connection, and waits for the server's goroutines to end.
func (s *Stream) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	if s.listener != nil {
		s.listener.Close()
	}
	for c := range s.open {
		c.Close()
	}
	s.open, s.idle, s.pending, s.members = nil, nil, nil, nil
	s.mu.Unlock()
	s.serving.Wait()
	return nil
}
