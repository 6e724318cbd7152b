package cluster

import (
	"context"
	"math/rand/v2"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Retry waits: the first retry waits about retryBase, each next one
// twice as long, up to retryMax.
const (
	retryBase = 100 * time.Millisecond
	retryMax  = 2 * time.Second
)

// Backoff returns how long to wait before retry number try (0 first): the
// wait doubles with each try from retryBase up to retryMax, and is drawn
// at random from its upper half, so that nodes retrying together spread.
func Backoff(try int) time.Duration {
	d := min(retryBase<<min(try, 16), retryMax)
	return d/2 + rand.N(d/2+1)
}

// watchPrefix applies every key under prefix, and then every change to
// them, until ctx ends or apply returns false. It reads the keys (a
// snapshot) and watches from the snapshot's revision on; when the watch
// breaks (its history compacted, etcd gone), it reads them again and
// applies the difference from what it had applied: a put for each key
// new or changed, a delete for each key gone, so that nothing deleted
// meanwhile is missed. known seeds what the caller holds already, by key,
// with the ModRevision applied (0: unknown, applied again); a key of it
// the first snapshot lacks is applied as a delete. A delete found by a
// read, not watched, has no ModRevision. With rev > 0, known is
// what the caller read at revision rev-1, and the watch starts from rev
// without reading first. Reads that fail are retried after Backoff.
func (n *Node) watchPrefix(ctx context.Context, prefix string, known map[string]int64, rev int64, apply func(*clientv3.Event) bool) {
	if known == nil {
		known = map[string]int64{}
	}
	do := func(ev *clientv3.Event) bool {
		if ev.Type == clientv3.EventTypeDelete {
			delete(known, string(ev.Kv.Key))
		} else {
			known[string(ev.Kv.Key)] = ev.Kv.ModRevision
		}
		return apply(ev)
	}
	if rev > 0 && !n.watchFrom(ctx, prefix, rev, do) {
		return
	}
	for try := 0; ctx.Err() == nil; {
		tctx, cancel := n.timeout(ctx)
		resp, err := n.etcd.Get(tctx, prefix, clientv3.WithPrefix())
		cancel()
		if err != nil {
			sleep(ctx, Backoff(try))
			try++
			continue
		}
		try = 0
		for _, ev := range resync(known, resp.Kvs) {
			if !do(ev) {
				return
			}
		}
		if !n.watchFrom(ctx, prefix, resp.Header.Revision+1, do) {
			return
		}
		sleep(ctx, Backoff(0)) // a watch that breaks at once does not spin
	}
}

// resync returns the events that turn known into kvs, the keys under a
// prefix now: a put for each key new or whose ModRevision changed, then
// a delete for each key known that kvs lacks.
func resync(known map[string]int64, kvs []*mvccpb.KeyValue) []*clientv3.Event {
	var evs []*clientv3.Event
	now := make(map[string]bool, len(kvs))
	for _, kv := range kvs {
		now[string(kv.Key)] = true
		if rev, ok := known[string(kv.Key)]; !ok || rev == 0 || rev != kv.ModRevision {
			evs = append(evs, &clientv3.Event{Type: clientv3.EventTypePut, Kv: kv})
		}
	}
	for key := range known {
		if !now[key] {
			evs = append(evs, &clientv3.Event{Type: clientv3.EventTypeDelete, Kv: &mvccpb.KeyValue{Key: []byte(key)}})
		}
	}
	return evs
}

// watchFrom applies the changes under prefix from revision rev on until
// ctx ends or apply returns false (false), or the watch breaks and the
// keys must be read again (true).
func (n *Node) watchFrom(ctx context.Context, prefix string, rev int64, apply func(*clientv3.Event) bool) bool {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for resp := range n.etcd.Watch(wctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(rev)) {
		if err := resp.Err(); err != nil {
			n.log.Info("cluster: watch ended; reading the keys again", "prefix", prefix, "err", err)
			return ctx.Err() == nil
		}
		for _, ev := range resp.Events {
			if !apply(ev) {
				return false
			}
		}
	}
	return ctx.Err() == nil
}
