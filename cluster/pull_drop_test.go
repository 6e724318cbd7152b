package cluster

import (
	"bytes"
	"context"
	"testing"
	"time"
)

// TestPullDrop drops a job whose content no live node serves any more
// (its segment was replaced): the pull goes on without it and ends, at
// once, with the other job complete, rather than failing with
// ErrNoHolder once NoHolderWait has passed; the dropped content is not
// served, and Drop of a complete job does nothing.
func TestPullDrop(t *testing.T) {
	ctx := context.Background()
	a, b, v, kept := dropBed(t, "kept", "gone")
	var jobs []Job
	for _, e := range v.Entries[1:] { // "gone", then "kept"
		jobs = append(jobs, Job{Content: v.Contents[e.Content], Dst: dst(t, e.Size)})
	}
	a.Drop(v.Entries[1].Content) // "gone": no node serves it
	start := time.Now()
	p, err := b.Pull(ctx, jobs)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.Done(1):
	case <-time.After(10 * time.Second):
		t.Fatal("the kept content was not pulled")
	}
	if p.Drop(1) {
		t.Error("Drop of a complete job dropped it")
	}
	if !p.Drop(0) {
		t.Fatal("Drop of the job no node serves did not drop it")
	}
	if err := p.Wait(); err != nil {
		t.Fatalf("the pull with its job dropped: %v", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("the pull took %v", d)
	}
	select {
	case <-p.Done(0):
		t.Error("the dropped job is done")
	default:
	}
	if !bytes.Equal(contents(t, jobs[1].Dst), kept) {
		t.Error("the kept content differs")
	}
	if b.completeSource(v.Entries[1].Content) != nil {
		t.Error("node-b serves the dropped content")
	}
}

// TestAttackDroppedJobEndsNextPull: a job dropped from a pull (its
// segment replaced or removed during its fill) leaves its content to
// the next pull of it (fs's dropFill: "from then on another pull of the
// content leads it"), but the first pull, ending later (its other jobs),
// ended the content's pull again: it stopped serving the second pull's
// content and deleted its holder key, so the node that pulled it whole
// never served it nor told its watchers.
func TestAttackDroppedJobEndsNextPull(t *testing.T) {
	ctx := context.Background()
	a, b, v, x := dropBed(t, "x", "y")
	cx, cy := v.Contents[v.Entries[2].Content], v.Contents[v.Entries[1].Content] // "x", "y" (sorted: ".", "x", "y")
	if cx.Size != int64(len(x)) {
		cx, cy = cy, cx
	}
	a.Drop(cx.ID()) // no node serves either while the first pull runs
	a.Drop(cy.ID())
	ctx1, cancel1 := context.WithCancel(ctx)
	defer cancel1()
	p1, err := b.Pull(ctx1, []Job{{Content: cx, Dst: dst(t, cx.Size)}, {Content: cy, Dst: dst(t, cy.Size)}})
	if err != nil {
		t.Fatal(err)
	}
	if !p1.Drop(0) {
		t.Fatal("the first pull did not drop x")
	}
	f2 := dst(t, cx.Size)
	p2, err := b.Pull(ctx, []Job{{Content: cx, Dst: f2}})
	if err != nil {
		t.Fatalf("a pull of x once the first dropped it: %v", err)
	}
	cancel1() // the first pull ends (y: no holder)
	p1.Wait()
	if err := a.Offer(cx.ID(), bytes.NewReader(x), cx.Size); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p2.Done(0):
	case <-time.After(20 * time.Second):
		t.Fatal("the second pull did not complete x")
	}
	if err := p2.Wait(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(contents(t, f2), x) {
		t.Fatal("x pulled differs")
	}
	if b.completeSource(cx.ID()) == nil {
		t.Fatal("node-b, which pulled x whole, does not serve it: the first pull's end dropped it")
	}
}

// dropBed publishes on node-a a directory of two files, big (300 KiB,
// whose bytes it returns) and small (200 KiB), and returns node-a,
// node-b (which waits a minute for a holder) and the version as node-b
// reads it.
func dropBed(t *testing.T, big, small string) (a, b *Node, v *Version, bigBytes []byte) {
	t.Helper()
	tc := newTestCluster(t)
	a = tc.join(tc.config("node-a"))
	cfg := tc.config("node-b")
	cfg.NoHolderWait = time.Minute
	b = tc.join(cfg)
	ctx := context.Background()
	bigBytes = randomBytes(t, 300<<10)
	info, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), fileEntry(big, bigBytes), fileEntry(small, randomBytes(t, 200<<10))}, PublishOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if v, err = b.Version(ctx, info.Version); err != nil {
		t.Fatal(err)
	}
	return a, b, v, bigBytes
}
