package transport

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"tensorfs/internal/testcerts"
)

// stallHeldSource stalls its pieces as a stallSource does and can be
// watched (it holds nothing).
type stallHeldSource struct {
	stallSource
	held *heldSource
}

func (s stallHeldSource) Holding(contents []string) (Watcher, error) {
	return s.held.Holding(contents)
}

// TestAttackWatchRedials: a node's connections to one peer were bounded
// for fetches (maxPerPeer, 8) but not for watches: each pull watches the
// members it subscribes to on a connection of its own, and every open of
// a published segment is a pull, so a user who opened hundreds of
// segments being pulled (600 in TestAttackClusterPullConnections) made
// her node dial a watch of each member per open. The member serves 4 of
// one peer's and refused the others (busy), after a TLS handshake each,
// and each pull dialled its own again every 2 s at most (Backoff): for
// 600 opens and 32 members, thousands of handshakes a second from one
// node, on its CPU and theirs, for as long as the pulls ran; and each
// connection counted among the 16 of the node's that a member holds,
// past which it ends the node's oldest (fetches in flight included).
// Now a node runs 4 watches of a peer at once; the others wait.
func TestAttackWatchRedials(t *testing.T) {
	creds, _ := certs(t, "node1", "node2")
	src := stallHeldSource{stallSource{release: make(chan struct{}), reading: make(chan struct{}, 100)}, newHeldSource(nil, 1, []byte{0})}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted := countingListener{l, make(chan struct{}, 100000)}
	g := serveWith(t, Config{Listener: accepted, Credentials: creds["node1"], MaxUploads: 100}, src)
	peer := Peer{Name: "node1", Addr: g.Addr()}
	node2 := client(t, creds["node2"])
	errs := make(chan error, maxPerPeer)
	for range maxPerPeer {
		go func() {
			_, err := node2.Fetch(context.Background(), peer, Piece{Content: "c1"}, discard(1<<10))
			errs <- err
		}()
	}
	for range maxPerPeer {
		<-src.reading // every fetch is in flight, on a connection of its own
	}
	// A user's opens: pulls, each watching the member, and again when
	// refused (Pull.watch, after Backoff: 100 ms at first).
	const pulls = 64
	ctx, cancel := context.WithCancel(context.Background())
	var watches sync.WaitGroup
	for range pulls {
		watches.Go(func() {
			for ctx.Err() == nil {
				node2.Watch(ctx, peer, []string{"c1"}, func(Update) {})
				time.Sleep(100 * time.Millisecond)
			}
		})
	}
	time.Sleep(2 * time.Second)
	dialled := len(accepted.accepted) - maxPerPeer
	close(src.release)
	failed := 0
	for range maxPerPeer {
		if err := <-errs; err != nil {
			t.Logf("a fetch in flight: %v", err)
			failed++
		}
	}
	cancel()
	watches.Wait()
	t.Logf("%d pulls watching node1 for 2 s: %d connections dialled for them", pulls, dialled)
	if dialled > 2*maxPeerWatches || failed > 0 {
		t.Fatalf("%d pulls watching node1 for 2 s dialled %d connections (node1 serves %d watches of a peer), and %d of the %d fetches in flight failed", pulls, dialled, maxPeerWatches, failed, maxPerPeer)
	}
}

// TestAttackPeerByCommonName: the server counted a member's connections
// and watches by its certificate's common name, which names nothing: a
// node's name is its certificate's DNS name (Credentials.CheckName, and
// what a client verifies of a server), and a CA may give every node the
// same common name, or none. Every member was then one peer: once one
// member (a hostile one, or a busy one) held 4 watches, every other
// member's was refused, and their connections ended one another's past
// 16 for the whole cluster.
func TestAttackPeerByCommonName(t *testing.T) {
	dir := t.TempDir()
	ca, err := testcerts.NewCA(dir, "cluster")
	if err != nil {
		t.Fatal(err)
	}
	creds := map[string]*Credentials{}
	for _, name := range []string{"node1", "node2", "node3"} {
		f, err := ca.IssueCN("tensorfs node", name, net.IPv4(127, 0, 0, 1))
		if err != nil {
			t.Fatal(err)
		}
		if creds[name], err = LoadCredentials(f.CA, f.Cert, f.Key); err != nil {
			t.Fatal(err)
		}
		if err := creds[name].CheckName(name); err != nil {
			t.Fatal(err)
		}
	}
	src := newHeldSource(randomBytes(t, 4<<10), 1<<10, []byte{0b0001})
	_, addr := serve(t, creds["node1"], src)
	peer := Peer{Name: "node1", Addr: addr}
	node2 := client(t, creds["node2"])
	for range maxPeerWatches {
		startWatch(t, node2, peer, "c1").next(t)
	}
	w := startWatch(t, client(t, creds["node3"]), peer, "c1")
	if u := w.next(t); u.Content != 0 || u.Bits == nil {
		t.Fatalf("node3's watch while node2 holds %d: %+v", maxPeerWatches, u)
	}
}
