// Package transport moves the pieces of published contents between the
// nodes of a tensorfs cluster.
//
// It knows nothing of etcd, manifests or hashes: a server hands out the
// byte range a Source names for a piece, and a client streams that range
// into an io.Writer. Which piece to ask for, from whom, and whether the
// bytes are right is the cluster package's business (it verifies every
// piece against its published hash).
//
// Transport is the seam for other engines: GRPC is the implementation here
// (mutual TLS with the cluster's CA, one HTTP/2 connection per peer, a
// server stream per piece); an RDMA engine such as NIXL or Mooncake's
// Transfer Engine can replace it on clusters that have the fabric.
package transport

import (
	"context"
	"errors"
	"io"
	"net"
)

// Piece names one piece of a published content.
type Piece struct {
	Content string // content ID: hex SHA-256 of the content's manifest
	Index   int    // index of the piece within the content, from 0
}

// Peer is another node as the transport reaches it.
type Peer struct {
	Name string // node name; the peer's certificate must carry it
	Addr string // host:port of its piece server
}

// Source gives a server the bytes of the pieces its node serves.
type Source interface {
	// Piece returns where piece p's bytes are: r at [off, off+n). It
	// returns an error (ErrNotServed, wrapped) for a piece the node does
	// not serve: one not published, not held, or not yet verified.
	Piece(p Piece) (r io.ReaderAt, off, n int64, err error)
}

// Transport moves pieces between nodes.
type Transport interface {
	// Serve answers peers' fetches on l from src until Close. It returns
	// at once; l belongs to the transport from then on.
	Serve(l net.Listener, src Source) error
	// Fetch streams piece p from peer into w, in order, and returns the
	// number of bytes written. A piece the peer does not serve fails with
	// ErrNotServed; an unreachable or refusing peer with ErrUnreachable
	// (both wrapped). A partial piece may have reached w on failure.
	Fetch(ctx context.Context, peer Peer, p Piece, w io.Writer) (int64, error)
	// Close stops serving, ends the fetches in flight and closes every
	// connection.
	Close() error
}

// Errors of Fetch, wrapped with the peer and the piece.
var (
	// ErrNotServed is returned when the peer does not serve the piece.
	ErrNotServed = errors.New("piece not served by this node")
	// ErrUnreachable is returned when the peer cannot be reached, dies
	// mid-stream, or refuses this node's credentials.
	ErrUnreachable = errors.New("peer unreachable")
)
