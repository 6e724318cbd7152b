package transport

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
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

func (s *memSource) Piece(p Piece) (io.ReaderAt, int64, int64, error) {
	off := int64(p.Index) * s.pieceSize
	if p.Content != s.content || p.Index < 0 || off >= int64(len(s.data)) {
		return nil, 0, 0, fmt.Errorf("piece %d of %s: %w", p.Index, p.Content, ErrNotServed)
	}
	return bytes.NewReader(s.data), off, min(s.pieceSize, int64(len(s.data))-off), nil
}

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
func serve(t testing.TB, creds *Credentials, src Source) (*GRPC, string) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := NewGRPC(creds, testLog(t))
	if err := g.Serve(l, src); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Close() })
	return g, l.Addr().String()
}

func randomBytes(t testing.TB, n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestGRPCFetch(t *testing.T) {
	creds, _ := certs(t, "node1", "node2")
	src := &memSource{content: "c1", data: randomBytes(t, 5<<20+123), pieceSize: 2 << 20}
	_, addr := serve(t, creds["node1"], src)
	client := NewGRPC(creds["node2"], testLog(t))
	defer client.Close()
	peer := Peer{Name: "node1", Addr: addr}
	ctx := context.Background()
	for i := 0; i < 3; i++ {
		var buf bytes.Buffer
		n, err := client.Fetch(ctx, peer, Piece{Content: "c1", Index: i}, &buf)
		if err != nil {
			t.Fatalf("piece %d: %v", i, err)
		}
		off := int64(i) * src.pieceSize
		want := src.data[off:min(off+src.pieceSize, int64(len(src.data)))]
		if n != int64(len(want)) || !bytes.Equal(buf.Bytes(), want) {
			t.Fatalf("piece %d: got %d bytes, want %d, equal %v", i, n, len(want), bytes.Equal(buf.Bytes(), want))
		}
	}
	for _, p := range []Piece{{Content: "c1", Index: 3}, {Content: "c2", Index: 0}} {
		n, err := client.Fetch(ctx, peer, p, io.Discard)
		if !errors.Is(err, ErrNotServed) || n != 0 {
			t.Fatalf("%+v: got %d bytes, err %v; want ErrNotServed", p, n, err)
		}
	}
}

// TestGRPCRefusesOutsiders checks mutual TLS: a client without a
// certificate of the cluster cannot fetch, a server without one cannot
// offer, and a member cannot pass for another node.
func TestGRPCRefusesOutsiders(t *testing.T) {
	creds, foreign := certs(t, "node1", "node2")
	src := &memSource{content: "c1", data: randomBytes(t, 1000), pieceSize: 1 << 20}
	_, addr := serve(t, creds["node1"], src)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	piece := Piece{Content: "c1", Index: 0}

	intruder := NewGRPC(foreign, testLog(t))
	defer intruder.Close()
	if n, err := intruder.Fetch(ctx, Peer{Name: "node1", Addr: addr}, piece, io.Discard); !errors.Is(err, ErrUnreachable) || n != 0 {
		t.Fatalf("fetch with a foreign certificate: %d bytes, err %v; want ErrUnreachable", n, err)
	}

	_, fakeAddr := serve(t, foreign, src)
	member := NewGRPC(creds["node2"], testLog(t))
	defer member.Close()
	if n, err := member.Fetch(ctx, Peer{Name: "intruder", Addr: fakeAddr}, piece, io.Discard); !errors.Is(err, ErrUnreachable) || n != 0 {
		t.Fatalf("fetch from a server with a foreign certificate: %d bytes, err %v; want ErrUnreachable", n, err)
	}

	// node1's server, reached as if it were node2: its certificate does not say so.
	if n, err := member.Fetch(ctx, Peer{Name: "node2", Addr: addr}, piece, io.Discard); !errors.Is(err, ErrUnreachable) || n != 0 {
		t.Fatalf("fetch from node1 posing as node2: %d bytes, err %v; want ErrUnreachable", n, err)
	}
	// The same client still reaches node1 under its own name.
	if _, err := member.Fetch(ctx, Peer{Name: "node1", Addr: addr}, piece, io.Discard); err != nil {
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

// BenchmarkGRPCLoopback measures one stream of 8 MiB pieces over loopback
// with TLS: the transport's ceiling on this machine.
func BenchmarkGRPCLoopback(b *testing.B) {
	creds, _ := certs(b, "node1", "node2")
	const pieceSize = 8 << 20
	src := &memSource{content: "c1", data: randomBytes(b, pieceSize), pieceSize: pieceSize}
	_, addr := serve(b, creds["node1"], src)
	client := NewGRPC(creds["node2"], slog.New(slog.DiscardHandler))
	defer client.Close()
	peer := Peer{Name: "node1", Addr: addr}
	b.SetBytes(pieceSize)
	b.ResetTimer()
	for b.Loop() {
		if _, err := client.Fetch(context.Background(), peer, Piece{Content: "c1"}, io.Discard); err != nil {
			b.Fatal(err)
		}
	}
}
