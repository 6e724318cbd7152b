package cluster

import (
	"context"
	"testing"
	"time"
)

// TestCloseFreesName closes a node again and again: once joined, as it
// joins (told its lease), and while it joins (a put to etcd cut off by
// Close may have committed). Each time its name is free once Close
// returns, so that the next daemon of the node joins at once, not after
// its predecessor's lease expired.
func TestCloseFreesName(t *testing.T) {
	tc := newTestCluster(t)
	ctx := context.Background()
	probe := tc.join(tc.config("node-b"))
	for i := range 45 {
		cfg := tc.config("node-a")
		cfg.LeaseTTL = time.Minute // a lease Close left behind would show
		told := make(chan struct{})
		cfg.OnLease = func(int64) { close(told) }
		n, err := Join(cfg)
		if err != nil {
			t.Fatal(err)
		}
		switch i % 3 {
		case 0:
			if _, err := n.lease(ctx); err != nil {
				t.Fatalf("close %d: %v", i, err)
			}
		case 1:
			<-told
		case 2:
			time.Sleep(time.Duration(i) * time.Millisecond / 2)
		}
		n.Close()
		resp, err := probe.etcd.Get(ctx, probe.keys.node("node-a"))
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kvs) != 0 {
			t.Fatalf("close %d: node-a's key is still in etcd, under lease %x, after Close", i, resp.Kvs[0].Lease)
		}
	}
}
