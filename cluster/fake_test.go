package cluster

import (
	"bytes"
	"context"
	"os"
	"testing"

	"tensorfs/cluster/transport/fake"
)

// TestPullBusyPublisher pulls over the in-memory transport from a
// publisher that sends one piece at a time and refuses more (ErrBusy):
// three nodes pulling at once all complete, each piece the publisher sends
// goes on from the node that got it, and the publisher sends less than
// the three copies.
func TestPullBusyPublisher(t *testing.T) {
	tc := newTestCluster(t)
	nw := fake.NewNetwork()
	cfg := func(name string, uploads int) Config {
		c := tc.config(name)
		c.Transport = nw.New(name, uploads)
		return c
	}
	a := tc.join(cfg("node-a", 1))
	if a.Addr() != "fake:node-a" {
		t.Fatalf("node-a's address %q: want its transport's", a.Addr())
	}
	ctx := context.Background()
	data, vid := publishFile(t, a, 2<<20) // 32 pieces
	var pulls []*Pull
	var files []map[string]*os.File
	for _, name := range []string{"node-b", "node-c", "node-d"} {
		n := tc.join(cfg(name, 0))
		v, err := n.Version(ctx, vid)
		if err != nil {
			t.Fatal(err)
		}
		p, f := pullAll(t, n, v)
		pulls = append(pulls, p)
		files = append(files, f)
	}
	fromPeers := int64(0)
	for i, p := range pulls {
		if err := p.Wait(); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(contents(t, files[i]["w"]), data) {
			t.Fatalf("pull %d: bytes differ", i)
		}
		for peer, b := range p.Progress().ByPeer {
			if peer != "node-a" {
				fromPeers += b
			}
		}
	}
	t.Logf("node-a sent %d bytes, the pullers %d to each other", a.Stats().BytesServed, fromPeers)
	if sent := a.Stats().BytesServed; sent >= 3*int64(len(data)) || fromPeers == 0 {
		t.Fatalf("node-a sent %d bytes, the pullers %d to each other: want them to share what node-a sent", sent, fromPeers)
	}
}
