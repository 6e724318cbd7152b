package transport

import (
	"context"
	"crypto/tls"
	"errors"
	"testing"
	"time"
)

// TestAttackTrickledPiece: a fetch failed only when nothing came for the
// idle timeout, for each read: a member with a hostile daemon (or one
// claiming, by its holder key, every piece of every content) answered a
// fetch with a piece's header and then a byte every so often, just
// inside the timeout. The piece stayed in flight, so no other holder was
// asked for it: the pull never completed (8 MiB at a byte per 9 s: two
// years), and the opens and loads waiting for it with it.
func TestAttackTrickledPiece(t *testing.T) {
	creds, _ := certs(t, "node1", "node2")
	cfg := creds["node1"].ServerConfig()
	cfg.NextProtos = []string{Protocol}
	l, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		if _, err := readRequest(c); err != nil {
			return
		}
		if _, err := c.Write(appendReplyHeader(nil, replyHeader{status: statusOK, length: 1 << 20})); err != nil {
			return
		}
		for range 1 << 20 {
			time.Sleep(50 * time.Millisecond)
			if _, err := c.Write([]byte{0}); err != nil {
				return
			}
		}
	}()
	g, err := NewStream(Config{Credentials: creds["node2"], Idle: 300 * time.Millisecond, Log: testLog(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	n, err := g.Fetch(ctx, Peer{Name: "node1", Addr: l.Addr().String()}, Piece{Content: "c1"}, discard(1<<20))
	if !errors.Is(err, ErrUnreachable) || ctx.Err() != nil {
		t.Fatalf("a piece trickled a byte per 50 ms (idle timeout 300 ms): %d bytes in %v, %v; want ErrUnreachable", n, time.Since(start), err)
	}
	t.Logf("the trickled fetch failed after %d bytes, %v: %v", n, time.Since(start), err)
}

// TestAttackUploadSlotsOfOnePeer: a server sends MaxUploads pieces at
// once, to anyone: a member with a hostile daemon asked for all of them
// and took each as slowly as the write deadlines allow (a MiB per idle
// timeout: 80 s for an 8 MiB piece), asking again as each ended, and the
// node refused every other member (busy): a content it alone held
// reached no one. One peer holds half of the slots now.
func TestAttackUploadSlotsOfOnePeer(t *testing.T) {
	creds, _ := certs(t, "node1", "node2", "node3")
	src := stallSource{release: make(chan struct{}), reading: make(chan struct{}, 100)}
	g := serveWith(t, Config{Credentials: creds["node1"], MaxUploads: 4}, src)
	peer := Peer{Name: "node1", Addr: g.Addr()}
	hostile := client(t, creds["node2"])
	errs := make(chan error, 4)
	for range 4 {
		go func() {
			_, err := hostile.Fetch(context.Background(), peer, Piece{Content: "c1"}, discard(1<<10))
			errs <- err
		}()
	}
	time.Sleep(time.Second) // every one of them asked
	other, node3 := make(chan error, 1), client(t, creds["node3"])
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := node3.Fetch(ctx, peer, Piece{Content: "c1"}, discard(1<<10))
		other <- err
	}()
	time.Sleep(500 * time.Millisecond)
	close(src.release)
	if err := <-other; err != nil {
		t.Fatalf("node3's fetch while node2 asked for %d pieces at once: %v", 4, err)
	}
	for range 4 {
		<-errs
	}
}
