package fs

import (
	"os"
	"runtime"
	"testing"
	"time"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// TestPrefaultReads: every buffer go-fuse reads a request into has all
// its pages in memory before the kernel copies into it (mincore), new
// ones and the one the INIT was read into alike, so that a daemon killed
// mid-read never makes the kernel fail a request with EIO (readbuf.go).
// It also fails if a go-fuse upgrade moved the pool prefaultReads wraps.
func TestPrefaultReads(t *testing.T) {
	in := fuse.InitIn{Major: 7, Minor: 40, MaxReadAhead: maxRequest}
	init := unsafe.Slice((*byte)(unsafe.Pointer(&in)), unsafe.Sizeof(in))
	null, err := unix.Open("/dev/null", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ServeConnection(fuse.NewDefaultRawFileSystem(), null, init, fuse.MountOptions{MaxWrite: maxRequest})
	if err != nil {
		t.Fatalf("ServeConnection (prefaultReads included): %v", err)
	}
	pool, err := readPool(srv)
	if err != nil {
		t.Fatal(err)
	}
	var held [][]byte // kept, so that each Get past the first allocates
	for i := range 4 {
		b := pool.Get().([]byte)
		if len(b) < maxRequest {
			t.Fatalf("read buffer %d: %d bytes, want at least %d", i, len(b), maxRequest)
		}
		if out := notResident(t, b); out > 0 {
			t.Errorf("read buffer %d: %d of its pages not in memory", i, out)
		}
		held = append(held, b)
	}
	// The check sees memory nothing touched.
	fresh, err := unix.Mmap(-1, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(fresh)
	if out := notResident(t, fresh); out == 0 {
		t.Errorf("an untouched mapping shows every page in memory: the check sees nothing")
	}
	touchPages(fresh)
	if out := notResident(t, fresh); out > 0 {
		t.Errorf("touchPages left %d pages of a mapping out of memory", out)
	}
}

// notResident returns how many pages that b spans mincore reports not in
// memory.
func notResident(t *testing.T, b []byte) int {
	t.Helper()
	page := uintptr(os.Getpagesize())
	start := uintptr(unsafe.Pointer(&b[0])) / page * page
	end := (uintptr(unsafe.Pointer(&b[0])) + uintptr(len(b)) + page - 1) / page * page
	vec := make([]byte, (end-start)/page)
	if _, _, e := unix.Syscall(unix.SYS_MINCORE, start, end-start, uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
		t.Fatal(e)
	}
	out := 0
	for _, v := range vec {
		if v&1 == 0 {
			out++
		}
	}
	return out
}

// TestReadBuffersKept: a read buffer nothing refers to any more comes
// back from the spares at the next get, with the alignment asked for and
// its pages in memory, instead of a new one.
func TestReadBuffersKept(t *testing.T) {
	r := &readBuffers{size: 1 << 20, misalign: 80}
	b := r.get().([]byte)
	if len(b) != 1<<20 || uintptr(unsafe.Pointer(&b[0]))%readBufAlign != 80 {
		t.Fatalf("get = %d bytes at %#x; want 1 MiB at 80 past a multiple of %d", len(b), uintptr(unsafe.Pointer(&b[0])), readBufAlign)
	}
	first := uintptr(unsafe.Pointer(&b[0]))
	b = nil
	for i := 0; i < 100 && spares(r) == 0; i++ {
		runtime.GC()
		time.Sleep(time.Millisecond) // the finalizer runs
	}
	if spares(r) != 1 {
		t.Fatalf("%d spares after the buffer was dropped, want 1", spares(r))
	}
	again := r.get().([]byte)
	if at := uintptr(unsafe.Pointer(&again[0])); at != first || len(again) != 1<<20 {
		t.Errorf("get after the drop = %d bytes at %#x; want the dropped buffer at %#x", len(again), at, first)
	}
	if out := notResident(t, again); out > 0 {
		t.Errorf("%d pages of the kept buffer not in memory", out)
	}
}

func spares(r *readBuffers) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.spare)
}
