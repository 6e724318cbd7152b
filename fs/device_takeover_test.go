package fs

import (
	"encoding/json"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"tensorfs/gpu"
)

// survivingSim is a sim whose blocks carry tags, as a helper's do.
type survivingSim struct {
	*gpu.Sim
	mu   sync.Mutex
	tags map[gpu.Block][]byte
}

func (s *survivingSim) Tag(b gpu.Block, tag []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.tags[b] = tag
	return nil
}

func (s *survivingSim) Settle() error { return nil }

func (s *survivingSim) Claim() ([]gpu.Owned, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []gpu.Owned
	for b, t := range s.tags {
		out = append(out, gpu.Owned{Block: b, Tag: t})
	}
	return out, nil
}

// TestClaimDevicesLimbo: a successor's blocks that no segment claims wait
// in limbo while their counter counts (charged to their tag's uid), or
// until unmount when their counter could not be adopted; untagged ones
// and those whose counter is gone are freed at once.
func TestClaimDevicesLimbo(t *testing.T) {
	fsys := testFS(t)
	dev := &survivingSim{Sim: gpu.NewSim(0, 1<<30), tags: map[gpu.Block][]byte{}}
	d, err := newDevices(dev, fsys.store, fsys.ledger, fsys.handles, filepath.Join(t.TempDir(), "mnt"), nil, true, fsys.log)
	if err != nil {
		t.Fatal(err)
	}
	// A successor that never served leaves the counters to its
	// predecessor (spill); this one has none, so the test removes them
	// (their tmpfs is mounted under /run/tensorfs, not in TempDir).
	t.Cleanup(func() {
		if err := d.counters.RemoveAll(); err != nil {
			t.Errorf("counters: %v", err)
		}
	})
	fsys.gpu = d
	counted, err := d.counters.New() // a predecessor's counter of a removed segment
	if err != nil {
		t.Fatal(err)
	}
	counterPath := counted.Path()
	foreign := filepath.Join(filepath.Dir(counterPath), "7") // not the daemon's: cannot be adopted
	if err := os.WriteFile(foreign, make([]byte, 8), 0o600); err == nil {
		err = os.Chown(foreign, 1000, 1000)
	}
	if err != nil {
		t.Fatal(err)
	}
	const uid = 1000
	block := func(tag *blockTag) gpu.Block {
		b, err := dev.Alloc(1 << 20)
		if err != nil {
			t.Fatal(err)
		}
		var raw []byte // untagged: listed all the same, as a helper's are
		if tag != nil {
			raw, _ = json.Marshal(tag)
		}
		dev.Tag(b, raw)
		return b
	}
	block(&blockTag{Ino: 11, UID: uid, Counter: counted.Name()})
	block(&blockTag{Ino: 12, UID: uid, Counter: "99"}) // counter gone
	block(nil)                                         // untagged
	block(&blockTag{Ino: 13, UID: uid, Counter: "7"})  // counter not adoptable
	if n, err := unix.Pwrite(counterFd(t, counterPath), []byte{1, 0, 0, 0, 0, 0, 0, 0}, 0); n != 8 || err != nil {
		t.Fatal(n, err)
	}

	fsys.claimDevices(nil)
	want := 2 * gpu.DeviceBytes(dev, 1<<20)
	if blocks, _ := d.limbo.Stats(); blocks != 2 || dev.Stats().Blocks != 2 {
		t.Fatalf("limbo holds %d blocks, the device %d; want the two with a counter", blocks, dev.Stats().Blocks)
	}
	if got := d.limboShare.Held(uid); got != want {
		t.Errorf("uid %d is charged %d bytes of limbo, want %d", uid, got, want)
	}
	if got := d.owners.Held(uid); got != 1 {
		t.Errorf("uid %d is charged %d counters, want the one adopted", uid, got)
	}
	d.limbo.Collect()
	if blocks, _ := d.limbo.Stats(); blocks != 2 {
		t.Fatalf("limbo holds %d blocks after a collection with the counter at 1, want 2", blocks)
	}
	if n, err := unix.Pwrite(counterFd(t, counterPath), make([]byte, 8), 0); n != 8 || err != nil {
		t.Fatal(n, err)
	}
	d.limbo.Collect()
	if blocks, _ := d.limbo.Stats(); blocks != 1 || dev.Stats().Blocks != 1 {
		t.Errorf("limbo holds %d blocks, the device %d, once the counter is 0; want the unadoptable counter's alone", blocks, dev.Stats().Blocks)
	}
	if got := d.limboShare.Held(uid); got != want/2 {
		t.Errorf("uid %d is charged %d bytes of limbo, want %d", uid, got, want/2)
	}
	if _, err := os.Stat(counterPath); !os.IsNotExist(err) {
		t.Errorf("the adopted counter of a removed segment outlives its last block: %v", err)
	}
}

// counterFd opens the counter file at path for writing, closed at cleanup.
func counterFd(t *testing.T, path string) int {
	t.Helper()
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}
