package transport

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// The piece protocol, spoken over one mutual-TLS connection (ALPN
// Protocol) that carries one fetch at a time. The client sends a request:
//
//	content length (1 byte), content ID, piece index (4 bytes, big-endian)
//
// and the server answers with a reply header:
//
//	status (1 byte), length (8 bytes, big-endian)
//
// followed by length bytes: the piece's (statusOK), or a message saying
// why it is not sent (the other statuses, at most maxMessage bytes). The
// connection then carries the next request.
const Protocol = "tensorfs-pieces/1"

// Reply statuses.
const (
	statusOK        = 0 // the piece's bytes follow
	statusNotServed = 1 // ErrNotServed; a message follows
	statusBusy      = 2 // ErrBusy; a message follows
)

// Frame sizes and bounds.
const (
	replyHeaderSize = 9
	maxContentID    = 255  // longest content ID a request carries
	maxMessage      = 1024 // longest message a refusal carries
)

// errFrame is returned for a request or reply the protocol does not allow.
var errFrame = errors.New("malformed frame")

// appendRequest appends the request for piece p to b.
func appendRequest(b []byte, p Piece) ([]byte, error) {
	if len(p.Content) == 0 || len(p.Content) > maxContentID || p.Index < 0 || uint64(p.Index) > 1<<32-1 {
		return nil, fmt.Errorf("%w: request for piece %d of %.80q", errFrame, p.Index, p.Content)
	}
	b = append(b, byte(len(p.Content)))
	b = append(b, p.Content...)
	return binary.BigEndian.AppendUint32(b, uint32(p.Index)), nil
}

// readRequest reads one request from r: io.EOF if r ends before it,
// errFrame (wrapped) if it is malformed.
func readRequest(r io.Reader) (Piece, error) {
	var n [1]byte
	if _, err := io.ReadFull(r, n[:]); err != nil {
		return Piece{}, err
	}
	if n[0] == 0 {
		return Piece{}, fmt.Errorf("%w: empty content ID", errFrame)
	}
	b := make([]byte, int(n[0])+4)
	if _, err := io.ReadFull(r, b); err != nil {
		return Piece{}, fmt.Errorf("%w: request cut short: %w", errFrame, err)
	}
	return Piece{Content: string(b[:n[0]]), Index: int(binary.BigEndian.Uint32(b[n[0]:]))}, nil
}

// appendReplyHeader appends a reply header of status and length to b.
func appendReplyHeader(b []byte, status byte, length int64) []byte {
	b = append(b, status)
	return binary.BigEndian.AppendUint64(b, uint64(length))
}

// parseReplyHeader decodes a reply header: errFrame (wrapped) for an
// unknown status, or a refusal's message longer than maxMessage.
func parseReplyHeader(h [replyHeaderSize]byte) (status byte, length int64, err error) {
	status, n := h[0], binary.BigEndian.Uint64(h[1:])
	switch {
	case status > statusBusy:
		return 0, 0, fmt.Errorf("%w: unknown status %d", errFrame, status)
	case status != statusOK && n > maxMessage:
		return 0, 0, fmt.Errorf("%w: a refusal of %d bytes", errFrame, n)
	case n > 1<<62:
		return 0, 0, fmt.Errorf("%w: a piece of %d bytes", errFrame, n)
	}
	return status, int64(n), nil
}
