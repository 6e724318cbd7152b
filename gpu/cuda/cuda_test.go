//go:build cuda

package cuda

// Tests of the real backend. The test binary links libcuda.so.1 and
// gorgonia.org/cu's init exits it where cuInit fails: build it anywhere
// (go test -c -tags cuda), run it where a GPU is.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
	"gorgonia.org/cu"

	"tensorfs/gpu"
	"tensorfs/gpu/internal/devmem"
)

// TestMain makes the test binary the cuda helper process when Start runs
// it, as tensorfs-gpu is.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == "gpu-helper" {
		os.Exit(gpu.HelperMain(os.Args[2:], os.Stderr, Open))
	}
	os.Exit(m.Run())
}

func openCUDA(t testing.TB) *cudaDevice {
	t.Helper()
	d, err := Open(0)
	if err != nil {
		t.Fatalf("Open(0): %v", err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return d.(*cudaDevice)
}

// roundTrip writes a pattern into b at an odd offset and reads it back.
func roundTrip(t *testing.T, d gpu.Device, b gpu.Block) {
	t.Helper()
	off := b.Size / 3
	src := pattern(uint64(b.Size), int(b.Size-off))
	if err := d.CopyIn(b, off, src); err != nil {
		t.Fatalf("CopyIn %d bytes at %d: %v", len(src), off, err)
	}
	got := make([]byte, len(src))
	if err := d.CopyOut(b, off, got); err != nil {
		t.Fatalf("CopyOut: %v", err)
	}
	if !bytes.Equal(got, src) {
		t.Fatalf("block of %d bytes: CopyOut differs from CopyIn", b.Size)
	}
}

func TestCUDA(t *testing.T) {
	d := openCUDA(t)
	if d.Name() != "cuda:0" || d.Backend() != "cuda" {
		t.Errorf("Name, Backend = %q, %q", d.Name(), d.Backend())
	}
	var blocks []gpu.Block
	for _, size := range []int64{1001, 5000, ipcGranularity + 1, 3*cudaStaging + 5} {
		b := alloc(t, d, size)
		// Zeroed, past the block's end too: an IPC handle maps it all.
		a, release, err := d.table.Acquire(devmem.Block(b), 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		if a.Size%ipcGranularity != 0 || a.Size < size {
			t.Errorf("block of %d bytes in an allocation of %d", size, a.Size)
		}
		all := make([]byte, a.Size)
		err = d.run(func() error {
			return cuWrap("cuMemcpyDtoH", cu.MemcpyDtoH(unsafe.Pointer(&all[0]), a.Mem.ptr, a.Size))
		})
		release()
		if err != nil || !bytes.Equal(all, make([]byte, a.Size)) {
			t.Errorf("allocation of a new block of %d bytes not zeroed (%v)", size, err)
		}
		roundTrip(t, d, b)
		blocks = append(blocks, b)
	}

	// IPC: non-zero handles, stable, one allocation per block.
	i0, i1 := ipc(t, d, blocks[0]), ipc(t, d, blocks[1])
	if i0.MemHandle == ([64]byte{}) || i0.EventHandle == ([64]byte{}) {
		t.Error("zero IPC handle")
	}
	if i0.MemHandle == i1.MemHandle || i0.EventHandle == i1.EventHandle {
		t.Error("two small blocks share an IPC handle")
	}
	roundTrip(t, d, blocks[0]) // records the event after the write
	if again := ipc(t, d, blocks[0]); again != i0 {
		t.Error("IPC info changed after a write")
	}

	// A copy from memory registered with pin goes direct.
	host, err := unix.Mmap(-1, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(host)
	unpin, err := d.Pin(host)
	if err != nil {
		t.Fatalf("pin: %v", err)
	}
	copy(host, pattern(5, len(host)))
	if !d.isPinned(host[7:1000]) {
		t.Error("pinned memory not recognised")
	}
	if err := d.CopyIn(blocks[2], 13, host[7:]); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(host)-7)
	if err := d.CopyOut(blocks[2], 13, got); err != nil || !bytes.Equal(got, host[7:]) {
		t.Fatalf("direct CopyIn: %v, equal %v", err, bytes.Equal(got, host[7:]))
	}
	if err := unpin(); err != nil {
		t.Errorf("unpin: %v", err)
	}

	// File copies at odd offsets, larger than the staging buffers.
	n := int64(2*cudaStaging + 12345)
	content := pattern(8, int(n+100))
	path := filepath.Join(t.TempDir(), "tensor")
	if err := os.WriteFile(path, content, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	big := blocks[3]
	if err := d.CopyFromFile(big, 3, int(f.Fd()), 99, n); err != nil {
		t.Fatalf("CopyFromFile: %v", err)
	}
	if err := d.CopyToFile(big, 3, int(f.Fd()), n+1000, n); err != nil {
		t.Fatalf("CopyToFile: %v", err)
	}
	back := make([]byte, n)
	if _, err := f.ReadAt(back, n+1000); err != nil || !bytes.Equal(back, content[99:99+n]) {
		t.Fatalf("file → device → file differs (%v)", err)
	}

	// Exportable memory, where the device has it.
	eb, err := d.AllocExportable(3<<20 + 1)
	switch {
	case errors.Is(err, gpu.ErrNotExportable):
		t.Logf("no exportable memory: %v", err)
	case err != nil:
		t.Fatalf("AllocExportable: %v", err)
	default:
		roundTrip(t, d, eb)
		ef, err := d.Export(eb)
		if err != nil {
			t.Fatalf("Export: %v", err)
		}
		ef.Close()
		if _, err := d.IPC(eb); !errors.Is(err, gpu.ErrNoIPC) {
			t.Errorf("IPC of an exportable block = %v", err)
		}
		free(t, d, eb)
	}
	if _, err := d.Export(blocks[0]); !errors.Is(err, gpu.ErrNotExportable) {
		t.Errorf("Export of a block from Alloc = %v", err)
	}

	for _, b := range blocks {
		free(t, d, b)
	}
	checkEmpty(t, d)
}

func TestCUDAHelper(t *testing.T) {
	d, err := gpu.Start(testExe(t), "cuda", 0, nil)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	defer d.Close()
	if d.Backend() != "cuda" {
		t.Errorf("Backend = %q", d.Backend())
	}
	b := alloc(t, d, 9<<20) // through the pinned staging area, 4 MiB slots
	roundTrip(t, d, b)
	if info := ipc(t, d, b); info.MemHandle == ([64]byte{}) {
		t.Error("zero IPC handle")
	}
	free(t, d, b)
	checkEmpty(t, d)
}

// BenchmarkCUDAUpload compares, in one run, CopyFromFile of a file in the
// page cache with a raw cuMemcpyHtoD from pinned memory of the same size,
// and CopyIn from ordinary Go memory.
func BenchmarkCUDAUpload(b *testing.B) {
	const size = 256 << 20
	d := openCUDA(b)
	blk, err := d.Alloc(size)
	if err != nil {
		b.Fatal(err)
	}
	defer d.Free(blk)
	src := pattern(1, size)
	path := filepath.Join(b.TempDir(), "tensor")
	if err := os.WriteFile(path, src, 0o600); err != nil {
		b.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()

	b.Run("CopyFromFile", func(b *testing.B) {
		b.SetBytes(size)
		for b.Loop() {
			if err := d.CopyFromFile(blk, 0, int(f.Fd()), 0, size); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("RawPinnedHtoD", func(b *testing.B) {
		host, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			b.Fatal(err)
		}
		defer unix.Munmap(host)
		copy(host, src)
		unpin, err := d.Pin(host)
		if err != nil {
			b.Fatal(err)
		}
		defer unpin()
		a, release, err := d.table.Acquire(devmem.Block(blk), 0, size)
		if err != nil {
			b.Fatal(err)
		}
		defer release()
		b.SetBytes(size)
		for b.Loop() {
			err := d.run(func() error {
				return cuWrap("cuMemcpyHtoD", cu.MemcpyHtoD(a.Mem.ptr, unsafe.Pointer(&host[0]), size))
			})
			if err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("CopyIn", func(b *testing.B) {
		b.SetBytes(size)
		for b.Loop() {
			if err := d.CopyIn(blk, 0, src); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func testExe(t *testing.T) string {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return exe
}

func checkEmpty(t *testing.T, d gpu.Device) {
	t.Helper()
	if st := d.Stats(); st != (gpu.Stats{}) {
		t.Errorf("device not empty at the end: %+v", st)
	}
}

func alloc(t *testing.T, d gpu.Device, size int64) gpu.Block {
	t.Helper()
	b, err := d.Alloc(size)
	if err != nil {
		t.Fatalf("Alloc(%d): %v", size, err)
	}
	return b
}

func free(t *testing.T, d gpu.Device, b gpu.Block) {
	t.Helper()
	if err := d.Free(b); err != nil {
		t.Fatalf("Free(%+v): %v", b, err)
	}
}

func ipc(t *testing.T, d gpu.Device, b gpu.Block) gpu.IPCInfo {
	t.Helper()
	info, err := d.IPC(b)
	if err != nil {
		t.Fatalf("IPC(%+v): %v", b, err)
	}
	return info
}

// pattern returns n bytes that differ with seed.
func pattern(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, 0x7e45))
	b := make([]byte, n+7)
	for i := 0; i < n; i += 8 {
		binary.LittleEndian.PutUint64(b[i:], r.Uint64())
	}
	return b[:n]
}
