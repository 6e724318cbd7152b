package ledger

import (
	"errors"
	"sync"
	"syscall"
	"testing"
)

func TestRowBoundsPerUIDTotalAndRootReserve(t *testing.T) {
	l := New()
	r := l.Row(Spec{Name: "descriptors", Unit: "descriptor", PerUID: 3, Total: 16, Over: syscall.EMFILE, Full: syscall.ENFILE})

	// One user stops at its share; another is still served.
	for range 3 {
		if err := r.Take(1000, 1); err != nil {
			t.Fatalf("take within share: %v", err)
		}
	}
	if err := r.Take(1000, 1); !errors.Is(err, syscall.EMFILE) {
		t.Fatalf("take past share = %v, want EMFILE", err)
	}
	if err := r.Take(1001, 2); err != nil {
		t.Fatalf("another user: %v", err)
	}

	// Users together stop at the total less root's eighth (14); root goes on.
	for uid := uint32(1002); r.Held(uid) == 0; uid++ {
		if err := r.Take(uid, 3); err != nil {
			if !errors.Is(err, syscall.ENFILE) {
				t.Fatalf("users filling the row: %v, want ENFILE", err)
			}
			break
		}
	}
	u := l.Usage()[0]
	if u.Used > 14 || u.Root != 2 {
		t.Fatalf("users hold %d (root reserve %d), want at most 14 and a reserve of 2", u.Used, u.Root)
	}
	for u.Used < 16 {
		if err := r.Take(0, 1); err != nil {
			t.Fatalf("root within the total: %v", err)
		}
		u.Used++
	}
	if err := r.Take(0, 1); !errors.Is(err, syscall.ENFILE) {
		t.Fatalf("root past the total = %v, want ENFILE", err)
	}

	// A refusal changed nothing; gives bring the row back to empty.
	if got := r.Held(1000); got != 3 {
		t.Fatalf("uid 1000 holds %d after a refusal, want 3", got)
	}
	for uid, n := range l.Usage()[0].ByUID {
		r.Give(uid, n)
	}
	if u := l.Usage()[0]; u.Used != 0 || u.ByUID != nil || u.Peak != 16 {
		t.Fatalf("after giving everything back: %+v", u)
	}
}

func TestRowAmounts(t *testing.T) {
	r := New().Row(Spec{Name: "published bytes", Unit: "byte", PerUID: 100, Total: 800, Over: syscall.EDQUOT, Full: syscall.ENOSPC})
	if err := r.Take(7, 60); err != nil {
		t.Fatal(err)
	}
	if err := r.Take(7, 41); !errors.Is(err, syscall.EDQUOT) {
		t.Fatalf("take past share = %v, want EDQUOT", err)
	}
	r.Add(7, 100) // restored: charged whatever the bounds
	if got := r.Held(7); got != 160 {
		t.Fatalf("held %d, want 160", got)
	}
	if err := r.Take(7, 1); !errors.Is(err, syscall.EDQUOT) {
		t.Fatalf("take over an added share = %v, want EDQUOT", err)
	}
}

func TestRowDefaultsToEAGAINAndCountsDrift(t *testing.T) {
	l := New()
	r := l.Row(Spec{Name: "connections", Unit: "connection", PerUID: 1, Total: 8})
	r.Take(5, 1)
	if err := r.Take(5, 1); !errors.Is(err, syscall.EAGAIN) {
		t.Fatalf("refusal = %v, want EAGAIN", err)
	}
	r.Give(5, 2) // one more than held: a caller's bug, never a crash
	if u := l.Usage()[0]; u.Used != 0 || u.Drift != 1 || r.Held(5) != 0 {
		t.Fatalf("after giving 2 of 1: %+v", u)
	}
}

func TestRowConcurrent(t *testing.T) {
	r := New().Row(Spec{Name: "threads", Unit: "thread", PerUID: 50, Total: 1 << 20})
	var wg sync.WaitGroup
	for uid := range uint32(8) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 1000 {
				if err := r.Take(uid+1, 1); err == nil {
					r.Give(uid+1, 1)
				}
			}
		}()
	}
	wg.Wait()
	for uid := range uint32(8) {
		if n := r.Held(uid + 1); n != 0 {
			t.Fatalf("uid %d holds %d after balanced takes and gives", uid+1, n)
		}
	}
}

func TestRowAddedTwicePanics(t *testing.T) {
	l := New()
	l.Row(Spec{Name: "x", Unit: "x", PerUID: 1, Total: 1})
	defer func() {
		if recover() == nil {
			t.Fatal("a second row of the same name did not panic")
		}
	}()
	l.Row(Spec{Name: "x", Unit: "x", PerUID: 1, Total: 1})
}
