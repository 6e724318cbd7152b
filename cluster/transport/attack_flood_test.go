package transport

import (
	"context"
	"crypto/tls"
	"net"
	"testing"
	"time"
)

// TestStreamHandshakeFlood checks that connections that never finish
// their handshake (any process that reaches the port, with no
// certificate: a local user on a node, from its address or any loopback
// one) cannot take every connection the server holds: a member's fetch
// from another host still succeeds while they are held.
func TestStreamHandshakeFlood(t *testing.T) {
	smallServer(t)
	creds, _ := certs(t, "node1", "node2")
	src := &memSource{content: "c1", data: randomBytes(t, 1000), pieceSize: 1 << 20}
	server, addr := serve(t, creds["node1"], src)
	var flood []net.Conn
	defer func() {
		for _, c := range flood {
			c.Close()
		}
	}()
	// From loopback addresses other than the member's (127.0.0.1): a user
	// picks any of 127.0.0.0/8 as her source.
	for i := range maxServed + 16 {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 1+byte(i/250), 2+byte(i%250))}}
		c, err := d.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		flood = append(flood, c)
	}
	// Let the server accept them all (before the fix it held maxServed of
	// them, for the handshake timeout, and closed every later one).
	// The member below shares their host (loopback): wait until the
	// server has accepted them all, so that its handshake is the newest.
	var held int
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		server.mu.Lock()
		held = len(server.open)
		server.mu.Unlock()
		if held <= maxPendingPerHost {
			break
		}
	}
	time.Sleep(100 * time.Millisecond)
	t.Logf("the server holds %d of the %d connections", held, len(flood))
	member := client(t, creds["node2"])
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if _, err := member.Fetch(ctx, Peer{Name: "node1", Addr: addr}, Piece{Content: "c1"}, discard(1000)); err != nil {
		t.Fatalf("a member's fetch while %d unauthenticated connections are held: %v", len(flood), err)
	}
}

// TestStreamConnectionsPerPeer checks that one member cannot hold the
// connections a server has for every member: a node's fetches from one
// peer share a few connections however many run at once (every open of a
// published segment on a node is a pull of its own, each fetching
// several pieces at once: one user's opens made as many connections, kept
// after, and held the server's 512), and a server holds a few of one
// member's connections (a hostile daemon dials as many as it likes).
func TestStreamConnectionsPerPeer(t *testing.T) {
	smallServer(t)
	creds, _ := certs(t, "node1", "node2", "node3")
	src := stallSource{release: make(chan struct{}), reading: make(chan struct{}, 1000)}
	g := serveWith(t, Config{Credentials: creds["node1"], MaxUploads: 1000}, src)
	peer := Peer{Name: "node1", Addr: g.Addr()}
	node2 := client(t, creds["node2"])
	fetches := maxServed + 88
	errs := make(chan error, fetches)
	for range fetches {
		go func() {
			_, err := node2.Fetch(context.Background(), peer, Piece{Content: "c1"}, discard(1<<10))
			errs <- err
		}()
	}
	time.Sleep(time.Second) // let them dial
	close(src.release)
	failed := 0
	for range fetches {
		if err := <-errs; err != nil {
			failed++
		}
	}
	node2.mu.Lock()
	kept := len(node2.idle[peer])
	node2.mu.Unlock()
	t.Logf("%d fetches at once: %d failed, %d connections kept", fetches, failed, kept)
	if kept > maxPerPeer {
		t.Errorf("node2 keeps %d connections to node1; want at most %d", kept, maxPerPeer)
	}
	node3 := client(t, creds["node3"])
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := node3.Fetch(ctx, peer, Piece{Content: "c1"}, discard(1<<10)); err != nil {
		t.Fatalf("node3's fetch after node2's %d at once: %v", fetches, err)
	}

	// A hostile member dials connections of its own.
	var held []*tls.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	for range maxServed + 16 {
		cfg := creds["node2"].ClientConfig("node1")
		cfg.NextProtos = []string{Protocol}
		c, err := tls.Dial("tcp", peer.Addr, cfg)
		if err != nil {
			continue
		}
		held = append(held, c)
	}
	time.Sleep(200 * time.Millisecond)
	node3 = client(t, creds["node3"])
	ctx, cancel = context.WithTimeout(context.Background(), 5*time.Second) // the dials took their time
	defer cancel()
	if _, err := node3.Fetch(ctx, peer, Piece{Content: "c1"}, discard(1<<10)); err != nil {
		t.Fatalf("node3's fetch while node2 holds %d connections: %v", len(held), err)
	}
}

// smallServer has the servers t makes hold 128 connections rather than
// 512: a flood past them takes a quarter of the handshakes.
func smallServer(t *testing.T) {
	old := maxServed
	maxServed = 128
	t.Cleanup(func() { maxServed = old })
}
