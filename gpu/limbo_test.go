package gpu

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
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
		if k := l.Kept(); k != 3 {
			t.Errorf("Kept = %d after a Collect kept 3 blocks", k)
		}
		refs[0].Store(0)
		refs[2].Store(0)
		if freed := l.Collect(); freed != 2 {
			t.Errorf("Collect freed %d, want 2", freed)
		}
		if n, bytes := l.Stats(); n != 1 || bytes != 200 {
			t.Errorf("Stats = %d, %d; want 1, 200", n, bytes)
		}
		if k := l.Kept(); k != 4 {
			t.Errorf("Kept = %d after Collects kept 3 blocks, then 1", k)
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

// TestLimboConcurrentCollect: a Collect called while another runs waits
// for it and counts what it frees, so a caller that collects after an
// out-of-memory error never misses blocks the periodic collector holds.
func TestLimboConcurrentCollect(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d Device) {
		l := NewLimbo(d)
		entered, gate := make(chan struct{}), make(chan struct{})
		var once sync.Once
		l.Add(alloc(t, d, 100), func() bool {
			once.Do(func() { close(entered); <-gate })
			return false
		})
		var ref atomic.Int64
		ref.Store(1)
		l.Add(alloc(t, d, 200), func() bool { return ref.Load() > 0 })

		first, second := make(chan int, 1), make(chan int, 1)
		go func() { first <- l.Collect() }()
		<-entered    // the first Collect runs, stopped in the first predicate
		ref.Store(0) // the second block becomes free meanwhile
		go func() { second <- l.Collect() }()
		select {
		case n := <-second:
			t.Fatalf("a Collect during another returned %d at once; want it to wait", n)
		case <-time.After(100 * time.Millisecond):
		}
		close(gate)
		if n := <-first; n != 2 {
			t.Errorf("first Collect freed %d, want 2", n)
		}
		if n := <-second; n != 2 {
			t.Errorf("second Collect reports %d freed during its call, want 2", n)
		}
		if n, bytes := l.Stats(); n != 0 || bytes != 0 {
			t.Errorf("Stats = %d, %d; want empty", n, bytes)
		}
	})
}

// TestLimboCollectRace: with a collector running all the time, a block
// unreferenced when Collect is called has left the limbo when it returns.
func TestLimboCollectRace(t *testing.T) {
	d := NewSim(0, 0)
	defer d.Close()
	l := NewLimbo(d)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
				l.Collect()
			}
		}
	})
	defer func() { close(stop); wg.Wait() }()
	for i := range 300 {
		var ref atomic.Int64
		ref.Store(1)
		b := alloc(t, d, 100)
		l.Add(b, func() bool { return ref.Load() > 0 })
		ref.Store(0)
		l.Collect()
		if n, _ := l.Stats(); n != 0 {
			t.Fatalf("round %d: %d blocks in limbo after a Collect called once they were free", i, n)
		}
		if err := d.Free(b); !errors.Is(err, ErrNoBlock) {
			t.Fatalf("round %d: block still allocated after Collect: %v", i, err)
		}
	}
}
