package cluster

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// manifestKeys returns the keys and value bytes of the published
// namespace in etcd (all but the nodes' and holders' keys).
func manifestKeys(t *testing.T, n *Node) (int, int) {
	t.Helper()
	resp, err := n.etcd.Get(context.Background(), n.keys.prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	keys, bytes := 0, 0
	for _, kv := range resp.Kvs {
		k := string(kv.Key)
		if strings.HasPrefix(k, n.keys.nodes()) || strings.HasPrefix(k, n.keys.prefix+"holders/") {
			continue
		}
		keys, bytes = keys+1, bytes+len(kv.Key)+len(kv.Value)
	}
	return keys, bytes
}

// TestPublishOthersDir: a directory published by one uid takes a new
// version, or is unpublished, only by that uid or root; another uid is
// refused (ErrNotPublisher, naming the publisher) having written nothing,
// from any node.
func TestPublishOthersDir(t *testing.T) {
	tc := newTestCluster(t)
	a, b := tc.join(tc.config("node-a")), tc.join(tc.config("node-b"))
	ctx := context.Background()
	const alice, bob = 1000, 1001
	mine, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), fileEntry("w", []byte("alice"))}, PublishOptions{UID: alice})
	if err != nil {
		t.Fatal(err)
	}
	keys, bytes := manifestKeys(t, a)
	for _, n := range []*Node{a, b} {
		_, err := n.Publish(ctx, "m", []LocalEntry{dirEntry("."), fileEntry("w", []byte("EVIL"))}, PublishOptions{UID: bob})
		if !errors.Is(err, ErrNotPublisher) || !strings.Contains(err.Error(), fmt.Sprintf("uid %d", alice)) {
			t.Errorf("bob's publish over alice's directory from %s: %v, want ErrNotPublisher naming uid %d", n.cfg.Node, err, alice)
		}
		if err := n.Unpublish(ctx, "m", bob); !errors.Is(err, ErrNotPublisher) {
			t.Errorf("bob's unpublish of alice's directory from %s: %v, want ErrNotPublisher", n.cfg.Node, err)
		}
	}
	if k, b := manifestKeys(t, a); k != keys || b != bytes {
		t.Errorf("refused publishes left %d keys of %d bytes in etcd, were %d of %d", k, b, keys, bytes)
	}
	if cur, err := a.Lookup(ctx, "m"); err != nil || cur.Version != mine.Version || cur.UID != alice {
		t.Fatalf("after bob's refused publishes: %+v, %v; want alice's version %s", cur, err, mine.Version)
	}
	// Alice publishes a new version from another node; root replaces it
	// and unpublishes it.
	if _, err := b.Publish(ctx, "m", []LocalEntry{dirEntry("."), fileEntry("w", []byte("alice 2"))}, PublishOptions{UID: alice}); err != nil {
		t.Fatalf("alice's second version: %v", err)
	}
	if info, err := b.Publish(ctx, "m", []LocalEntry{dirEntry("."), fileEntry("w", []byte("root"))}, PublishOptions{UID: 0}); err != nil || info.UID != 0 {
		t.Fatalf("root's version: %+v, %v", info, err)
	}
	if _, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), fileEntry("w", []byte("alice 3"))}, PublishOptions{UID: alice}); !errors.Is(err, ErrNotPublisher) {
		t.Errorf("alice's publish over root's version: %v, want ErrNotPublisher", err)
	}
	if err := a.Unpublish(ctx, "m", 0); err != nil {
		t.Fatalf("root's unpublish: %v", err)
	}
}

// TestPublishEntryTooLarge: an entry whose attributes would make an etcd
// value larger than a manifest takes is refused (ErrTooLarge, naming the
// file and its attribute bytes) before anything is written.
func TestPublishEntryTooLarge(t *testing.T) {
	tc := newTestCluster(t)
	a := tc.join(tc.config("node-a"))
	ctx := context.Background()
	keys, bytes := manifestKeys(t, a)
	small, big := fileEntry("a", []byte("a")), fileEntry("z", []byte("z"))
	big.Xattrs = map[string][]byte{}
	for i := range 3 {
		big.Xattrs[fmt.Sprintf("user.x%d", i)] = randomBytes(t, maxXattrValue)
	}
	_, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), small, big}, PublishOptions{UID: 1000})
	if !errors.Is(err, ErrTooLarge) || !strings.Contains(err.Error(), `"z"`) || !strings.Contains(err.Error(), fmt.Sprint(3*(maxXattrValue+len("user.x0")))) {
		t.Fatalf("publish of an entry with %d bytes of attributes: %v, want ErrTooLarge naming it and its bytes", 3*maxXattrValue, err)
	}
	if k, b := manifestKeys(t, a); k != keys || b != bytes {
		t.Errorf("the refused publish left %d keys of %d bytes in etcd, were %d of %d", k, b, keys, bytes)
	}
	// At the bound, it is published.
	big.Xattrs = map[string][]byte{"user.x": randomBytes(t, maxXattrValue), "user.y": randomBytes(t, maxXattrBytes-maxXattrValue-2*len("user.x"))}
	if _, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), small, big}, PublishOptions{UID: 1000}); err != nil {
		t.Fatalf("publish of an entry of %d bytes of attributes: %v", maxXattrBytes, err)
	}
}
