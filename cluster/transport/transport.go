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
	"math/bits"
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
	// cannot tell yet (the peer asks again later). With accept (the
	// pieces the peer takes in p's place, bit i of byte i/8; nil for
	// none) it may send one of them instead, and returns which it sends.
	Piece(p Piece, accept []byte) (int, []byte, error)
	// Holding returns a Watcher of what the node holds of contents.
	Holding(contents []string) (Watcher, error)
}

// Watcher tells a server what its node holds of the contents a peer
// watches (Source.Holding).
type Watcher interface {
	// Bits returns a copy of the pieces held of content i (of those
	// watched), bit j of byte j/8; nil if the node does not hold it.
	Bits(i int) []byte
	// Changed receives after the pieces held of a watched content change.
	Changed() <-chan struct{}
	// Stop ends the watch.
	Stop()
}

// Update is news from a watched peer of what it holds of content
// Content (an index of the contents watched): every piece (Bits, a
// bitmap), one more piece (Piece, with Bits nil), or none (Gone: it holds
// the content no more). It is a hint: the peer's word.
type Update struct {
	Content int
	Bits    []byte
	Piece   int
	Gone    bool
}

// Updates returns the updates that bring a peer told sent (by content:
// the bitmap told last, nil for none or gone) to what w holds now, and
// records them in sent: a bitmap for a content newly held or that lost a
// piece, a Piece for each piece gained, Gone for one no longer held.
func Updates(w Watcher, sent [][]byte) []Update {
	var us []Update
	for i, old := range sent {
		cur := w.Bits(i)
		switch {
		case cur == nil && old != nil:
			us = append(us, Update{Content: i, Gone: true})
		case cur == nil:
		case old == nil || len(old) != len(cur) || lost(old, cur):
			us = append(us, Update{Content: i, Bits: cur})
		default:
			for k := range cur {
				for x := cur[k] &^ old[k]; x != 0; x &= x - 1 {
					us = append(us, Update{Content: i, Piece: k*8 + bits.TrailingZeros8(x)})
				}
			}
		}
		sent[i] = cur
	}
	return us
}

// lost reports whether old has a bit cur lacks (of equal lengths).
func lost(old, cur []byte) bool {
	for k := range old {
		if old[k]&^cur[k] != 0 {
			return true
		}
	}
	return false
}

// Dest is where a fetched piece goes: File at [Off, Off+Len), and nowhere
// else. In the daemon File is the segment's backing *os.File, which an
// engine may map and register to have the bytes placed there directly.
type Dest struct {
	File io.WriterAt
	Off  int64 // where the piece begins in File
	Len  int64 // the piece's size
	// Accept names the pieces the caller takes in place of the one it
	// asks for (bit i of byte i/8, at most MaxBitmap bytes; nil for
	// none): the peer may send one of them instead (super-seeding). For
	// then gives that piece's Dest, or an error if the caller no longer
	// takes it (the fetch fails with it, and the connection is closed).
	Accept []byte
	For    func(index int) (Dest, error)
}

// Place returns the Dest of piece index, which the peer sends for the
// piece asked (d's): d itself, or For's for one of Accept; ErrUnreachable
// for a piece d does not accept.
func (d Dest) Place(asked, index int) (Dest, error) {
	switch {
	case index == asked:
		return d, nil
	case index < 0 || index/8 >= len(d.Accept) || d.Accept[index/8]&(1<<(index%8)) == 0 || d.For == nil:
		return Dest{}, fmt.Errorf("%w: the peer sends piece %d for %d, which was not accepted", ErrUnreachable, index, asked)
	}
	return d.For(index)
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
	// The peer may send a piece of dst.Accept instead, placed where
	// dst.For says.
	Fetch(ctx context.Context, peer Peer, p Piece, dst Dest) (int64, error)
	// Watch subscribes to what peer holds of contents: it calls update
	// with each Update the peer sends (first its bitmap of each content
	// it holds, then the pieces it gets), from one goroutine, until ctx
	// ends (nil) or the watch fails (its error: ErrBusy when the peer
	// watches as much as it may, ErrUnreachable, wrapped).
	Watch(ctx context.Context, peer Peer, contents []string, update func(Update)) error
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
