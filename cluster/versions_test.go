package cluster

import (
	"bytes"
	"context"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestVersionsBounded publishes 100 versions of one directory, each with
// new bytes, as a node does when a file is replaced (the old file's
// content is dropped once it goes), while a second node pulls every
// tenth: the keys under the prefix stay as many as the kept versions
// need, whatever the number of versions published.
func TestVersionsBounded(t *testing.T) {
	tc := newTestCluster(t)
	a, b := tc.join(tc.config("node-a")), tc.join(tc.config("node-b"))
	ctx := context.Background()
	count := func() int64 {
		t.Helper()
		resp, err := a.etcd.Get(ctx, a.keys.prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		return resp.Count
	}
	var prev string
	var most, after3 int64
	for i := range 100 {
		data := bytes.Repeat([]byte{byte(i)}, 100<<10)
		info, err := a.Publish(ctx, "models/m", []LocalEntry{dirEntry("."), fileEntry("w", data)}, PublishOptions{})
		if err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
		v, err := a.Version(ctx, info.Version)
		if err != nil {
			t.Fatal(err)
		}
		cid := v.Entries[1].Content
		if prev != "" {
			a.Drop(prev)
		}
		prev = cid
		if i%10 == 0 {
			p, files := pullAll(t, b, v)
			if err := p.Wait(); err != nil {
				t.Fatalf("pull of version %d: %v", i, err)
			}
			if got := contents(t, files["w"]); !bytes.Equal(got, data) {
				t.Fatalf("version %d pulled differs", i)
			}
			b.Drop(cid) // replaced here too by the next version
		}
		if err := a.flush(); err != nil {
			t.Fatal(err)
		}
		n := count()
		most = max(most, n)
		if i == 3 {
			after3 = n
		}
	}
	// Two versions of one file: a node key each, the directory, two
	// headers, four entries, two contents and references, a holder or
	// two of each content.
	waitFor(t, 5*time.Second, "holder keys of dropped contents deleted", func() bool { return count() <= after3 })
	if most > 20 {
		t.Errorf("etcd held up to %d keys for one directory of one file; the kept versions need about 16", most)
	}
}
