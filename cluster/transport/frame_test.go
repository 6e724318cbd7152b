package transport

import (
	"bytes"
	"errors"
	"io"
	"reflect"
	"strings"
	"testing"
)

// TestFrames checks the requests and reply headers the protocol allows
// round-trip, and those it does not are refused with errFrame.
func TestFrames(t *testing.T) {
	long := strings.Repeat("a", maxContentID)
	for _, req := range []request{
		{Piece: Piece{Content: "c", Index: 0}},
		{Piece: Piece{Content: long, Index: 1<<32 - 1}, Accept: make([]byte, MaxBitmap)},
		{Watch: []string{"c", long[:maxWatchedID]}},
	} {
		b, err := appendFetch(nil, req.Piece, req.Accept)
		if req.Watch != nil {
			b, err = appendWatch(nil, req.Watch)
		}
		if err != nil {
			t.Fatalf("%+v: %v", req, err)
		}
		got, err := readRequest(bytes.NewReader(b))
		if err != nil || !reflect.DeepEqual(got, req) {
			t.Fatalf("%+v: read back %+v, %v", req, got, err)
		}
	}
	for _, p := range []Piece{{Content: ""}, {Content: strings.Repeat("a", maxContentID+1)}, {Content: "c", Index: -1}, {Content: "c", Index: 1 << 32}} {
		if _, err := appendFetch(nil, p, nil); !errors.Is(err, errFrame) {
			t.Errorf("request for %.20q %d: %v; want errFrame", p.Content, p.Index, err)
		}
	}
	if _, err := appendFetch(nil, Piece{Content: "c"}, make([]byte, MaxBitmap+1)); !errors.Is(err, errFrame) {
		t.Errorf("a request accepting %d bytes: %v; want errFrame", MaxBitmap+1, err)
	}
	for _, ids := range [][]string{nil, make([]string, MaxWatched+1), {""}, {long[:maxWatchedID+1]}} {
		if _, err := appendWatch(nil, ids); !errors.Is(err, errFrame) {
			t.Errorf("a watch of %d contents: %v; want errFrame", len(ids), err)
		}
	}
	for in, want := range map[string]error{"": io.EOF, "\x00\x00": errFrame, "\x00\x03ab": errFrame, "\x00\x01a\x00\x00\x00": errFrame,
		"\x00\x01a\x00\x00\x00\x00\x08\x01": errFrame, "\x01\x00\x00": errFrame, "\x01\x04\x01": errFrame, "\x02": errFrame} {
		if _, err := readRequest(strings.NewReader(in)); !errors.Is(err, want) {
			t.Errorf("request %q: %v; want %v", in, err, want)
		}
	}
	for _, h := range []struct {
		replyHeader
		ok bool
	}{{replyHeader{statusOK, 7, 8 << 20}, true}, {replyHeader{statusNotServed, 0, maxMessage}, true}, {replyHeader{statusBusy, 0, 0}, true},
		{replyHeader{statusBitmap, 3, MaxBitmap}, true}, {replyHeader{statusHave, 1, 4}, true}, {replyHeader{statusGone, 2, 0}, true}, {replyHeader{statusAlive, 0, 0}, true},
		{replyHeader{statusBusy, 0, maxMessage + 1}, false}, {replyHeader{statusAlive + 1, 0, 0}, false}, {replyHeader{statusOK, 0, -1}, false},
		{replyHeader{statusBitmap, 0, MaxBitmap + 1}, false}, {replyHeader{statusHave, 0, 3}, false}, {replyHeader{statusGone, 0, 1}, false}} {
		var b [replyHeaderSize]byte
		copy(b[:], appendReplyHeader(nil, h.replyHeader))
		got, err := parseReplyHeader(b)
		if h.ok && (err != nil || got != h.replyHeader) || !h.ok && !errors.Is(err, errFrame) {
			t.Errorf("reply header %+v: read back %+v, %v", h.replyHeader, got, err)
		}
	}
}

// FuzzReadRequest: whatever the bytes, readRequest returns a request
// that encodes back to the bytes it read, or an error.
func FuzzReadRequest(f *testing.F) {
	f.Add([]byte("\x00\x02c1\x00\x00\x00\x07\x00\x00"))
	f.Add([]byte("\x00\x02c1\x00\x00\x00\x07\x00\x01\x05"))
	f.Add([]byte("\x01\x00\x02\x01a\x02bc"))
	f.Add([]byte("\x00"))
	f.Fuzz(func(t *testing.T, in []byte) {
		r := bytes.NewReader(in)
		req, err := readRequest(r)
		if err != nil {
			return
		}
		b, err := appendFetch(nil, req.Piece, req.Accept)
		if req.Watch != nil {
			b, err = appendWatch(nil, req.Watch)
		}
		if err != nil {
			t.Fatalf("read %+v, which does not encode: %v", req, err)
		}
		if read := in[:len(in)-r.Len()]; !bytes.Equal(b, read) {
			t.Fatalf("read %q as %+v, which encodes as %q", read, req, b)
		}
	})
}

// FuzzParseReplyHeader: whatever the bytes, parseReplyHeader returns a
// known status and a length within its bounds that encode back to them,
// or an error.
func FuzzParseReplyHeader(f *testing.F) {
	f.Add(appendReplyHeader(nil, replyHeader{statusOK, 3, 8 << 20}))
	f.Add(appendReplyHeader(nil, replyHeader{statusBusy, 0, 40}))
	f.Add(appendReplyHeader(nil, replyHeader{statusHave, 2, 4}))
	f.Fuzz(func(t *testing.T, in []byte) {
		var b [replyHeaderSize]byte
		copy(b[:], in)
		h, err := parseReplyHeader(b)
		if err != nil {
			return
		}
		bounds := map[byte]int64{statusOK: 1 << 62, statusNotServed: maxMessage, statusBusy: maxMessage, statusBitmap: MaxBitmap, statusHave: 4, statusGone: 0, statusAlive: 0}
		if max, ok := bounds[h.status]; !ok || h.length < 0 || h.length > max {
			t.Fatalf("%x: %+v", b, h)
		}
		if e := appendReplyHeader(nil, h); !bytes.Equal(e, b[:]) {
			t.Fatalf("%x parsed as %+v, which encodes as %x", b, h, e)
		}
	})
}

// FuzzReadUpdate: whatever a watched peer sends, readUpdate returns an
// update of a content watched (or an error), reading no more than the
// frame's length.
func FuzzReadUpdate(f *testing.F) {
	f.Add(appendUpdates(nil, []Update{{Content: 1, Bits: []byte{3}}}))
	f.Add(appendUpdates(nil, []Update{{Content: 0, Piece: 9}}))
	f.Add(appendUpdates(nil, []Update{{Content: 2, Gone: true}}))
	f.Fuzz(func(t *testing.T, in []byte) {
		const watched = 3
		r := bytes.NewReader(in)
		h, err := readReplyHeader(r)
		if err != nil {
			return
		}
		before := r.Len()
		u, err := readUpdate(r, h, watched)
		if int64(before-r.Len()) > h.length {
			t.Fatalf("%+v: read %d bytes", h, before-r.Len())
		}
		if err != nil || h.status == statusAlive {
			return
		}
		if u.Content < 0 || u.Content >= watched || len(u.Bits) > MaxBitmap {
			t.Fatalf("%x: update %+v", in, u)
		}
		if b := appendUpdates(nil, []Update{u}); !bytes.Equal(b, in[:len(in)-r.Len()]) {
			t.Fatalf("%x read as %+v, which encodes as %x", in, u, b)
		}
	})
}
