package cluster

import (
	"context"
	"maps"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestWatchResyncDeletes has watchPrefix start from a revision that a
// compaction removed, after keys were changed, added and deleted: the
// watch breaks, and the resync from a fresh snapshot applies the
// deletion as well as the puts; a change after that comes through the
// watch again.
func TestWatchResyncDeletes(t *testing.T) {
	tc := newTestCluster(t)
	n := tc.join(tc.config("node-a"))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const prefix = "/test/watch/"
	put := func(k, v string) {
		if _, err := n.etcd.Put(ctx, prefix+k, v); err != nil {
			t.Fatal(err)
		}
	}
	del := func(k string) {
		if _, err := n.etcd.Delete(ctx, prefix+k); err != nil {
			t.Fatal(err)
		}
	}
	put("gone", "1")
	put("changed", "1")
	put("same", "1")
	resp, err := n.etcd.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]string{}
	for _, kv := range resp.Kvs {
		seen[string(kv.Key)] = string(kv.Value)
	}
	del("gone")
	put("changed", "2")
	put("new", "1")
	last, err := n.etcd.Put(ctx, "/test/other", "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n.etcd.Compact(ctx, last.Header.Revision); err != nil {
		t.Fatal(err)
	}

	var mu sync.Mutex
	var deletes []string
	applied := 0
	go n.watchPrefix(ctx, prefix, revisions(resp.Kvs), resp.Header.Revision+1, func(ev *clientv3.Event) bool {
		mu.Lock()
		defer mu.Unlock()
		applied++
		if ev.Type == clientv3.EventTypeDelete {
			deletes = append(deletes, string(ev.Kv.Key))
			delete(seen, string(ev.Kv.Key))
		} else {
			seen[string(ev.Kv.Key)] = string(ev.Kv.Value)
		}
		return true
	})
	want := map[string]string{prefix + "changed": "2", prefix + "same": "1", prefix + "new": "1"}
	waitFor(t, 10*time.Second, "the resync", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return maps.Equal(seen, want)
	})
	mu.Lock()
	if len(deletes) != 1 || deletes[0] != prefix+"gone" || applied != 3 {
		t.Errorf("resync applied %d events, deletes %q; want 3 (put changed, put new, delete gone)", applied, deletes)
	}
	mu.Unlock()
	if !tc.logs.contains("watch ended; reading the keys again") {
		t.Error("the watch did not break on the compacted revision")
	}

	del("new")
	delete(want, prefix+"new")
	waitFor(t, 10*time.Second, "a deletion after the resync", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return maps.Equal(seen, want)
	})
}

// TestBackoff checks that retry waits grow from retryBase to retryMax,
// each drawn from the upper half of its step.
func TestBackoff(t *testing.T) {
	for try, step := range []time.Duration{retryBase, 2 * retryBase, 4 * retryBase} {
		for range 100 {
			if d := Backoff(try); d < step/2 || d > step {
				t.Fatalf("Backoff(%d) = %v, want within [%v, %v]", try, d, step/2, step)
			}
		}
	}
	if d := Backoff(1000); d < retryMax/2 || d > retryMax {
		t.Fatalf("Backoff(1000) = %v, want within [%v, %v]", d, retryMax/2, retryMax)
	}
}

// TestWatchKnownDirs: a watch told of directories its caller holds sends
// each one not published as a missed deletion, and the published ones as
// they are; a deletion it sees happen is not missed.
func TestWatchKnownDirs(t *testing.T) {
	tc := newTestCluster(t)
	a := tc.join(tc.config("node-a"))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := a.Publish(ctx, "kept", []LocalEntry{dirEntry(".")}, PublishOptions{}); err != nil {
		t.Fatal(err)
	}
	events := a.Watch(ctx, []string{"kept", "gone"})
	next := func() DirEvent {
		t.Helper()
		select {
		case ev := <-events:
			return ev
		case <-time.After(10 * time.Second):
			t.Fatal("no watch event")
		}
		return DirEvent{}
	}
	got := map[string]DirEvent{}
	for range 2 {
		ev := next()
		got[ev.Dir] = ev
	}
	if ev := got["kept"]; ev.Deleted || ev.Version == "" {
		t.Errorf("the published directory: %+v", ev)
	}
	if ev := got["gone"]; !ev.Deleted || !ev.Missed {
		t.Errorf("a known directory not published: %+v, want a missed deletion", ev)
	}
	if err := a.Unpublish(ctx, "kept", 0); err != nil {
		t.Fatal(err)
	}
	if ev := next(); ev.Dir != "kept" || !ev.Deleted || ev.Missed {
		t.Errorf("an unpublish seen: %+v, want a deletion not missed", ev)
	}
}
