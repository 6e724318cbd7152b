package devmem

import (
	"errors"
	"fmt"
	"sync"
)

// Table hands out Blocks over device allocations of type M made by a
// backend, which supplies newMem and freeMem. Every block has a device
// allocation of its own: an IPC handle or an export reaches a whole
// allocation, so it must hold nothing but its block (DESIGN.md §4).
//
// An allocation is never released while an operation holds it (Acquire),
// so a Free racing a copy cannot unmap memory under the copy. Methods are
// safe for concurrent use.
type Table[M any] struct {
	// newMem makes a zeroed device allocation of at least size bytes and
	// returns it with its real size; freeMem releases one. Both are called
	// with mu held, so a backend may keep its accounting under mu.
	newMem  func(size int64, exportable bool) (M, int64, error)
	freeMem func(M) error

	mu     sync.Mutex // guards everything below and the allocations' fields
	closed bool
	last   uint64                    // the last block ID handed out
	blocks map[uint64]*Allocation[M] // live blocks
}

// Allocation is the device allocation of one block. Its exported fields
// do not change while it is held (Acquire).
type Allocation[M any] struct {
	Mem        M
	Size       int64 // of the allocation, at least the block's
	Exportable bool
	block      int64 // Block.Size
	busy       int   // operations holding it (Acquire)
	gone       bool  // its block was freed; release it when busy is 0
}

// NewTable returns an empty table over the allocations that newMem makes
// and freeMem releases.
func NewTable[M any](newMem func(size int64, exportable bool) (M, int64, error), freeMem func(M) error) *Table[M] {
	return &Table[M]{newMem: newMem, freeMem: freeMem, blocks: make(map[uint64]*Allocation[M])}
}

var errClosed = fmt.Errorf("%w: device closed", ErrUnavailable)

// Alloc makes a block of size bytes in an allocation of its own.
func (t *Table[M]) Alloc(size int64, exportable bool) (Block, error) {
	if size <= 0 {
		return Block{}, fmt.Errorf("%w: block size %d", ErrInvalid, size)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return Block{}, errClosed
	}
	mem, real, err := t.newMem(size, exportable)
	if err != nil {
		return Block{}, err
	}
	t.last++
	t.blocks[t.last] = &Allocation[M]{Mem: mem, Size: real, Exportable: exportable, block: size}
	return Block{ID: t.last, Size: size}, nil
}

// Free releases a block and its allocation, at once or when the last
// operation on it ends.
func (t *Table[M]) Free(b Block) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	a, err := t.lookupLocked(b)
	if err != nil {
		return err
	}
	delete(t.blocks, b.ID)
	return t.dropLocked(a)
}

// dropLocked releases a forgotten allocation unless an operation still
// holds it.
func (t *Table[M]) dropLocked(a *Allocation[M]) error {
	a.gone = true
	if a.busy > 0 {
		return nil
	}
	return t.freeMem(a.Mem)
}

func (t *Table[M]) lookupLocked(b Block) (*Allocation[M], error) {
	if t.closed {
		return nil, errClosed
	}
	a, ok := t.blocks[b.ID]
	if !ok || a.block != b.Size {
		return nil, fmt.Errorf("%w: block %d of %d bytes", ErrNoBlock, b.ID, b.Size)
	}
	return a, nil
}

// Acquire returns b's allocation and holds it until release is called. It
// also checks that the n bytes at off lie in the block.
func (t *Table[M]) Acquire(b Block, off, n int64) (a *Allocation[M], release func(), err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if a, err = t.lookupLocked(b); err != nil {
		return nil, nil, err
	}
	if off < 0 || n < 0 || off > b.Size || n > b.Size-off {
		return nil, nil, fmt.Errorf("%w: range at %d of %d bytes in a block of %d", ErrInvalid, off, n, b.Size)
	}
	a.busy++
	return a, func() {
		t.mu.Lock()
		defer t.mu.Unlock()
		a.busy--
		if a.gone && a.busy == 0 {
			_ = t.freeMem(a.Mem) // its Free already returned; nobody to tell
		}
	}, nil
}

// Stats counts what the table holds.
func (t *Table[M]) Stats() Stats {
	t.mu.Lock()
	defer t.mu.Unlock()
	var s Stats
	for _, a := range t.blocks {
		s.Blocks++
		s.BlockBytes += a.block
		s.DeviceBytes += a.Size
	}
	return s
}

// Close frees every block and allocation; later calls fail with
// ErrUnavailable. Allocations held by running operations are released when
// those end.
func (t *Table[M]) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	var errs []error
	for _, a := range t.blocks {
		errs = append(errs, t.dropLocked(a))
	}
	t.closed = true
	clear(t.blocks)
	return errors.Join(errs...)
}
