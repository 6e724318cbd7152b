package cluster

import (
	"fmt"
	"runtime"
	"testing"
	"time"
)

// TestAttackHolderKeysAmplify: a holder key says only "complete" or
// "partial" now, a few bytes, and any holder of a cluster certificate
// writes as many as etcd takes (for nodes that do not exist, leased or
// not); every node pulling the content made each complete one a bitmap
// of every piece, 2 KiB at 16384 pieces: a million such keys, about
// 100 MB of etcd, were 2 GiB in every pulling daemon (root), where a
// bitmap key before cost its puller what it cost etcd.
func TestAttackHolderKeysAmplify(t *testing.T) {
	const keys = 4000
	c := &Content{Size: MaxPieces << 16, PieceSize: 64 << 10, id: "c"}
	s := newScheduler("self", DefaultPerPeer, 1, time.Now())
	g := newGroup(c)
	s.groups = append(s.groups, g)
	names := make([]string, keys)
	for i := range names {
		names[i] = fmt.Sprintf("fake-%d", i)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for _, name := range names {
		s.keyLocked(g, name, true)
	}
	runtime.ReadMemStats(&after)
	per := (after.TotalAlloc - before.TotalAlloc) / keys
	t.Logf("%d complete holder keys: %d bytes allocated each", keys, per)
	if per > 1024 {
		t.Fatalf("each complete holder key of a content of %d pieces cost its puller %d bytes; want under 1 KiB", c.Pieces(), per)
	}
	if g.seeds != keys || g.counts[0] != keys || g.counts[MaxPieces-1] != keys {
		t.Fatalf("%d seeds, piece 0 held by %d, the last by %d; want %d", g.seeds, g.counts[0], g.counts[MaxPieces-1], keys)
	}
	// A member told of, then keyed complete, then partial again.
	s.subs = append(s.subs, "member")
	s.keyLocked(g, "member", false)
	s.toldPieceLocked(g, "member", 3)
	s.keyLocked(g, "member", true)
	s.toldPieceLocked(g, "member", 5) // ignored: its key says complete
	s.keyLocked(g, "member", false)
	if n := g.holders[names[0]].bits.count(); n != MaxPieces || g.seeds != keys {
		t.Fatalf("a complete holder has %d pieces of %d, and %d seeds; want every piece, %d", n, MaxPieces, g.seeds, keys)
	}
}
