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
	tc := newTestCluster(t)
	a := tc.join(tc.config("node-a"))
	cfg := tc.config("node-b")
	cfg.NoHolderWait = time.Minute
	b := tc.join(cfg)
	ctx := context.Background()
	kept, gone := randomBytes(t, 300<<10), randomBytes(t, 200<<10)
	info, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), fileEntry("kept", kept), fileEntry("gone", gone)}, PublishOptions{})
	if err != nil {
		t.Fatal(err)
	}
	v, err := b.Version(ctx, info.Version)
	if err != nil {
		t.Fatal(err)
	}
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
