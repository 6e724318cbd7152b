package transport

import (
	"context"
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
	time.Sleep(500 * time.Millisecond)
	server.mu.Lock()
	held := len(server.open)
	server.mu.Unlock()
	t.Logf("the server holds %d of the %d connections", held, len(flood))
	member := client(t, creds["node2"])
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if _, err := member.Fetch(ctx, Peer{Name: "node1", Addr: addr}, Piece{Content: "c1"}, discard(1000)); err != nil {
		t.Fatalf("a member's fetch while %d unauthenticated connections are held: %v", len(flood), err)
	}
}
