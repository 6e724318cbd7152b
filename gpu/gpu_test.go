package gpu

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// helperEnv makes the test binary act as the helper process when Start
// runs it: "serve" is HelperMain as is, "crash-on-alloc" a helper whose
// device dies in Alloc with a last word on stderr.
const helperEnv = "TENSORFS_GPU_TEST_HELPER"

// cudaHelperEnv names a tensorfs-gpu built with -tags cuda that startSim
// runs with --backend cuda instead of a sim helper: for
// scripts/gpu-device-check.sh, on a machine with a GPU.
const cudaHelperEnv = "TENSORFS_TEST_GPU_HELPER"

const crashLine = "fake CUDA fault: an illegal memory access was encountered"

func TestMain(m *testing.M) {
	switch os.Getenv(childEnv) {
	case "counter-attack":
		os.Exit(runCounterAttack())
	case "removed-holder":
		os.Exit(runRemovedHolder())
	}
	if mode, ok := os.LookupEnv(helperEnv); ok && len(os.Args) > 1 && os.Args[1] == "gpu-helper" {
		if mode == "crash-on-alloc" {
			openBackend = func(string, int, func(int) (Device, error)) (Device, error) { return crashOnAlloc{NewSim(0, 0)}, nil }
		}
		os.Exit(HelperMain(os.Args[2:], os.Stderr, nil))
	}
	os.Setenv(helperEnv, "serve")
	// Under -race every process sleeps a second at exit; not the helpers.
	os.Setenv("GORACE", strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	os.Exit(m.Run())
}

// crashOnAlloc is a device that dies as a CUDA fault would kill a helper.
type crashOnAlloc struct{ *Sim }

func (crashOnAlloc) Alloc(int64) (Block, error) {
	fmt.Fprintln(os.Stderr, crashLine)
	os.Exit(3)
	panic("unreachable")
}

// startSim starts a sim helper from the test binary (a cuda one, if
// cudaHelperEnv names it), closed at cleanup.
func startSim(t *testing.T) Device {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	backend := "sim"
	if helper := os.Getenv(cudaHelperEnv); helper != "" {
		exe, backend = helper, "cuda"
	}
	d, err := Start(exe, backend, 0, nil)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return d
}

// forEachDevice runs f on a sim device, directly and through a helper
// process. At the end, the device must hold nothing: every test frees what
// it allocates.
func forEachDevice(t *testing.T, f func(t *testing.T, d Device)) {
	t.Run("sim", func(t *testing.T) {
		d := NewSim(0, 0)
		t.Cleanup(func() { d.Close() })
		f(t, d)
		checkEmpty(t, d)
	})
	t.Run("helper", func(t *testing.T) {
		d := startSim(t)
		f(t, d)
		checkEmpty(t, d)
	})
}

func checkEmpty(t *testing.T, d Device) {
	t.Helper()
	if st := d.Stats(); st != (Stats{}) {
		t.Errorf("device not empty at the end: %+v", st)
	}
}

func alloc(t *testing.T, d Device, size int64) Block {
	t.Helper()
	b, err := d.Alloc(size)
	if err != nil {
		t.Fatalf("Alloc(%d): %v", size, err)
	}
	return b
}

func free(t *testing.T, d Device, b Block) {
	t.Helper()
	if err := d.Free(b); err != nil {
		t.Fatalf("Free(%+v): %v", b, err)
	}
}

func ipc(t *testing.T, d Device, b Block) IPCInfo {
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

func TestName(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d Device) {
		if d.Name() != "cuda:0" || d.Backend() != "sim" {
			t.Errorf("Name, Backend = %q, %q; want cuda:0, sim", d.Name(), d.Backend())
		}
	})
}

func TestAllocFree(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d Device) {
		small := alloc(t, d, 100)
		big := alloc(t, d, simGranularity+1)
		if small.ID == 0 || big.ID == 0 || small.ID == big.ID || small.Size != 100 || big.Size != simGranularity+1 {
			t.Fatalf("blocks %+v %+v", small, big)
		}
		want := Stats{Blocks: 2, BlockBytes: 100 + simGranularity + 1, DeviceBytes: 3 * simGranularity}
		if st := d.Stats(); st != want {
			t.Errorf("Stats = %+v, want %+v", st, want)
		}
		free(t, d, small)
		if err := d.Free(small); !errors.Is(err, ErrNoBlock) {
			t.Errorf("second Free = %v, want ErrNoBlock", err)
		}
		if err := d.Free(Block{ID: big.ID, Size: big.Size + 1}); !errors.Is(err, ErrNoBlock) {
			t.Errorf("Free with a wrong size = %v, want ErrNoBlock", err)
		}
		free(t, d, big)
		for _, size := range []int64{0, -1} {
			if _, err := d.Alloc(size); !errors.Is(err, ErrInvalid) {
				t.Errorf("Alloc(%d) = %v, want ErrInvalid", size, err)
			}
		}
	})
}

// TestDeviceBytes: DeviceBytes says what a block really takes of the
// device, the helper's granularity included: the growth of Stats'
// DeviceBytes when the block is allocated, not the size asked.
func TestDeviceBytes(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d Device) {
		if g := d.Granularity(); g != simGranularity {
			t.Errorf("Granularity = %d, want %d", g, simGranularity)
		}
		if n := DeviceBytes(d, 0); n != 0 {
			t.Errorf("DeviceBytes(0) = %d, want 0", n)
		}
		for _, size := range []int64{1, 4096, simGranularity, simGranularity + 1, 5*simGranularity - 7} {
			before := d.Stats().DeviceBytes
			b := alloc(t, d, size)
			if got, want := DeviceBytes(d, size), d.Stats().DeviceBytes-before; got != want || got < size {
				t.Errorf("DeviceBytes(%d) = %d; the device allocated %d", size, got, want)
			}
			free(t, d, b)
		}
	})
}

// simAllocation opens the allocation that the sim IPC handle h names, as a
// consumer would map it, and returns its bytes.
func simAllocation(t *testing.T, h [64]byte) []byte {
	t.Helper()
	if string(h[:16]) != "tensorfs-sim-mem" {
		t.Fatalf("sim handle starts %q", h[:16])
	}
	pid, fd := binary.LittleEndian.Uint32(h[32:]), binary.LittleEndian.Uint32(h[36:])
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/fd/%d", pid, fd))
	if err != nil {
		t.Fatal(err)
	}
	if int64(len(b)) != int64(binary.LittleEndian.Uint64(h[24:])) {
		t.Errorf("allocation of %d bytes, handle says %d", len(b), binary.LittleEndian.Uint64(h[24:]))
	}
	return b
}

// TestOwnAllocation: every block has a zeroed device allocation of its
// own, so that its IPC handle reaches nothing but the block, even where
// freed blocks are reused.
func TestOwnAllocation(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d Device) {
		sizes := []int64{1, 511, 4096, 100000, simGranularity, simGranularity + 1}
		var blocks []Block
		handles := map[[64]byte]int64{}
		for _, size := range sizes {
			b := alloc(t, d, size)
			blocks = append(blocks, b)
			if err := d.CopyIn(b, 0, pattern(uint64(size), int(size))); err != nil {
				t.Fatal(err)
			}
			h := ipc(t, d, b).MemHandle
			if other, dup := handles[h]; dup {
				t.Errorf("blocks of %d and %d bytes share an IPC handle", other, size)
			}
			handles[h] = size
		}
		want := Stats{Blocks: len(sizes)}
		for _, size := range sizes {
			want.BlockBytes += size
			want.DeviceBytes += (size + simGranularity - 1) / simGranularity * simGranularity
		}
		if st := d.Stats(); st != want {
			t.Errorf("Stats = %+v, want %+v: one allocation per block, rounded to %d", st, want, simGranularity)
		}

		// A consumer of a handle sees its block's bytes, then zeros.
		for i, b := range blocks {
			mem := simAllocation(t, ipc(t, d, b).MemHandle)
			if !bytes.Equal(mem[:b.Size], pattern(uint64(b.Size), int(b.Size))) {
				t.Errorf("block %d: the allocation does not start with its bytes", i)
			}
			if !bytes.Equal(mem[b.Size:], make([]byte, int64(len(mem))-b.Size)) {
				t.Errorf("block %d: the allocation holds more than its bytes", i)
			}
		}

		// A block made after others were freed starts zeroed, all of it.
		for _, b := range blocks {
			free(t, d, b)
		}
		again := alloc(t, d, 100)
		if mem := simAllocation(t, ipc(t, d, again).MemHandle); !bytes.Equal(mem, make([]byte, len(mem))) {
			t.Error("a new block's allocation is not zeroed")
		}
		free(t, d, again)
	})
}

func TestCopy(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d Device) {
		// A small block after another, a large block, and one larger than
		// the helper's staging slots and the sim's staging buffers.
		neighbour := alloc(t, d, 777)
		for _, size := range []int64{100003, simGranularity + 5, 2*stagingSlot + 3*simStaging + 11} {
			b := alloc(t, d, size)
			want := pattern(uint64(size), int(size))
			for _, off := range []int64{0, 1, 7, 4097, size / 3} {
				src := pattern(uint64(off), int(size-off-off%5))
				if err := d.CopyIn(b, off, src); err != nil {
					t.Fatalf("CopyIn(%d bytes at %d) of %d: %v", len(src), off, size, err)
				}
				copy(want[off:], src)
			}
			got := make([]byte, size)
			if err := d.CopyOut(b, 0, got); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("block of %d bytes: CopyOut differs from what CopyIn wrote", size)
			}
			part := make([]byte, size/2+1)
			if err := d.CopyOut(b, size/2-1, part); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(part, want[size/2-1:size-1]) {
				t.Fatalf("block of %d bytes: CopyOut at an odd offset differs", size)
			}
			free(t, d, b)
		}

		// Out of range, and empty.
		if err := d.CopyIn(neighbour, 700, make([]byte, 78)); !errors.Is(err, ErrInvalid) {
			t.Errorf("CopyIn past the end = %v, want ErrInvalid", err)
		}
		if err := d.CopyOut(neighbour, -1, make([]byte, 1)); !errors.Is(err, ErrInvalid) {
			t.Errorf("CopyOut at -1 = %v, want ErrInvalid", err)
		}
		if err := d.CopyIn(neighbour, 777, nil); err != nil {
			t.Errorf("empty CopyIn at the end = %v", err)
		}
		free(t, d, neighbour)
		if err := d.CopyIn(neighbour, 0, []byte{1}); !errors.Is(err, ErrNoBlock) {
			t.Errorf("CopyIn to a freed block = %v, want ErrNoBlock", err)
		}
	})
}

func TestCopyFile(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d Device) {
		const size = 3*simStaging + 12345 // several staging buffers and a partial one
		content := pattern(1, size+1000)
		path := filepath.Join(t.TempDir(), "tensor")
		if err := os.WriteFile(path, content, 0o600); err != nil {
			t.Fatal(err)
		}
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		fd := int(f.Fd())

		for _, bsize := range []int64{size + 3, simGranularity + 7} {
			b := alloc(t, d, bsize)
			for _, c := range []struct{ off, fileOff, n int64 }{
				{0, 0, size}, {3, 999, size}, {1, 13, simStaging}, {5, 17, simStaging*2 + 1}, {2, 1, 0},
			} {
				if err := d.CopyFromFile(b, c.off, fd, c.fileOff, c.n); err != nil {
					t.Fatalf("CopyFromFile%+v: %v", c, err)
				}
				got := make([]byte, c.n)
				if err := d.CopyOut(b, c.off, got); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, content[c.fileOff:c.fileOff+c.n]) {
					t.Fatalf("CopyFromFile%+v: block differs from the file", c)
				}
			}

			// Back to the file at an odd offset, past its end.
			want := make([]byte, size)
			if err := d.CopyOut(b, 3, want); err != nil {
				t.Fatal(err)
			}
			fileOff := int64(len(content) + 4099)
			if err := d.CopyToFile(b, 3, fd, fileOff, size); err != nil {
				t.Fatalf("CopyToFile: %v", err)
			}
			got := make([]byte, size)
			if _, err := f.ReadAt(got, fileOff); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatal("CopyToFile: file differs from the block")
			}
			free(t, d, b)
		}

		b := alloc(t, d, 100)
		if err := d.CopyFromFile(b, 0, fd, 1<<40, 10); !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Errorf("CopyFromFile past the end of the file = %v, want io.ErrUnexpectedEOF", err)
		}
		if err := d.CopyFromFile(b, 50, fd, 0, 51); !errors.Is(err, ErrInvalid) {
			t.Errorf("CopyFromFile past the end of the block = %v, want ErrInvalid", err)
		}
		if err := d.CopyToFile(b, 0, -1, 0, 10); err == nil {
			t.Error("CopyToFile to fd -1 succeeded")
		}
		free(t, d, b)
	})
}

func TestIPC(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d Device) {
		a, b := alloc(t, d, 1000), alloc(t, d, 1000)
		big := alloc(t, d, simGranularity*2)
		ia, ib, ibig := ipc(t, d, a), ipc(t, d, b), ipc(t, d, big)
		if again := ipc(t, d, a); again != ia {
			t.Error("IPC info of a block changed between calls")
		}
		if err := d.CopyIn(a, 0, []byte("write")); err != nil {
			t.Fatal(err)
		}
		if again := ipc(t, d, a); again != ia {
			t.Error("IPC info of a block changed after a write")
		}
		if ia.MemHandle == ib.MemHandle || ia.EventHandle == ib.EventHandle || ia.MemHandle == ibig.MemHandle {
			t.Error("distinct blocks and allocations share handles")
		}
		if ia.MemHandle == ([64]byte{}) || ia.EventHandle == ([64]byte{}) {
			t.Error("zero handle")
		}

		// The sim handle names the memfd: the bytes are there.
		src := pattern(9, int(b.Size))
		if err := d.CopyIn(b, 0, src); err != nil {
			t.Fatal(err)
		}
		if got := simAllocation(t, ib.MemHandle); !bytes.Equal(got[:len(src)], src) {
			t.Error("the allocation of the IPC handle does not hold the block's bytes")
		}
		for _, blk := range []Block{a, b, big} {
			free(t, d, blk)
		}
	})
}

func TestExport(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d Device) {
		const size = 3<<20 + 5
		b, err := d.AllocExportable(size)
		if err != nil {
			t.Fatal(err)
		}
		src := pattern(3, size)
		if err := d.CopyIn(b, 0, src); err != nil {
			t.Fatal(err)
		}
		f, err := d.Export(b)
		if err != nil {
			t.Fatalf("Export: %v", err)
		}
		defer f.Close()
		mem, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Munmap(mem)
		if !bytes.Equal(mem, src) {
			t.Error("exported fd does not hold the block's bytes")
		}
		copy(mem[1000:], "written through the export")
		got := make([]byte, 26)
		if err := d.CopyOut(b, 1000, got); err != nil || string(got) != "written through the export" {
			t.Errorf("CopyOut after a write through the export = %q, %v", got, err)
		}
		if st := d.Stats(); st.DeviceBytes%simGranularity != 0 || st.Blocks != 1 {
			t.Errorf("exportable allocation: %+v; want its own, rounded to the granularity", st)
		}
		if _, err := d.IPC(b); !errors.Is(err, ErrNoIPC) {
			t.Errorf("IPC of an exportable block = %v, want ErrNoIPC", err)
		}
		small := alloc(t, d, 10)
		if _, err := d.Export(small); !errors.Is(err, ErrNotExportable) {
			t.Errorf("Export of a block from Alloc = %v, want ErrNotExportable", err)
		}
		free(t, d, small)
		free(t, d, b)
	})
}

func TestOutOfMemory(t *testing.T) {
	d := NewSim(1, 3*simGranularity)
	defer d.Close()
	if d.Name() != "cuda:1" {
		t.Errorf("Name = %q", d.Name())
	}
	b1 := alloc(t, d, 2*simGranularity+1) // rounded up: the whole device
	if _, err := d.Alloc(1); !errors.Is(err, ErrOutOfMemory) {
		t.Fatalf("Alloc past the capacity = %v, want ErrOutOfMemory", err)
	}
	free(t, d, b1)
	free(t, d, alloc(t, d, 3*simGranularity))

	h := startSim(t)
	if _, err := h.Alloc(DefaultSimCapacity + 1); !errors.Is(err, ErrOutOfMemory) {
		t.Fatalf("helper: Alloc past the capacity = %v, want ErrOutOfMemory", err)
	}
}

func TestConcurrent(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d Device) {
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for g := range 8 {
			wg.Go(func() {
				for i := range 20 {
					size := int64(1 + (g*7919+i*104729)%(simGranularity/8))
					if i%10 == 9 {
						size += simGranularity // and a few large ones
					}
					b, err := d.Alloc(size)
					if err != nil {
						errs <- err
						return
					}
					src := pattern(uint64(g*100+i), int(size))
					got := make([]byte, size)
					if err := d.CopyIn(b, 0, src); err != nil {
						errs <- err
						return
					}
					if err := d.CopyOut(b, 0, got); err != nil {
						errs <- err
						return
					}
					if !bytes.Equal(got, src) {
						errs <- fmt.Errorf("goroutine %d block %d: bytes differ", g, i)
						return
					}
					if err := d.Free(b); err != nil {
						errs <- err
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
	})
}

func TestClosed(t *testing.T) {
	d := NewSim(0, 0)
	b := alloc(t, d, 10)
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Alloc(10); !errors.Is(err, ErrUnavailable) {
		t.Errorf("Alloc after Close = %v, want ErrUnavailable", err)
	}
	if err := d.CopyIn(b, 0, []byte{1}); !errors.Is(err, ErrUnavailable) {
		t.Errorf("CopyIn after Close = %v, want ErrUnavailable", err)
	}
}

func TestUnavailable(t *testing.T) {
	d, err := Start("/nonexistent", "none", 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	if d.Name() != "none" || d.Backend() != "none" {
		t.Errorf("Name, Backend = %q, %q", d.Name(), d.Backend())
	}
	if _, err := d.Alloc(1); !errors.Is(err, ErrUnavailable) {
		t.Errorf("Alloc = %v, want ErrUnavailable", err)
	}
	if st := d.Stats(); st != (Stats{}) || d.Close() != nil {
		t.Error("Stats or Close of none")
	}
}
