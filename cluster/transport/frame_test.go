package transport

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
)

// TestFrames checks the requests and reply headers the protocol allows
// round-trip, and those it does not are refused with errFrame.
func TestFrames(t *testing.T) {
	for _, p := range []Piece{{Content: "c", Index: 0}, {Content: strings.Repeat("a", maxContentID), Index: 1<<32 - 1}} {
		b, err := appendRequest(nil, p)
		if err != nil {
			t.Fatalf("%+v: %v", p, err)
		}
		got, err := readRequest(bytes.NewReader(b))
		if err != nil || got != p {
			t.Fatalf("%+v: read back %+v, %v", p, got, err)
		}
	}
	for _, p := range []Piece{{Content: ""}, {Content: strings.Repeat("a", maxContentID+1)}, {Content: "c", Index: -1}, {Content: "c", Index: 1 << 32}} {
		if _, err := appendRequest(nil, p); !errors.Is(err, errFrame) {
			t.Errorf("request for %.20q %d: %v; want errFrame", p.Content, p.Index, err)
		}
	}
	for in, want := range map[string]error{"": io.EOF, "\x00": errFrame, "\x03ab": errFrame, "\x01a\x00\x00\x00": errFrame} {
		if _, err := readRequest(strings.NewReader(in)); !errors.Is(err, want) {
			t.Errorf("request %q: %v; want %v", in, err, want)
		}
	}
	for _, h := range []struct {
		status byte
		length int64
		ok     bool
	}{{statusOK, 8 << 20, true}, {statusNotServed, maxMessage, true}, {statusBusy, 0, true},
		{statusBusy, maxMessage + 1, false}, {statusBusy + 1, 0, false}, {statusOK, -1, false}} {
		var b [replyHeaderSize]byte
		copy(b[:], appendReplyHeader(nil, h.status, h.length))
		status, length, err := parseReplyHeader(b)
		if h.ok && (err != nil || status != h.status || length != h.length) || !h.ok && !errors.Is(err, errFrame) {
			t.Errorf("reply header %d %d: read back %d %d, %v", h.status, h.length, status, length, err)
		}
	}
}

// FuzzReadRequest: whatever the bytes, readRequest returns a request
// that encodes back to the bytes it read, or an error.
func FuzzReadRequest(f *testing.F) {
	f.Add([]byte("\x02c1\x00\x00\x00\x07"))
	f.Add([]byte("\x00"))
	f.Fuzz(func(t *testing.T, in []byte) {
		r := bytes.NewReader(in)
		p, err := readRequest(r)
		if err != nil {
			return
		}
		b, err := appendRequest(nil, p)
		if err != nil {
			t.Fatalf("read %+v, which does not encode: %v", p, err)
		}
		if read := in[:len(in)-r.Len()]; !bytes.Equal(b, read) {
			t.Fatalf("read %q as %+v, which encodes as %q", read, p, b)
		}
	})
}

// FuzzParseReplyHeader: whatever the bytes, parseReplyHeader returns a
// known status and a length within bounds that encode back to them, or
// an error.
func FuzzParseReplyHeader(f *testing.F) {
	f.Add(appendReplyHeader(nil, statusOK, 8<<20))
	f.Add(appendReplyHeader(nil, statusBusy, 40))
	f.Fuzz(func(t *testing.T, in []byte) {
		var h [replyHeaderSize]byte
		copy(h[:], in)
		status, length, err := parseReplyHeader(h)
		if err != nil {
			return
		}
		if status > statusBusy || length < 0 || status != statusOK && length > maxMessage {
			t.Fatalf("%x: status %d, length %d", h, status, length)
		}
		if b := appendReplyHeader(nil, status, length); !bytes.Equal(b, h[:]) {
			t.Fatalf("%x parsed as %d %d, which encode as %x", h, status, length, b)
		}
	})
}
