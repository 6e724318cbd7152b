package fs

import (
	"syscall"
	"testing"
	"time"

	"tensorfs/ledger"
)

// newBudget is a row of a ledger of its own, refused as the descriptors'
// row is, for tests that bound one thing.
func newBudget(what string, perUID, total int) *ledger.Row {
	return ledger.New().Row(ledger.Spec{Name: what, Unit: "one", PerUID: int64(perUID), Total: int64(total),
		Over: syscall.EMFILE, Full: syscall.ENFILE})
}

// TestOneAtATime: a uid's second request waits for its first, while
// another uid's goes on: one user's many threads asking for whole-tree
// walks get one walk's worth of the daemon at a time.
func TestOneAtATime(t *testing.T) {
	var o oneAtATime
	unlock := o.lock(1000)
	second := make(chan struct{})
	go func() {
		defer o.lock(1000)()
		close(second)
	}()
	done := make(chan struct{})
	go func() {
		defer o.lock(1001)()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("uid 1001 waited for uid 1000's walk")
	}
	select {
	case <-second:
		t.Fatal("uid 1000's second walk ran beside its first")
	case <-time.After(50 * time.Millisecond):
	}
	unlock()
	select {
	case <-second:
	case <-time.After(10 * time.Second):
		t.Fatal("uid 1000's second walk did not run after its first")
	}
}
