package transport

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// The piece protocol, spoken over mutual-TLS connections (ALPN Protocol).
// A connection carries fetches, one at a time, or one watch. A request
// begins with its kind (1 byte). A fetch:
//
//	kind (reqFetch), content length (1 byte), content ID,
//	piece index (4 bytes, big-endian),
//	accept length (2 bytes, big-endian), accept bitmap
//
// asks for a piece; the accept bitmap (at most MaxBitmap bytes, bit i of
// byte i/8) names the pieces the client takes in its place, of which the
// server may send one instead (super-seeding). The server answers with a
// reply header:
//
//	status (1 byte), index (4 bytes, big-endian), length (8 bytes, big-endian)
//
// followed by length bytes: piece index's (statusOK), or a message saying
// why it is not sent (statusNotServed, statusBusy: at most maxMessage
// bytes). The connection then carries the next request. A watch:
//
//	kind (reqWatch), count (2 bytes, big-endian), then count times:
//	content length (1 byte), content ID (at most maxWatchedID bytes)
//
// subscribes to what the server holds of up to MaxWatched contents (a
// request of at most 66 KiB, read as it arrives): the
// server answers with frames of the same header, for as long as the
// connection lasts (the client sends nothing more): statusBitmap (index:
// the content's place in the request; length bytes of its bitmap, at
// most MaxBitmap), statusHave (index: the content's; 4 bytes: a piece it
// now holds), statusGone (index: the content's, which it holds no more;
// nothing follows), statusAlive (nothing follows; sent when nothing else
// was for watchAlive), or a refusal as above, which ends it.
const Protocol = "tensorfs-pieces/2"

// Request kinds.
const (
	reqFetch = 0
	reqWatch = 1
)

// Reply statuses.
const (
	statusOK        = 0 // the piece's bytes follow
	statusNotServed = 1 // ErrNotServed; a message follows
	statusBusy      = 2 // ErrBusy; a message follows
	statusBitmap    = 3 // a watched content's bitmap follows
	statusHave      = 4 // a piece index follows
	statusGone      = 5 // a watched content is held no more
	statusAlive     = 6 // nothing: the watch is alive
)

// Frame sizes and bounds.
const (
	replyHeaderSize = 13
	maxContentID    = 255  // longest content ID a request carries
	maxMessage      = 1024 // longest message a refusal carries
	// MaxBitmap is the longest bitmap a frame carries: 16384 pieces.
	MaxBitmap = 2048
	// MaxWatched is how many contents one watch names at most, and
	// maxWatchedID the longest content ID it names (a SHA-256 in hex).
	MaxWatched   = 1024
	maxWatchedID = 64
)

// errFrame is returned for a request or reply the protocol does not allow.
var errFrame = errors.New("malformed frame")

// request is one request as read: a fetch of Piece, taking any of Accept
// in its place, or a watch of Watch.
type request struct {
	Piece  Piece
	Accept []byte
	Watch  []string // non-nil for a watch
}

// appendContent appends a content ID of at most max bytes, length
// first, to b.
func appendContent(b []byte, id string, max int) ([]byte, error) {
	if len(id) == 0 || len(id) > max {
		return nil, fmt.Errorf("%w: content ID %.80q", errFrame, id)
	}
	return append(append(b, byte(len(id))), id...), nil
}

// appendFetch appends the request for piece p, taking any of accept in
// its place, to b.
func appendFetch(b []byte, p Piece, accept []byte) ([]byte, error) {
	if p.Index < 0 || uint64(p.Index) > 1<<32-1 || len(accept) > MaxBitmap {
		return nil, fmt.Errorf("%w: request for piece %d of %.80q accepting %d bytes", errFrame, p.Index, p.Content, len(accept))
	}
	b, err := appendContent(append(b, reqFetch), p.Content, maxContentID)
	if err != nil {
		return nil, err
	}
	b = binary.BigEndian.AppendUint32(b, uint32(p.Index))
	b = binary.BigEndian.AppendUint16(b, uint16(len(accept)))
	return append(b, accept...), nil
}

// appendWatch appends the request to watch contents to b.
func appendWatch(b []byte, contents []string) ([]byte, error) {
	if len(contents) == 0 || len(contents) > MaxWatched {
		return nil, fmt.Errorf("%w: a watch of %d contents", errFrame, len(contents))
	}
	b = binary.BigEndian.AppendUint16(append(b, reqWatch), uint16(len(contents)))
	for _, id := range contents {
		var err error
		if b, err = appendContent(b, id, maxWatchedID); err != nil {
			return nil, err
		}
	}
	return b, nil
}

// readRequest reads one request from r: io.EOF if r ends before it,
// errFrame (wrapped) if it is malformed.
func readRequest(r io.Reader) (request, error) {
	var kind [1]byte
	if _, err := io.ReadFull(r, kind[:]); err != nil {
		return request{}, err
	}
	switch kind[0] {
	case reqFetch:
		return readFetch(r)
	case reqWatch:
		return readWatch(r)
	}
	return request{}, fmt.Errorf("%w: unknown request kind %d", errFrame, kind[0])
}

// readFetch reads a fetch request after its kind.
func readFetch(r io.Reader) (request, error) {
	id, err := readContent(r, maxContentID)
	if err != nil {
		return request{}, err
	}
	var b [6]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return request{}, fmt.Errorf("%w: request cut short: %w", errFrame, err)
	}
	n := binary.BigEndian.Uint16(b[4:])
	if n > MaxBitmap {
		return request{}, fmt.Errorf("%w: an accept bitmap of %d bytes", errFrame, n)
	}
	req := request{Piece: Piece{Content: id, Index: int(binary.BigEndian.Uint32(b[:4]))}}
	if n > 0 {
		req.Accept = make([]byte, n)
		if _, err := io.ReadFull(r, req.Accept); err != nil {
			return request{}, fmt.Errorf("%w: request cut short: %w", errFrame, err)
		}
	}
	return req, nil
}

// readWatch reads a watch request after its kind.
func readWatch(r io.Reader) (request, error) {
	var b [2]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return request{}, fmt.Errorf("%w: request cut short: %w", errFrame, err)
	}
	n := int(binary.BigEndian.Uint16(b[:]))
	if n == 0 || n > MaxWatched {
		return request{}, fmt.Errorf("%w: a watch of %d contents", errFrame, n)
	}
	req := request{Watch: make([]string, 0, n)}
	for range n {
		id, err := readContent(r, maxWatchedID)
		if err != nil {
			return request{}, err
		}
		req.Watch = append(req.Watch, id)
	}
	return req, nil
}

// readContent reads a content ID of at most max bytes, length first.
func readContent(r io.Reader, max int) (string, error) {
	var n [1]byte
	if _, err := io.ReadFull(r, n[:]); err != nil {
		return "", fmt.Errorf("%w: request cut short: %w", errFrame, err)
	}
	if n[0] == 0 || int(n[0]) > max {
		return "", fmt.Errorf("%w: a content ID of %d bytes", errFrame, n[0])
	}
	b := make([]byte, n[0])
	if _, err := io.ReadFull(r, b); err != nil {
		return "", fmt.Errorf("%w: request cut short: %w", errFrame, err)
	}
	return string(b), nil
}

// replyHeader is a reply or watch frame's header.
type replyHeader struct {
	status byte
	index  int   // the piece sent, or the watched content
	length int64 // bytes that follow
}

// appendReplyHeader appends h to b.
func appendReplyHeader(b []byte, h replyHeader) []byte {
	b = append(b, h.status)
	b = binary.BigEndian.AppendUint32(b, uint32(h.index))
	return binary.BigEndian.AppendUint64(b, uint64(h.length))
}

// parseReplyHeader decodes a reply header: errFrame (wrapped) for an
// unknown status, or a length its status does not allow.
func parseReplyHeader(b [replyHeaderSize]byte) (replyHeader, error) {
	h := replyHeader{status: b[0], index: int(binary.BigEndian.Uint32(b[1:]))}
	n := binary.BigEndian.Uint64(b[5:])
	var max uint64
	switch h.status {
	case statusOK:
		max = 1 << 62
	case statusNotServed, statusBusy:
		max = maxMessage
	case statusBitmap:
		max = MaxBitmap
	case statusHave:
		max = 4
	case statusGone, statusAlive:
	default:
		return replyHeader{}, fmt.Errorf("%w: unknown status %d", errFrame, h.status)
	}
	if n > max || h.status == statusHave && n != 4 {
		return replyHeader{}, fmt.Errorf("%w: status %d with %d bytes", errFrame, h.status, n)
	}
	h.length = int64(n)
	return h, nil
}
