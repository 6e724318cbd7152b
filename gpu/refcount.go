package gpu

import (
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// RefCounters hands out reference counters that live in a shared host
// file, 8 bytes each (PyTorch's CudaIPCRefCountersFile): the daemon gives a
// consumer the file and a slot's offset; the consumer maps the file and
// atomically increments the little-endian int64 at the offset while it
// uses the block, and decrements it when done. Value reads it, and a Limbo
// predicate built on it frees the block at zero.
//
// The file must be a backing-store file, never one inside the FUSE mount
// (mapping a file of its own mount deadlocks the daemon). Methods are safe
// for concurrent use.
type RefCounters struct {
	mem []byte // the file, mapped shared

	mu   sync.Mutex // guards next and free
	next int64      // lowest offset never handed out
	free []int64    // released offsets
}

// NewRefCounters maps f, whose size (at least 8 bytes) bounds the slots,
// one per 8 bytes. f stays the caller's; it may be closed once this returns.
func NewRefCounters(f *os.File) (*RefCounters, error) {
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	size := st.Size() / 8 * 8
	if size == 0 {
		return nil, fmt.Errorf("%w: reference counter file %s has %d bytes", ErrInvalid, f.Name(), st.Size())
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %s: %w", f.Name(), err)
	}
	return &RefCounters{mem: mem}, nil
}

// Slot returns the offset of a free counter, set to zero; ErrNoSlots when
// all are in use.
func (r *RefCounters) Slot() (offset int64, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case len(r.free) > 0:
		offset = r.free[len(r.free)-1]
		r.free = r.free[:len(r.free)-1]
	case r.next < int64(len(r.mem)):
		offset = r.next
		r.next += 8
	default:
		return 0, fmt.Errorf("%w: all %d in use", ErrNoSlots, len(r.mem)/8)
	}
	atomic.StoreInt64(r.counter(offset), 0)
	return offset, nil
}

// Value atomically loads the counter at offset.
func (r *RefCounters) Value(offset int64) int64 {
	return atomic.LoadInt64(r.counter(offset))
}

// Release returns the slot at offset for reuse. Release a slot only when
// no consumer will touch it again: its value is zero and the block it
// counted is gone.
func (r *RefCounters) Release(offset int64) {
	r.counter(offset) // check it
	r.mu.Lock()
	defer r.mu.Unlock()
	r.free = append(r.free, offset)
}

// counter returns the int64 at offset; it panics on an offset that no
// Slot call can have returned, as an index out of range does.
func (r *RefCounters) counter(offset int64) *int64 {
	if offset < 0 || offset%8 != 0 || offset >= int64(len(r.mem)) {
		panic(fmt.Sprintf("gpu: reference counter offset %d outside [0, %d) or unaligned", offset, len(r.mem)))
	}
	return (*int64)(unsafe.Pointer(&r.mem[offset]))
}

// Close unmaps the file. The RefCounters must not be used afterwards.
func (r *RefCounters) Close() error {
	return unix.Munmap(r.mem)
}
