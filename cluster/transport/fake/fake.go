// Package fake is an in-memory transport.Transport for tests: the nodes of
// a Network reach each other's sources by name, with no sockets, TLS or
// goroutines of its own. The bytes are copied from the serving node's
// Source into the fetching node's Dest in chunks, so a fetch can be
// cancelled between two of them.
package fake

import (
	"context"
	"fmt"
	"net"
	"sync"

	"tensorfs/cluster/transport"
)

// chunk is the size of the copies a fetch is made of.
const chunk = 64 << 10

// Network is a set of transports that reach each other.
type Network struct {
	mu      sync.Mutex
	serving map[string]*Transport // started, not closed: by address
}

// NewNetwork returns an empty network.
func NewNetwork() *Network { return &Network{serving: map[string]*Transport{}} }

// Transport is one node's endpoint on a Network.
type Transport struct {
	net  *Network
	name string

	closing context.Context // ends at Close, and the fetches in flight with it
	close   context.CancelFunc

	slots chan struct{} // one per piece being sent; nil: no bound

	mu     sync.Mutex
	src    transport.Source // nil until Start
	closed bool
}

var _ transport.Transport = (*Transport)(nil)

// New returns the transport of node name on the network; its address is
// "fake:" and the name. It sends at most maxUploads pieces at once and
// refuses more (ErrBusy); 0 is no bound.
func (nw *Network) New(name string, maxUploads int) *Transport {
	t := &Transport{net: nw, name: name}
	if maxUploads > 0 {
		t.slots = make(chan struct{}, maxUploads)
	}
	t.closing, t.close = context.WithCancel(context.Background())
	return t
}

// Start implements transport.Transport.
func (t *Transport) Start(src transport.Source) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return net.ErrClosed
	}
	t.src = src
	t.net.mu.Lock()
	defer t.net.mu.Unlock()
	if t.net.serving[t.Addr()] != nil {
		return fmt.Errorf("fake: %s is served already", t.Addr())
	}
	t.net.serving[t.Addr()] = t
	return nil
}

// Addr implements transport.Transport.
func (t *Transport) Addr() string { return "fake:" + t.name }

// Fetch implements transport.Transport: the peer must be served under its
// address by a transport of its name, as a certificate would prove.
func (t *Transport) Fetch(ctx context.Context, peer transport.Peer, p transport.Piece, dst transport.Dest) (int64, error) {
	if t.isClosed() {
		return 0, net.ErrClosed
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(t.closing, cancel)()
	server := t.server(peer)
	if server == nil {
		return 0, fmt.Errorf("fetch piece %d of %.12s from %s (%s): %w", p.Index, p.Content, peer.Name, peer.Addr, transport.ErrUnreachable)
	}
	if server.slots != nil {
		select {
		case server.slots <- struct{}{}:
			defer func() { <-server.slots }()
		default:
			return 0, fmt.Errorf("fetch piece %d of %.12s from %s: %w", p.Index, p.Content, peer.Name, transport.ErrBusy)
		}
	}
	index, piece, err := server.src.Piece(p, dst.Accept)
	if err == nil {
		dst, err = dst.Place(p.Index, index)
	}
	if err != nil {
		return 0, fmt.Errorf("fetch piece %d of %.12s from %s: %w", p.Index, p.Content, peer.Name, err)
	}
	n := int64(len(piece))
	var done int64
	for done < n {
		if err := ctx.Err(); err != nil {
			return done, fmt.Errorf("fetch piece %d of %.12s from %s: %w", p.Index, p.Content, peer.Name, err)
		}
		if server.isClosed() {
			return done, fmt.Errorf("fetch piece %d of %.12s from %s: %w: it closed", p.Index, p.Content, peer.Name, transport.ErrUnreachable)
		}
		k, err := dst.WriteAt(piece[done:min(n, done+chunk)], done)
		done += int64(k)
		if err != nil {
			return done, err
		}
	}
	return done, nil
}

// Watch implements transport.Transport: the updates of the peer's source
// (transport.Updates) as its Watcher changes, until ctx ends, either
// transport closes (ErrUnreachable) or the peer's source refuses.
func (t *Transport) Watch(ctx context.Context, peer transport.Peer, contents []string, update func(transport.Update)) error {
	server := t.server(peer)
	if server == nil {
		return fmt.Errorf("watch %s: %w", peer.Name, transport.ErrUnreachable)
	}
	w, err := server.src.Holding(contents)
	if err != nil {
		return fmt.Errorf("watch %s: %w", peer.Name, err)
	}
	defer w.Stop()
	sent := make([][]byte, len(contents))
	for {
		for _, u := range transport.Updates(w, sent) {
			update(u)
		}
		select {
		case <-w.Changed():
		case <-ctx.Done():
			return nil
		case <-t.closing.Done():
			return net.ErrClosed
		case <-server.closing.Done():
			return fmt.Errorf("watch %s: %w: it closed", peer.Name, transport.ErrUnreachable)
		}
	}
}

// server returns the transport serving peer, if it serves under its
// address with its name (as a certificate would prove); nil if none.
func (t *Transport) server(peer transport.Peer) *Transport {
	t.net.mu.Lock()
	defer t.net.mu.Unlock()
	if s := t.net.serving[peer.Addr]; s != nil && s.name == peer.Name {
		return s
	}
	return nil
}

// isClosed reports whether Close was called.
func (t *Transport) isClosed() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.closed
}

// Close implements transport.Transport: the node serves no more and its
// fetches in flight end.
func (t *Transport) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	t.closed = true
	t.close()
	t.net.mu.Lock()
	if t.net.serving[t.Addr()] == t {
		delete(t.net.serving, t.Addr())
	}
	t.net.mu.Unlock()
	return nil
}
