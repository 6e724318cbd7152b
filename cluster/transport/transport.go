// Package transport moves the pieces of published contents between the
// nodes of a tensorfs cluster.
//
// It knows nothing of etcd, manifests or hashes: a server hands out the
// byte range a Source names for a piece, and a client places the bytes of
// a piece into the Dest it is given, at their offset. Which piece to ask
// for, from whom, and whether the bytes are right is the cluster
// package's business (it verifies every piece against its published hash,
// as the bytes are written to the destination).
//
// Transport is the seam for other engines: Stream is the implementation
// here (mutual TLS with the cluster's CA, a minimal frame per piece on
// connections kept open between fetches; frame.go has the protocol). An
// RDMA engine such as NIXL or Mooncake's Transfer Engine fits the same
// interface: it owns its endpoint (Start, Addr), registers the destination file (Dest.File, an *os.File in the
// daemon) and has the peer write the piece's bytes straight into it.
// Package fake is an in-memory one for tests.
package transport

import (
	"context"
	"errors"
	"fmt"
	"io"
)

// Piece names one piece of a published content.
type Piece struct {
	Content string // content ID: hex SHA-256 of the content's manifest
	Index   int    // index of the piece within the content, from 0
}

// Peer is another node as the transport reaches it.
type Peer struct {
	Name string // node name; the peer's certificate must carry it
	Addr string // where it is reached: what its transport's Addr returned
}

// Source gives a server the bytes of the pieces its node serves.
type Source interface {
	// Piece returns piece p's bytes, as verified: the server sends them
	// as they are (no copy, no second read) and never changes them. It
	// is called once the server has a slot for the piece, so a server
	// holds at most its bound on pieces sent at once. It returns an error
	// (ErrNotServed, wrapped) for a piece the node does not serve: one
	// not published, not held, or not verified; ErrBusy for one it
	// cannot tell yet (the peer asks again later).
	Piece(p Piece) ([]byte, error)
}

// Dest is where a fetched piece goes: File at [Off, Off+Len), and nowhere
// else. In the daemon File is the segment's backing *os.File, which an
// engine may map and register to have the bytes placed there directly.
type Dest struct {
	File io.WriterAt
	Off  int64 // where the piece begins in File
	Len  int64 // the piece's size
}

// WriteAt writes b at offset off of the piece (not of the file). A write
// that would pass the piece's end writes nothing and fails (the peer sent
// too much: ErrUnreachable); one File refuses fails with ErrDest and the
// file's error, both wrapped.
func (d Dest) WriteAt(b []byte, off int64) (int, error) {
	if off < 0 || int64(len(b)) > d.Len-off {
		return 0, fmt.Errorf("%w: the peer sent more than the piece's %d bytes", ErrUnreachable, d.Len)
	}
	k, err := d.File.WriteAt(b, d.Off+off)
	if err != nil {
		return k, fmt.Errorf("%w: %w", ErrDest, err)
	}
	return k, nil
}

// Transport moves pieces between nodes. A transport owns its endpoint: it
// is made with its configuration (where to listen, its credentials), and
// Start opens it.
type Transport interface {
	// Start opens the endpoint and answers peers' fetches from src until
	// Close, refusing (ErrBusy) those past the transport's bound on the
	// pieces it sends at once.
	Start(src Source) error
	// Addr returns where peers reach this node (Peer.Addr); "" before
	// Start.
	Addr() string
	// Fetch places piece p from peer into dst and returns the number of
	// bytes it wrote. A piece the peer does not serve fails with
	// ErrNotServed; a peer sending as many pieces as it may with
	// ErrBusy; an unreachable, refusing or silent peer (nothing
	// received for the transport's idle timeout) with ErrUnreachable; a
	// write dst refused with ErrDest (all wrapped). Part of the piece may
	// be in dst on failure, and even on success its bytes are the peer's
	// word: the caller verifies them.
	Fetch(ctx context.Context, peer Peer, p Piece, dst Dest) (int64, error)
	// Close stops serving, ends the fetches in flight and closes every
	// connection.
	Close() error
}

// Errors of Fetch, wrapped with the peer and the piece.
var (
	// ErrNotServed is returned when the peer does not serve the piece.
	ErrNotServed = errors.New("piece not served by this node")
	// ErrBusy is returned when the peer sends as many pieces as it may
	// at once (its MaxUploads), or is starting and does not know yet
	// what it holds: ask it again later, or ask another.
	ErrBusy = errors.New("peer busy")
	// ErrUnreachable is returned when the peer cannot be reached, dies
	// mid-stream, stalls, sends more than the piece, or refuses this
	// node's credentials.
	ErrUnreachable = errors.New("peer unreachable")
	// ErrDest is returned when the destination refused a write (a full
	// or failing backing store): the fault is this node's, not the
	// peer's.
	ErrDest = errors.New("writing the destination failed")
)
