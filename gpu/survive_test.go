package gpu

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"
)

// TestHelperOutlivesSession checks that a helper outlives its daemon's
// session while its door is held, and that a successor attached through
// the door claims the blocks with their bytes, tags and IPC handles, and
// ends the first daemon's session.
func TestHelperOutlivesSession(t *testing.T) {
	d1 := startSim(t)
	door, pidfd, err := Door(d1)
	if err != nil || door == nil || pidfd == nil {
		t.Fatalf("Door = %v, %v, %v", door, pidfd, err)
	}
	defer door.Close()
	defer pidfd.Close()
	b := alloc(t, d1, 3<<20)
	want := bytes.Repeat([]byte("tensor"), 1000)
	if err := d1.CopyIn(b, 5, want); err != nil {
		t.Fatal(err)
	}
	if err := d1.(Survivor).Tag(b, []byte("segment 7")); err != nil {
		t.Fatal(err)
	}
	untagged := alloc(t, d1, 10)
	ipc1, err := d1.IPC(b)
	if err != nil {
		t.Fatal(err)
	}
	// The first daemon dies: its session ends without a goodbye, and the
	// helper has seen it end before the successor comes (were the
	// successor's goodbye first, the dead daemon's silence after would
	// keep the helper for a successor of its own).
	d1.(*remote).conn.CloseWrite()
	<-d1.(*remote).gone

	d2, err := Attach(door, pidfd, nil)
	if err != nil {
		t.Fatalf("Attach after the daemon's death = %v", err)
	}
	defer d2.Close()
	owned, err := d2.(Survivor).Claim()
	if err != nil {
		t.Fatal(err)
	}
	tags := map[uint64]string{}
	for _, o := range owned {
		tags[o.Block.ID] = string(o.Tag)
	}
	if len(owned) != 2 || tags[b.ID] != "segment 7" || tags[untagged.ID] != "" {
		t.Fatalf("Claim = %+v; want block %d tagged and %d untagged", owned, b.ID, untagged.ID)
	}
	got := make([]byte, len(want))
	if err := d2.CopyOut(b, 5, got); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("successor's CopyOut = %v; bytes equal: %v", err, bytes.Equal(got, want))
	}
	if ipc2, err := d2.IPC(b); err != nil || ipc2 != ipc1 {
		t.Errorf("successor's IPC = %v; same handle: %v", err, ipc2 == ipc1)
	}
	if st := d2.Stats(); st.Blocks != 2 {
		t.Errorf("Stats = %+v, want 2 blocks", st)
	}
}

// TestHelperClaimEndsOtherSession checks that a successor's Claim has
// the helper refuse a live predecessor's calls, once its call in flight is
// answered, that Settle ends the predecessor's session without ending the
// helper, and its claim (the next successor claims in turn), and that a
// claimant gone unsettled gives the device back.
func TestHelperClaimEndsOtherSession(t *testing.T) {
	t.Setenv(SimStallEnv, "stats=300ms")
	d1 := startSim(t)
	door, pidfd, err := Door(d1)
	if err != nil {
		t.Fatal(err)
	}
	defer door.Close()
	defer pidfd.Close()
	b := alloc(t, d1, 10)

	// A successor that claims, then fails before it settles.
	failed, err := Attach(door, pidfd, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := failed.(Survivor).Claim(); err != nil {
		t.Fatal(err)
	}
	if _, err := d1.Alloc(10); !errors.Is(err, ErrUnavailable) {
		t.Errorf("predecessor's Alloc while a successor claims the device = %v, want ErrUnavailable", err)
	}
	failed.Close()
	if b2, err := d1.Alloc(10); err != nil {
		t.Errorf("predecessor's Alloc once the claimant is gone = %v", err)
	} else if err := d1.Free(b2); err != nil {
		t.Errorf("predecessor's Free = %v", err)
	}

	// A successor that claims and settles.
	d2, err := Attach(door, pidfd, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Close()
	inFlight := make(chan Stats)
	go func() { inFlight <- d1.Stats() }() // answered before the claim returns
	time.Sleep(50 * time.Millisecond)
	start := time.Now()
	owned, err := d2.(Survivor).Claim()
	if err != nil || len(owned) != 1 || owned[0].Block != b {
		t.Fatalf("Claim = %+v, %v; want block %v", owned, err, b)
	}
	if waited := time.Since(start); waited < 150*time.Millisecond {
		t.Errorf("Claim returned after %v, before the predecessor's call in flight", waited)
	}
	if st := <-inFlight; st.Blocks != 1 {
		t.Errorf("the predecessor's Stats in flight at the claim = %+v, want its answer", st)
	}
	if err := d2.(Survivor).Settle(); err != nil {
		t.Fatal(err)
	}
	if _, err := d1.Alloc(10); !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "successor") {
		t.Errorf("predecessor's Alloc after the settle = %v, want ErrUnavailable naming the successor", err)
	}
	if _, err := d2.Alloc(10); err != nil {
		t.Errorf("successor's Alloc = %v", err)
	}
	if err := d2.Free(b); err != nil {
		t.Errorf("successor's Free of the predecessor's block = %v", err)
	}

	// The settled claim is over: the next successor claims in turn.
	d3, err := Attach(door, pidfd, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d3.Close()
	if _, err := d3.(Survivor).Claim(); err != nil {
		t.Errorf("the next successor's Claim after a settle = %v", err)
	}
}
