package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"
)

// heldSource serves content "c1" from memory, the pieces in bits only;
// asked with pieces accepted in place, it sends the lowest of them (or
// piece send, if set). It can be watched.
type heldSource struct {
	data      []byte
	pieceSize int64
	send      int // the piece it sends for any request, if > 0

	mu       sync.Mutex
	bits     []byte
	watchers map[chan struct{}]bool
}

func newHeldSource(data []byte, pieceSize int64, bits []byte) *heldSource {
	return &heldSource{data: data, pieceSize: pieceSize, bits: bits, watchers: map[chan struct{}]bool{}}
}

func (s *heldSource) Piece(p Piece, accept []byte) (int, []byte, error) {
	i := p.Index
	for j := range 8 * len(accept) {
		if accept[j/8]&(1<<(j%8)) != 0 {
			i = j
			break
		}
	}
	if s.send > 0 {
		i = s.send
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if p.Content != "c1" || i/8 >= len(s.bits) || s.bits[i/8]&(1<<(i%8)) == 0 {
		return 0, nil, fmt.Errorf("piece %d: %w", i, ErrNotServed)
	}
	off := int64(i) * s.pieceSize
	return i, s.data[off:min(off+s.pieceSize, int64(len(s.data)))], nil
}

// set sets (or clears) piece i and tells the watchers.
func (s *heldSource) set(i int, on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.bits = bytes.Clone(s.bits)
	if on {
		s.bits[i/8] |= 1 << (i % 8)
	} else {
		s.bits[i/8] &^= 1 << (i % 8)
	}
	for ch := range s.watchers {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

func (s *heldSource) Holding(contents []string) (Watcher, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	w := &heldWatcher{s: s, contents: contents, ch: make(chan struct{}, 1)}
	s.watchers[w.ch] = true
	return w, nil
}

type heldWatcher struct {
	s        *heldSource
	contents []string
	ch       chan struct{}
}

func (w *heldWatcher) Bits(i int) []byte {
	w.s.mu.Lock()
	defer w.s.mu.Unlock()
	if w.contents[i] != "c1" {
		return nil
	}
	return bytes.Clone(w.s.bits)
}

func (w *heldWatcher) Changed() <-chan struct{} { return w.ch }

func (w *heldWatcher) Stop() {
	w.s.mu.Lock()
	defer w.s.mu.Unlock()
	delete(w.s.watchers, w.ch)
}

// watching is a Watch in flight and what it received.
type watching struct {
	updates chan Update
	done    chan error
	cancel  context.CancelFunc
}

func startWatch(t *testing.T, c *Stream, peer Peer, contents ...string) *watching {
	ctx, cancel := context.WithCancel(context.Background())
	w := &watching{updates: make(chan Update, 100), done: make(chan error, 1), cancel: cancel}
	go func() { w.done <- c.Watch(ctx, peer, contents, func(u Update) { w.updates <- u }) }()
	t.Cleanup(cancel)
	return w
}

// next returns the next update, failing the test after 10 s.
func (w *watching) next(t *testing.T) Update {
	t.Helper()
	select {
	case u := <-w.updates:
		return u
	case err := <-w.done:
		t.Fatalf("the watch ended: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("no update in 10 s")
	}
	return Update{}
}

// TestStreamWatch: a watch is told the bitmap of each watched content
// the peer holds (none of one it does not), then each piece it gets, a
// bitmap again when it loses one; it ends when the watcher cancels it;
// a peer holds at most maxPeerWatches at once (ErrBusy past them).
func TestStreamWatch(t *testing.T) {
	creds, _ := certs(t, "node1", "node2")
	src := newHeldSource(randomBytes(t, 4<<10), 1<<10, []byte{0b0001})
	_, addr := serve(t, creds["node1"], src)
	c := client(t, creds["node2"])
	peer := Peer{Name: "node1", Addr: addr}
	w := startWatch(t, c, peer, "c2", "c1")
	if u := w.next(t); u.Content != 1 || !bytes.Equal(u.Bits, []byte{0b0001}) {
		t.Fatalf("first update %+v: want c1's bitmap", u)
	}
	src.set(2, true)
	if u := w.next(t); u.Content != 1 || u.Bits != nil || u.Piece != 2 || u.Gone {
		t.Fatalf("after piece 2: %+v; want it told", u)
	}
	src.set(0, false)
	if u := w.next(t); u.Content != 1 || !bytes.Equal(u.Bits, []byte{0b0100}) {
		t.Fatalf("after piece 0 went: %+v; want the bitmap again", u)
	}
	more := []*watching{w}
	for range maxPeerWatches - 1 {
		more = append(more, startWatch(t, c, peer, "c1"))
		more[len(more)-1].next(t)
	}
	// A hostile member dials a watch past them (a node of its own waits
	// for one of them to end).
	if err := client(t, creds["node2"]).Watch(context.Background(), peer, []string{"c1"}, func(Update) {}); !errors.Is(err, ErrBusy) {
		t.Fatalf("watch %d of one peer: %v; want ErrBusy", maxPeerWatches+1, err)
	}
	w.cancel()
	if err := <-w.done; err != nil {
		t.Fatalf("a cancelled watch returned %v", err)
	}
	// The server sees the watch end, and serves another of the peer's.
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithCancel(context.Background())
		err := c.Watch(ctx, peer, []string{"c1"}, func(Update) { cancel() })
		cancel()
		if err == nil {
			break
		}
		if !errors.Is(err, ErrBusy) || time.Now().After(deadline) {
			t.Fatalf("a watch once one ended: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestStreamAccept: a peer asked for a piece with others accepted in its
// place may send one of those, which lands where Dest.For says; one that
// sends a piece not accepted fails the fetch with ErrUnreachable and
// writes nothing.
func TestStreamAccept(t *testing.T) {
	creds, _ := certs(t, "node1", "node2")
	data := randomBytes(t, 4<<10)
	src := newHeldSource(data, 1<<10, []byte{0b1111})
	_, addr := serve(t, creds["node1"], src)
	c := client(t, creds["node2"])
	peer := Peer{Name: "node1", Addr: addr}
	file := make(memFile, len(data))
	var placed []int
	dst := Dest{File: file, Len: 1 << 10, Accept: []byte{0b0110}, For: func(i int) (Dest, error) {
		placed = append(placed, i)
		return Dest{File: file, Off: int64(i) << 10, Len: 1 << 10}, nil
	}}
	if n, err := c.Fetch(context.Background(), peer, Piece{Content: "c1", Index: 0}, dst); err != nil || n != 1<<10 {
		t.Fatalf("fetch: %d bytes, %v", n, err)
	}
	if len(placed) != 1 || placed[0] != 1 || !bytes.Equal(file[1<<10:2<<10], data[1<<10:2<<10]) || !bytes.Equal(file[:1<<10], make([]byte, 1<<10)) {
		t.Fatalf("placed %v: want piece 1 at its offset, nothing at piece 0's", placed)
	}
	src.send = 3
	clear(file)
	if n, err := c.Fetch(context.Background(), peer, Piece{Content: "c1", Index: 0}, dst); !errors.Is(err, ErrUnreachable) || n != 0 || !bytes.Equal(file, make(memFile, len(file))) {
		t.Fatalf("a piece not accepted: %d bytes, %v; want ErrUnreachable, nothing written", n, err)
	}
}
