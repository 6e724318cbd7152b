package fs

import (
	"fmt"
	"os"
	"reflect"
	"runtime"
	"sync"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// The kernel copies each request into the buffer the daemon's read(2) of
// /dev/fuse names, pinning its pages as it goes (fuse_dev_do_read). A
// page not yet in memory must be faulted in, which the kernel refuses to
// a process being killed (SIGKILL, a panic's exit, the OOM killer): the
// copy fails and the kernel ends the request with EIO, instead of
// leaving it to the successor's FUSE_NOTIFY_RESEND. A crash would then
// fail a client's request, the one error a restart cannot take back
// (seen as a pwrite's EIO in classic mode). go-fuse allocates its read
// buffers with make, whose fresh heap memory has no pages yet, and has no
// hook for them; prefaultReads gives its pool one.

// prefaultReads makes every read buffer of srv have all its pages in
// memory before the kernel first copies a request into it, and keeps the
// buffers: its pool's allocator hands out a buffer the pool dropped
// before (readBuffers), else a new one whose pages it touches; the buffer
// already in the pool (the INIT's) is touched too. Call it before srv
// serves. It fails if go-fuse's Server has no read buffer pool where this
// version keeps it (a go-fuse upgrade: TestPrefaultReads says so).
func prefaultReads(srv *fuse.Server) error {
	pool, err := readPool(srv)
	if err != nil {
		return err
	}
	if pool.New == nil {
		return fmt.Errorf("go-fuse's read buffer pool has no allocator")
	}
	sample, ok := pool.Get().([]byte)
	if !ok || len(sample) == 0 {
		return fmt.Errorf("go-fuse's read buffer pool holds no []byte")
	}
	touchPages(sample)
	pool.Put(sample)
	bufs := &readBuffers{size: len(sample), misalign: uintptr(unsafe.Pointer(&sample[0])) % readBufAlign}
	pool.New = bufs.get
	return nil
}

// readBufAlign is the alignment go-fuse gives its read buffers (a WRITE's
// data at a block boundary, for O_DIRECT backing files); readBuffers
// keeps the offset of the buffers go-fuse made from it.
const readBufAlign = 4096

// maxSpareReads bounds the read buffers kept for a pool that dropped
// them: go-fuse reads with at most 16 goroutines at once.
const maxSpareReads = 16

// readBuffers allocates go-fuse's read buffers, and keeps them. A
// sync.Pool drops what it holds at every other GC (and, built with
// -race, a quarter of what is put back), and a daemon with a small heap
// collects often: requests would then get new MiB buffers, made, zeroed
// and faulted in again (and the allocations hasten the next GC). A
// buffer the pool dropped, once nothing refers to it, comes back through
// its finalizer into spare, where get finds it.
type readBuffers struct {
	size     int     // a buffer's length, as go-fuse made it
	misalign uintptr // &b[0] % readBufAlign, as go-fuse made it

	mu    sync.Mutex
	spare [][]byte // whole allocations, free
}

// get returns a read buffer of the pool's length and alignment, with
// its pages in memory.
func (r *readBuffers) get() any {
	r.mu.Lock()
	var whole []byte
	if n := len(r.spare); n > 0 {
		whole, r.spare = r.spare[n-1], r.spare[:n-1]
	}
	r.mu.Unlock()
	if whole == nil {
		whole = make([]byte, r.size+readBufAlign)
		touchPages(whole)
	}
	runtime.SetFinalizer(&whole[0], r.dropped)
	at := (r.misalign - uintptr(unsafe.Pointer(&whole[0]))%readBufAlign + readBufAlign) % readBufAlign
	return whole[at : at+uintptr(r.size)]
}

// dropped is a buffer's finalizer: nothing refers to the allocation at p
// any more, so it is free; it is kept unless spare is full.
func (r *readBuffers) dropped(p *byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.spare) < maxSpareReads {
		r.spare = append(r.spare, unsafe.Slice(p, r.size+readBufAlign))
	}
}

// readPool returns the pool go-fuse's Server takes its read buffers from.
func readPool(srv *fuse.Server) (*sync.Pool, error) {
	f := reflect.ValueOf(srv).Elem().FieldByName("readPool")
	if !f.IsValid() || f.Type() != reflect.TypeFor[sync.Pool]() {
		return nil, fmt.Errorf("go-fuse's Server keeps no readPool of type sync.Pool")
	}
	return (*sync.Pool)(unsafe.Pointer(f.UnsafeAddr())), nil
}

// touchPages faults in each page b spans, with one
// madvise(MADV_POPULATE_WRITE) where the kernel has it (5.14), else by
// writing a zero into each page. The madvise leaves the bytes as they are
// and, unlike the writes, costs no fault a page: under the race detector
// each instrumented write faulted in its shadow too, and the buffers a
// pool drops at every GC made that most of a test daemon's CPU. A read
// buffer's bytes are what the next read overwrites.
func touchPages(b []byte) {
	if len(b) == 0 {
		return
	}
	page := uintptr(os.Getpagesize())
	start := uintptr(unsafe.Pointer(&b[0]))
	first := start / page * page // the page holding b[0]: populating leaves its other bytes alone
	if _, _, e := unix.Syscall(unix.SYS_MADVISE, first, start+uintptr(len(b))-first, unix.MADV_POPULATE_WRITE); e == 0 {
		return
	}
	for off := uintptr(0); off < uintptr(len(b)); off = (start+off)/page*page + page - start {
		b[off] = 0
	}
}
