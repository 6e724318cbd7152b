package gpu

import (
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

func TestLimbo(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d Device) {
		l := NewLimbo(d)
		var refs [3]atomic.Int64
		var blocks [3]Block
		for i := range blocks {
			blocks[i] = alloc(t, d, int64(100*(i+1)))
			refs[i].Store(1)
			l.Add(blocks[i], func() bool { return refs[i].Load() > 0 })
		}
		if n, bytes := l.Stats(); n != 3 || bytes != 600 {
			t.Errorf("Stats = %d, %d; want 3, 600", n, bytes)
		}
		if freed := l.Collect(); freed != 0 {
			t.Errorf("Collect freed %d referenced blocks", freed)
		}
		refs[0].Store(0)
		refs[2].Store(0)
		if freed := l.Collect(); freed != 2 {
			t.Errorf("Collect freed %d, want 2", freed)
		}
		if n, bytes := l.Stats(); n != 1 || bytes != 200 {
			t.Errorf("Stats = %d, %d; want 1, 200", n, bytes)
		}
		if err := d.Free(blocks[0]); !errors.Is(err, ErrNoBlock) {
			t.Errorf("block still allocated after Collect: %v", err)
		}
		if st := d.Stats(); st.Blocks != 1 {
			t.Errorf("device holds %d blocks, want 1", st.Blocks)
		}
		refs[1].Store(0)
		if freed := l.Collect(); freed != 1 {
			t.Errorf("Collect freed %d, want 1", freed)
		}
		if n, bytes := l.Stats(); n != 0 || bytes != 0 {
			t.Errorf("Stats = %d, %d; want empty", n, bytes)
		}
	})
}

func TestRefCounters(t *testing.T) {
	path := filepath.Join(t.TempDir(), "refcounts")
	if err := os.WriteFile(path, make([]byte, 8*4+5), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	r, err := NewRefCounters(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()

	// A consumer maps the file on its own and counts with atomics.
	cf, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer cf.Close()
	consumer, err := unix.Mmap(int(cf.Fd()), 0, 32, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(consumer)
	counter := func(off int64) *int64 { return (*int64)(unsafe.Pointer(&consumer[off])) }

	var slots []int64
	for range 4 {
		off, err := r.Slot()
		if err != nil {
			t.Fatal(err)
		}
		slots = append(slots, off)
	}
	if _, err := r.Slot(); !errors.Is(err, ErrNoSlots) {
		t.Fatalf("fifth Slot = %v, want ErrNoSlots", err)
	}
	seen := map[int64]bool{}
	for _, off := range slots {
		if off%8 != 0 || seen[off] || r.Value(off) != 0 {
			t.Fatalf("slots %v", slots)
		}
		seen[off] = true
	}

	atomic.AddInt64(counter(slots[2]), 1)
	atomic.AddInt64(counter(slots[2]), 1)
	if v := r.Value(slots[2]); v != 2 {
		t.Errorf("Value = %d after two increments", v)
	}
	atomic.AddInt64(counter(slots[2]), -2)
	if v := r.Value(slots[2]); v != 0 {
		t.Errorf("Value = %d after decrements", v)
	}

	// A released slot is handed out again, reset.
	atomic.StoreInt64(counter(slots[1]), 42)
	r.Release(slots[1])
	off, err := r.Slot()
	if err != nil || off != slots[1] || r.Value(off) != 0 || atomic.LoadInt64(counter(off)) != 0 {
		t.Errorf("Slot after Release = %d, %v (value %d); want %d, reset", off, err, r.Value(off), slots[1])
	}

	defer func() {
		if recover() == nil {
			t.Error("Value of an unaligned offset did not panic")
		}
	}()
	r.Value(3)
}

func TestRefCountersEmptyFile(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "empty"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := NewRefCounters(f); !errors.Is(err, ErrInvalid) {
		t.Errorf("NewRefCounters of an empty file = %v, want ErrInvalid", err)
	}
}
