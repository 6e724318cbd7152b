package gpu

import (
	"errors"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
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

// consumerCounter maps the counter file at path as a consumer does and
// returns its int64, unmapped at cleanup.
func consumerCounter(t *testing.T, path string) *int64 {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	mem, err := unix.Mmap(int(f.Fd()), 0, 8, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	return (*int64)(unsafe.Pointer(&mem[0]))
}

func TestCounters(t *testing.T) {
	path := filepath.Join(t.TempDir(), "counters")
	// What an earlier daemon left is removed.
	if err := os.Mkdir(path, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(path, "1"), make([]byte, 8), 0o666); err != nil {
		t.Fatal(err)
	}
	d, err := OpenCounterDir(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode() != os.ModeDir|0o711 {
		t.Errorf("counter directory: %v %v, want mode 0711", fi.Mode(), err)
	}
	if names, _ := os.ReadDir(path); len(names) != 0 {
		t.Errorf("counters of an earlier daemon left: %v", names)
	}

	a, err := d.New()
	if err != nil {
		t.Fatal(err)
	}
	b, err := d.New()
	if err != nil {
		t.Fatal(err)
	}
	if a.Path() == b.Path() || filepath.Dir(a.Path()) != path {
		t.Fatalf("counter paths %s, %s", a.Path(), b.Path())
	}
	for _, c := range []*Counter{a, b} {
		fi, err := os.Stat(c.Path())
		if err != nil || fi.Size() != 8 || fi.Mode() != 0o600 || c.Value() != 0 {
			t.Errorf("new counter %s: %v %v, value %d; want 8 bytes, mode 0600, zero", c.Path(), fi, err, c.Value())
		}
	}

	// A consumer counts with atomics; each file holds its own counter.
	ca, cb := consumerCounter(t, a.Path()), consumerCounter(t, b.Path())
	atomic.AddInt64(ca, 1)
	atomic.AddInt64(ca, 1)
	atomic.AddInt64(cb, 5)
	if a.Value() != 2 || b.Value() != 5 {
		t.Errorf("values %d, %d after increments; want 2, 5", a.Value(), b.Value())
	}
	atomic.AddInt64(ca, -2)
	if a.Value() != 0 || b.Value() != 5 {
		t.Errorf("values %d, %d after decrements; want 0, 5", a.Value(), b.Value())
	}

	// A counter a consumer truncated reads as zero; the daemon never maps it.
	if err := os.Truncate(b.Path(), 0); err != nil {
		t.Fatal(err)
	}
	if v := b.Value(); v != 0 {
		t.Errorf("value of a truncated counter = %d", v)
	}

	// Remove deletes the file; RemoveAll the rest and the directory.
	if err := a.Remove(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(a.Path()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("removed counter: %v", err)
	}
	if err := d.RemoveAll(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("counter directory after RemoveAll: %v", err)
	}
	if err := b.Remove(); err != nil {
		t.Errorf("Remove after RemoveAll: %v", err)
	}
}

func TestCounterFollow(t *testing.T) {
	d, err := OpenCounterDir(filepath.Join(t.TempDir(), "counters"))
	if err != nil {
		t.Fatal(err)
	}
	defer d.RemoveAll()
	c, err := d.New()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Remove()
	uid, gid := uint32(os.Geteuid()), uint32(os.Getegid())
	for _, tc := range []struct{ mode, want uint32 }{
		{0o644, 0o666}, {0o600, 0o600}, {0o640, 0o660}, {0o604, 0o606},
		{0o200, 0}, {0o755, 0o666}, {0o4444, 0o666}, {0o060, 0o060},
	} {
		if err := c.Follow(uid, gid, tc.mode); err != nil {
			t.Fatal(err)
		}
		var st unix.Stat_t
		if err := unix.Stat(c.Path(), &st); err != nil {
			t.Fatal(err)
		}
		if st.Mode&0o7777 != tc.want || st.Uid != uid || st.Gid != gid {
			t.Errorf("Follow(%d, %d, %#o): mode %#o, owner %d:%d; want %#o", uid, gid, tc.mode, st.Mode&0o7777, st.Uid, st.Gid, tc.want)
		}
	}
	if os.Geteuid() != 0 {
		t.Skip("changing the owner needs root")
	}
	if err := c.Follow(1000, 1001, 0o640); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(c.Path(), &st); err != nil || st.Uid != 1000 || st.Gid != 1001 || st.Mode&0o7777 != 0o660 {
		t.Errorf("Follow(1000, 1001, 0640): owner %d:%d mode %#o (%v)", st.Uid, st.Gid, st.Mode&0o7777, err)
	}
}

func TestCounterDirOfAnotherUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to make a directory of another user")
	}
	path := filepath.Join(t.TempDir(), "counters")
	if err := os.Mkdir(path, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(path, 1000, 1000); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenCounterDir(path); err == nil {
		t.Error("OpenCounterDir took a directory of uid 1000")
	}
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(t.TempDir(), link); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenCounterDir(link); err == nil {
		t.Error("OpenCounterDir followed a symbolic link")
	}
}
