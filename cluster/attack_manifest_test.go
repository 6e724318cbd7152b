package cluster

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"math"
	"testing"

	"tensorfs/cluster/transport"
)

// forge encodes a content as a member with a certificate may write it
// into etcd (any size, piece size and hashes), and returns its ID and
// encoding.
func forge(t *testing.T, size, pieceSize int64, pieces int) (string, []byte) {
	t.Helper()
	b, err := json.Marshal(&Content{Size: size, PieceSize: pieceSize, Hashes: make([]byte, pieces*sha256.Size)})
	if err != nil {
		t.Fatal(err)
	}
	return hashID(b), b
}

// TestAttackForgedPieceSize: a content's piece size is the publisher's
// word, and a node reads each piece it serves into a buffer of its size,
// MaxUploads at once (DESIGN.md: "at most that many pieces' bytes of the
// daemon, 32 MiB at 8 MiB pieces"). A member with a certificate but a
// hostile daemon published a content of one 2 GiB piece: every node that
// pulled it then held 2 GiB for each piece it sent, 8 GiB for four at
// once, and a size whose pieces overflow the count (2^63-1 bytes, pieces
// as large) was a content of no piece at all, complete once made.
func TestAttackForgedPieceSize(t *testing.T) {
	for _, c := range []struct {
		name            string
		size, pieceSize int64
		pieces          int
		ok              bool
	}{
		{"default pieces", 100 << 20, DefaultPieceSize, 13, true},
		{"small pieces", 100 << 20, 64 << 10, 1600, true},
		{"a large content's doubled pieces", 1 << 40, pieceSizeFor(1<<40, DefaultPieceSize), MaxPieces, true},
		{"one piece of the whole", 2 << 30, 2 << 30, 1, false},
		{"pieces past the count", math.MaxInt64, math.MaxInt64, 0, false},
		{"one byte past the last piece", math.MaxInt64 - 5, math.MaxInt64 - 5, 1, false},
	} {
		id, b := forge(t, c.size, c.pieceSize, c.pieces)
		_, err := decodeContent(id, b)
		if c.ok && err != nil {
			t.Errorf("%s: %v", c.name, err)
		}
		if !c.ok && !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s (size %d, piece size %d, %d pieces): %v; want ErrCorrupt", c.name, c.size, c.pieceSize, c.pieces, err)
		}
	}
}

// TestAttackForgedPieceCount: a content's piece size is only bounded
// above, so a member with a hostile daemon published one of small pieces,
// more than MaxPieces of them (20000 of 64 KiB: its hashes, 625 KiB,
// fit one etcd value): the bitmap of what a node holds of it is longer
// than a piece protocol frame carries (transport.MaxBitmap, 2 KiB). A
// node that pulled part of it sent that bitmap to every watch naming
// it, and each watcher, refusing the frame, ended its watch, losing what
// the member told of every other content of its pull, and dialled it
// again; a puller asking the only seed for a piece with the others
// accepted in place made a request it refuses to send (not served, for
// every piece).
func TestAttackForgedPieceCount(t *testing.T) {
	id, b := forge(t, 20000<<16, 64<<10, 20000)
	if _, err := decodeContent(id, b); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("a content of 20000 pieces (2500 bytes of bitmap): %v; want ErrCorrupt", err)
	}
	id, b = forge(t, MaxPieces<<16, 64<<10, MaxPieces)
	if _, err := decodeContent(id, b); err != nil {
		t.Fatalf("a content of MaxPieces pieces: %v", err)
	}
	if (MaxPieces+7)/8 != transport.MaxBitmap {
		t.Fatalf("MaxPieces %d is not what a bitmap of transport.MaxBitmap (%d bytes) holds", MaxPieces, transport.MaxBitmap)
	}
}
