package transport

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"tensorfs/internal/testcerts"
)

// memSource serves the pieces of one content held in memory.
type memSource struct {
	content   string
	data      []byte
	pieceSize int64
}

func (s *memSource) Piece(p Piece, accept []byte) (int, []byte, error) {
	off := int64(p.Index) * s.pieceSize
	if p.Content != s.content || p.Index < 0 || off >= int64(len(s.data)) {
		return 0, nil, fmt.Errorf("piece %d of %s: %w", p.Index, p.Content, ErrNotServed)
	}
	return p.Index, s.data[off:min(off+s.pieceSize, int64(len(s.data)))], nil
}

// Holding refuses: a memSource is not watched.
func (s *memSource) Holding(contents []string) (Watcher, error) { return nil, ErrBusy }

// testLog logs to the test.
func testLog(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(string(bytes.TrimRight(b, "\n")))
	return len(b), nil
}

// certs issues node certificates of a cluster CA, and one of a foreign CA.
func certs(t testing.TB, names ...string) (map[string]*Credentials, *Credentials) {
	dir := t.TempDir()
	ca, err := testcerts.NewCA(dir, "cluster")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*Credentials{}
	for _, name := range names {
		f, err := ca.Issue(name, net.IPv4(127, 0, 0, 1))
		if err != nil {
			t.Fatal(err)
		}
		if out[name], err = LoadCredentials(f.CA, f.Cert, f.Key); err != nil {
			t.Fatal(err)
		}
	}
	other, err := testcerts.NewCA(dir, "other")
	if err != nil {
		t.Fatal(err)
	}
	f, err := other.Issue("intruder", net.IPv4(127, 0, 0, 1))
	if err != nil {
		t.Fatal(err)
	}
	foreign, err := LoadCredentials(f.CA, f.Cert, f.Key)
	if err != nil {
		t.Fatal(err)
	}
	return out, foreign
}

// serve starts a transport with creds serving src on a loopback port.
func serve(t testing.TB, creds *Credentials, src Source) (*Stream, string) {
	g := serveWith(t, Config{Credentials: creds}, src)
	return g, g.Addr()
}

// serveWith starts a transport made with cfg serving src, on a fresh
// loopback port unless cfg names a listener, logging to t; Close runs at
// cleanup.
func serveWith(t testing.TB, cfg Config, src Source) *Stream {
	t.Helper()
	if cfg.Listener == nil {
		cfg.Listen = "127.0.0.1:0"
	}
	cfg.Log = testLog(t)
	g, err := NewStream(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Start(src); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Close() })
	return g
}

// client returns a transport with creds that only fetches.
func client(t testing.TB, creds *Credentials) *Stream {
	g, err := NewStream(Config{Credentials: creds, Log: testLog(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Close() })
	return g
}

// memFile is a file in memory.
type memFile []byte

func (f memFile) WriteAt(b []byte, off int64) (int, error) {
	if off+int64(len(b)) > int64(len(f)) {
		return 0, io.ErrShortWrite
	}
	return copy(f[off:], b), nil
}

// discard is a Dest that takes up to n bytes and keeps none.
func discard(n int64) Dest { return Dest{File: make(memFile, n), Len: n} }

func randomBytes(t testing.TB, n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestStreamFetch(t *testing.T) {
	creds, _ := certs(t, "node1", "node2")
	src := &memSource{content: "c1", data: randomBytes(t, 5<<20+123), pieceSize: 2 << 20}
	_, addr := serve(t, creds["node1"], src)
	client := client(t, creds["node2"])
	peer := Peer{Name: "node1", Addr: addr}
	ctx := context.Background()
	file := make(memFile, len(src.data)+10)
	for i := 0; i < 3; i++ {
		off := int64(i) * src.pieceSize
		want := src.data[off:min(off+src.pieceSize, int64(len(src.data)))]
		n, err := client.Fetch(ctx, peer, Piece{Content: "c1", Index: i}, Dest{File: file, Off: off + 10, Len: int64(len(want))})
		if err != nil {
			t.Fatalf("piece %d: %v", i, err)
		}
		if got := file[off+10 : off+10+n]; n != int64(len(want)) || !bytes.Equal(got, want) {
			t.Fatalf("piece %d: got %d bytes, want %d, equal %v", i, n, len(want), bytes.Equal(got, want))
		}
	}
	if !bytes.Equal(file[10:], src.data) || !bytes.Equal(file[:10], make([]byte, 10)) {
		t.Fatal("the pieces were not placed at their offsets, and only there")
	}
	for _, p := range []Piece{{Content: "c1", Index: 3}, {Content: "c2", Index: 0}} {
		n, err := client.Fetch(ctx, peer, p, discard(src.pieceSize))
		if !errors.Is(err, ErrNotServed) || n != 0 {
			t.Fatalf("%+v: got %d bytes, err %v; want ErrNotServed", p, n, err)
		}
	}
	// A piece larger than its destination says: refused, nothing written
	// past the destination's end.
	short := make(memFile, 1<<20)
	if n, err := client.Fetch(ctx, peer, Piece{Content: "c1", Index: 0}, Dest{File: short, Len: 1000}); !errors.Is(err, ErrUnreachable) || n > 1000 {
		t.Fatalf("a piece past its destination: %d bytes, %v; want ErrUnreachable", n, err)
	}
	if !bytes.Equal(short[1000:], make([]byte, len(short)-1000)) {
		t.Fatal("bytes written past the destination")
	}
	// A destination that refuses its writes: ErrDest, with its error.
	if _, err := client.Fetch(ctx, peer, Piece{Content: "c1", Index: 0}, Dest{File: make(memFile, 10), Len: src.pieceSize}); !errors.Is(err, ErrDest) || !errors.Is(err, io.ErrShortWrite) {
		t.Fatalf("a failing destination: %v; want ErrDest wrapping its error", err)
	}
}

// stallSource serves a piece of 1 KiB once released, saying so (if
// reading is not nil) when it is asked for one.
type stallSource struct{ release, reading chan struct{} }

func (s stallSource) Piece(p Piece, accept []byte) (int, []byte, error) {
	select {
	case s.reading <- struct{}{}:
	default:
	}
	<-s.release
	return p.Index, make([]byte, 1<<10), nil
}

// Holding refuses: a stallSource is not watched.
func (s stallSource) Holding(contents []string) (Watcher, error) { return nil, ErrBusy }

// TestStreamIdle checks that a fetch from a peer that sends nothing fails
// with ErrUnreachable after the idle timeout.
func TestStreamIdle(t *testing.T) {
	creds, _ := certs(t, "node1", "node2")
	src := stallSource{release: make(chan struct{})}
	defer close(src.release)
	_, addr := serve(t, creds["node1"], src)
	g, err := NewStream(Config{Credentials: creds["node2"], Idle: 200 * time.Millisecond, Log: testLog(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	start := time.Now()
	if _, err := g.Fetch(context.Background(), Peer{Name: "node1", Addr: addr}, Piece{Content: "c1"}, discard(1<<10)); !errors.Is(err, ErrUnreachable) || !strings.Contains(err.Error(), "nothing received") {
		t.Fatalf("fetch from a stalled peer: %v; want ErrUnreachable", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the idle timeout took %v", d)
	}
}

// TestStreamConfig checks the configurations NewStream refuses.
func TestStreamConfig(t *testing.T) {
	creds, _ := certs(t, "node1")
	for _, cfg := range []Config{
		{Listen: "0.0.0.0:0", Credentials: creds["node1"]},
		{Listen: ":7070", Credentials: creds["node1"]},
		{Listen: "127.0.0.1:0"},
	} {
		if _, err := NewStream(cfg); err == nil {
			t.Errorf("NewStream accepted listen %q, credentials %v", cfg.Listen, cfg.Credentials != nil)
		}
	}
	g, err := NewStream(Config{Listen: "0.0.0.0:0", Advertise: "node1.example:7070", Credentials: creds["node1"]})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if err := g.Start(&memSource{}); err != nil || g.Addr() != "node1.example:7070" {
		t.Fatalf("start: %v, addr %q", err, g.Addr())
	}
}

// TestStreamRefusesOutsiders checks mutual TLS: a client without a
// certificate of the cluster cannot fetch, a server without one cannot
// offer, and a member cannot pass for another node.
func TestStreamRefusesOutsiders(t *testing.T) {
	creds, foreign := certs(t, "node1", "node2")
	src := &memSource{content: "c1", data: randomBytes(t, 1000), pieceSize: 1 << 20}
	_, addr := serve(t, creds["node1"], src)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	piece := Piece{Content: "c1", Index: 0}

	intruder := client(t, foreign)
	if n, err := intruder.Fetch(ctx, Peer{Name: "node1", Addr: addr}, piece, discard(1000)); !errors.Is(err, ErrUnreachable) || n != 0 {
		t.Fatalf("fetch with a foreign certificate: %d bytes, err %v; want ErrUnreachable", n, err)
	}

	_, fakeAddr := serve(t, foreign, src)
	member := client(t, creds["node2"])
	if n, err := member.Fetch(ctx, Peer{Name: "intruder", Addr: fakeAddr}, piece, discard(1000)); !errors.Is(err, ErrUnreachable) || n != 0 {
		t.Fatalf("fetch from a server with a foreign certificate: %d bytes, err %v; want ErrUnreachable", n, err)
	}

	// node1's server, reached as if it were node2: its certificate does not say so.
	if n, err := member.Fetch(ctx, Peer{Name: "node2", Addr: addr}, piece, discard(1000)); !errors.Is(err, ErrUnreachable) || n != 0 {
		t.Fatalf("fetch from node1 posing as node2: %d bytes, err %v; want ErrUnreachable", n, err)
	}
	// The same client still reaches node1 under its own name.
	if _, err := member.Fetch(ctx, Peer{Name: "node1", Addr: addr}, piece, discard(1000)); err != nil {
		t.Fatal(err)
	}
}

func TestCheckName(t *testing.T) {
	creds, _ := certs(t, "node1")
	if err := creds["node1"].CheckName("node1"); err != nil {
		t.Fatal(err)
	}
	if err := creds["node1"].CheckName("node2"); err == nil {
		t.Fatal("node1's certificate accepted for node2")
	}
}

// BenchmarkStreamLoopback measures one stream of 8 MiB pieces over loopback
// with TLS: the transport's ceiling on this machine, and the CPU both
// ends spend per GiB (cpu-s/GiB: the process's user and system time,
// which a busy machine's other work does not inflate as it does the
// time per piece).
func BenchmarkStreamLoopback(b *testing.B) {
	creds, _ := certs(b, "node1", "node2")
	const pieceSize = 8 << 20
	src := &memSource{content: "c1", data: randomBytes(b, pieceSize), pieceSize: pieceSize}
	_, addr := serve(b, creds["node1"], src)
	client, err := NewStream(Config{Credentials: creds["node2"]})
	if err != nil {
		b.Fatal(err)
	}
	defer client.Close()
	peer := Peer{Name: "node1", Addr: addr}
	dst := discard(pieceSize)
	b.SetBytes(pieceSize)
	cpu0 := cpuTime(b)
	for b.Loop() {
		if _, err := client.Fetch(context.Background(), peer, Piece{Content: "c1"}, dst); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric((cpuTime(b)-cpu0).Seconds()/(float64(b.N)*pieceSize/(1<<30)), "cpu-s/GiB")
}

// cpuTime returns the CPU time (user and system) the process has spent.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestStreamBusy checks the bound on pieces sent at once: with one piece
// stalled in flight, a server of one slot refuses another with ErrBusy,
// and serves again once the first is sent.
func TestStreamBusy(t *testing.T) {
	creds, _ := certs(t, "node1", "node2")
	src := stallSource{release: make(chan struct{}), reading: make(chan struct{}, 1)}
	g, err := NewStream(Config{Listen: "127.0.0.1:0", Credentials: creds["node1"], MaxUploads: 1, Log: testLog(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if err := g.Start(src); err != nil {
		t.Fatal(err)
	}
	c := client(t, creds["node2"])
	peer, piece := Peer{Name: "node1", Addr: g.Addr()}, Piece{Content: "c1"}
	first := make(chan error, 1)
	go func() {
		_, err := c.Fetch(context.Background(), peer, piece, discard(1<<10))
		first <- err
	}()
	<-src.reading // the first holds the slot
	if _, err := c.Fetch(context.Background(), peer, piece, discard(1<<10)); !errors.Is(err, ErrBusy) {
		t.Fatalf("a second fetch while one is in flight: %v; want ErrBusy", err)
	}
	close(src.release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if _, err := c.Fetch(context.Background(), peer, piece, discard(1<<10)); err != nil {
		t.Fatalf("a fetch once the slot is free: %v", err)
	}
}

// countingListener counts the connections it accepts.
type countingListener struct {
	net.Listener
	accepted chan struct{}
}

func (l countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.accepted <- struct{}{}
	}
	return c, err
}

// TestStreamKeepsConnections checks that fetches from a peer share one
// connection, and that a kept connection the peer closed meanwhile (a
// daemon that restarted) is replaced, not an error.
func TestStreamKeepsConnections(t *testing.T) {
	creds, _ := certs(t, "node1", "node2")
	src := &memSource{content: "c1", data: randomBytes(t, 3<<20), pieceSize: 1 << 20}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	first := countingListener{l, make(chan struct{}, 10)}
	server, err := NewStream(Config{Listener: first, Credentials: creds["node1"], Log: testLog(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := server.Start(src); err != nil {
		t.Fatal(err)
	}
	c := client(t, creds["node2"])
	peer := Peer{Name: "node1", Addr: server.Addr()}
	fetch := func(i int) {
		t.Helper()
		dst := make(memFile, src.pieceSize)
		if n, err := c.Fetch(context.Background(), peer, Piece{Content: "c1", Index: i}, Dest{File: dst, Len: src.pieceSize}); err != nil || !bytes.Equal(dst[:n], src.data[int64(i)*src.pieceSize:][:src.pieceSize]) {
			t.Fatalf("piece %d: %d bytes, %v", i, n, err)
		}
	}
	for i := range 3 {
		fetch(i)
	}
	if n := len(first.accepted); n != 1 {
		t.Fatalf("3 fetches one after another took %d connections; want 1", n)
	}
	server.Close()
	l2, err := net.Listen("tcp", peer.Addr)
	if err != nil {
		t.Fatal(err)
	}
	second := countingListener{l2, make(chan struct{}, 10)}
	restarted, err := NewStream(Config{Listener: second, Credentials: creds["node1"], Log: testLog(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer restarted.Close()
	if err := restarted.Start(src); err != nil {
		t.Fatal(err)
	}
	fetch(1)
	if n := len(second.accepted); n != 1 {
		t.Fatalf("the restarted server accepted %d connections; want 1", n)
	}
}

// TestStreamRefusesOtherProtocols checks that the server refuses a
// member's connection that does not speak the piece protocol (a gRPC
// peer of an earlier version: ALPN h2), ends one that sends a malformed
// request, and serves the next.
func TestStreamRefusesOtherProtocols(t *testing.T) {
	creds, _ := certs(t, "node1", "node2")
	src := &memSource{content: "c1", data: randomBytes(t, 1000), pieceSize: 1 << 20}
	_, addr := serve(t, creds["node1"], src)
	dial := func(proto string) (*tls.Conn, error) {
		cfg := creds["node2"].ClientConfig("node1")
		cfg.NextProtos = []string{proto}
		return tls.Dial("tcp", addr, cfg)
	}
	if c, err := dial("h2"); err == nil {
		err = c.Handshake()
		c.Close()
		if err == nil {
			t.Fatal("a connection for h2 was accepted")
		}
	}
	c, err := dial(Protocol)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte{0, 0, 0, 0, 0, 0}); err != nil {
		t.Fatal(err)
	}
	if n, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatalf("a malformed request was answered (%d bytes)", n)
	}
	if _, err := client(t, creds["node2"]).Fetch(context.Background(), Peer{Name: "node1", Addr: addr}, Piece{Content: "c1"}, discard(1000)); err != nil {
		t.Fatal(err)
	}
}

// busySource is starting: it cannot tell yet whether it serves a piece.
type busySource struct{}

func (busySource) Piece(p Piece, accept []byte) (int, []byte, error) {
	return 0, nil, fmt.Errorf("piece %d of %s: %w (starting)", p.Index, p.Content, ErrBusy)
}

func (busySource) Holding(contents []string) (Watcher, error) { return nil, ErrBusy }

// TestStreamSourceBusy checks that a source's ErrBusy reaches the peer
// as ErrBusy (ask again later), not as ErrNotServed.
func TestStreamSourceBusy(t *testing.T) {
	creds, _ := certs(t, "node1", "node2")
	_, addr := serve(t, creds["node1"], busySource{})
	_, err := client(t, creds["node2"]).Fetch(context.Background(), Peer{Name: "node1", Addr: addr}, Piece{Content: "c1"}, discard(1000))
	if !errors.Is(err, ErrBusy) || errors.Is(err, ErrNotServed) {
		t.Fatalf("a busy source: %v; want ErrBusy", err)
	}
}
