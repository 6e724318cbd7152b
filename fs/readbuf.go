package fs

import (
	"fmt"
	"os"
	"reflect"
	"sync"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
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
// memory before the kernel first copies a request into it: its pool's
// allocator touches each page of a new buffer, and the buffer already in
// the pool (the INIT's) is touched too. Call it before srv serves. It
// fails if go-fuse's Server has no read buffer pool where this version
// keeps it (a go-fuse upgrade: TestPrefaultReads says so).
func prefaultReads(srv *fuse.Server) error {
	pool, err := readPool(srv)
	if err != nil {
		return err
	}
	alloc := pool.New
	if alloc == nil {
		return fmt.Errorf("go-fuse's read buffer pool has no allocator")
	}
	pool.New = func() any {
		b := alloc()
		if buf, ok := b.([]byte); ok {
			touchPages(buf)
		}
		return b
	}
	if b, ok := pool.Get().([]byte); ok {
		touchPages(b)
		pool.Put(b)
	}
	return nil
}

// readPool returns the pool go-fuse's Server takes its read buffers from.
func readPool(srv *fuse.Server) (*sync.Pool, error) {
	f := reflect.ValueOf(srv).Elem().FieldByName("readPool")
	if !f.IsValid() || f.Type() != reflect.TypeFor[sync.Pool]() {
		return nil, fmt.Errorf("go-fuse's Server keeps no readPool of type sync.Pool")
	}
	return (*sync.Pool)(unsafe.Pointer(f.UnsafeAddr())), nil
}

// touchPages writes a zero into each page b spans, which faults it in. A
// read buffer's bytes are what the next read overwrites.
func touchPages(b []byte) {
	if len(b) == 0 {
		return
	}
	page := uintptr(os.Getpagesize())
	start := uintptr(unsafe.Pointer(&b[0]))
	for off := uintptr(0); off < uintptr(len(b)); off = (start+off)/page*page + page - start {
		b[off] = 0
	}
}
