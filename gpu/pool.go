package gpu

import (
	"errors"
	"fmt"
	"sync"
)

// pool hands out Blocks over device allocations of type M made by a
// backend (the pluggable-allocator idea: the backend supplies newMem and
// freeMem, the pool does the rest). Blocks up to PoolThreshold are carved
// from pooled chunks of PoolChunkSize bytes, first fit; larger and
// exportable blocks get an allocation of their own. A chunk is returned to
// the backend as soon as its last block is freed.
//
// An allocation is never released while an operation holds it (acquire),
// so a Free racing a copy cannot unmap memory under the copy.
type pool[M any] struct {
	// newMem makes a device allocation of at least size bytes and returns
	// it with its real size; freeMem releases one. Both are called with mu
	// held, so a backend may keep its accounting under mu.
	newMem  func(size int64, exportable bool) (M, int64, error)
	freeMem func(M) error

	mu        sync.Mutex // guards everything below and the allocations' fields
	closed    bool
	lastBlock uint64
	lastAlloc uint64
	blocks    map[uint64]*placement[M]
	allocs    map[*allocation[M]]struct{} // live allocations
	chunks    []*allocation[M]            // pooled allocations, in creation order
}

// allocation is one device allocation.
type allocation[M any] struct {
	id         uint64 // numbers allocations from 1, for handles that name them
	mem        M
	size       int64
	pooled     bool
	exportable bool
	free       []span // pooled only: free ranges, sorted and coalesced
	blocks     int    // live blocks placed in it
	busy       int    // operations holding it (acquire)
	gone       bool   // its last block was freed; release it when busy is 0
}

// placement is where a block lives.
type placement[M any] struct {
	alloc *allocation[M]
	off   int64 // in the allocation
	span  int64 // bytes reserved: the size rounded up to PoolAlign when pooled
	size  int64 // Block.Size
}

type span struct{ off, size int64 }

func newPool[M any](newMem func(int64, bool) (M, int64, error), freeMem func(M) error) *pool[M] {
	return &pool[M]{
		newMem:  newMem,
		freeMem: freeMem,
		blocks:  make(map[uint64]*placement[M]),
		allocs:  make(map[*allocation[M]]struct{}),
	}
}

var errClosed = fmt.Errorf("%w: device closed", ErrUnavailable)

// alloc places a new block of size bytes.
func (p *pool[M]) alloc(size int64, exportable bool) (Block, error) {
	if size <= 0 {
		return Block{}, fmt.Errorf("%w: block size %d", ErrInvalid, size)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return Block{}, errClosed
	}
	var pl *placement[M]
	if !exportable && size <= PoolThreshold {
		var err error
		if pl, err = p.carveLocked(size); err != nil {
			return Block{}, err
		}
	} else {
		a, err := p.newAllocLocked(size, exportable)
		if err != nil {
			return Block{}, err
		}
		pl = &placement[M]{alloc: a, span: a.size}
	}
	pl.size = size
	pl.alloc.blocks++
	p.lastBlock++
	p.blocks[p.lastBlock] = pl
	return Block{ID: p.lastBlock, Size: size}, nil
}

func (p *pool[M]) newAllocLocked(size int64, exportable bool) (*allocation[M], error) {
	mem, real, err := p.newMem(size, exportable)
	if err != nil {
		return nil, err
	}
	p.lastAlloc++
	a := &allocation[M]{id: p.lastAlloc, mem: mem, size: real, exportable: exportable}
	p.allocs[a] = struct{}{}
	return a, nil
}

// carveLocked reserves size bytes, rounded up to PoolAlign, in the first
// chunk with room, making a chunk when none has.
func (p *pool[M]) carveLocked(size int64) (*placement[M], error) {
	need := (size + PoolAlign - 1) / PoolAlign * PoolAlign
	for _, c := range p.chunks {
		for i, s := range c.free {
			if s.size < need {
				continue
			}
			if s.size == need {
				c.free = append(c.free[:i], c.free[i+1:]...)
			} else {
				c.free[i] = span{s.off + need, s.size - need}
			}
			return &placement[M]{alloc: c, off: s.off, span: need}, nil
		}
	}
	c, err := p.newAllocLocked(PoolChunkSize, false)
	if err != nil {
		return nil, err
	}
	c.pooled = true
	c.free = []span{{need, c.size - need}}
	p.chunks = append(p.chunks, c)
	return &placement[M]{alloc: c, off: 0, span: need}, nil
}

// free releases a block; its allocation goes back to the backend when it
// holds no other block (at once, or when the last operation on it ends).
func (p *pool[M]) free(b Block) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	pl, err := p.lookupLocked(b)
	if err != nil {
		return err
	}
	delete(p.blocks, b.ID)
	a := pl.alloc
	a.blocks--
	if a.pooled {
		a.free = insertSpan(a.free, span{pl.off, pl.span})
	}
	if a.blocks > 0 {
		return nil
	}
	return p.dropLocked(a)
}

// dropLocked forgets an allocation with no blocks left and releases it
// unless an operation still holds it.
func (p *pool[M]) dropLocked(a *allocation[M]) error {
	a.gone = true
	delete(p.allocs, a)
	if a.pooled {
		for i, c := range p.chunks {
			if c == a {
				p.chunks = append(p.chunks[:i], p.chunks[i+1:]...)
				break
			}
		}
	}
	if a.busy > 0 {
		return nil
	}
	return p.freeMem(a.mem)
}

// insertSpan returns free with s added, keeping it sorted and coalesced.
func insertSpan(free []span, s span) []span {
	i := 0
	for i < len(free) && free[i].off < s.off {
		i++
	}
	free = append(free, span{})
	copy(free[i+1:], free[i:])
	free[i] = s
	if i+1 < len(free) && free[i].off+free[i].size == free[i+1].off {
		free[i].size += free[i+1].size
		free = append(free[:i+1], free[i+2:]...)
	}
	if i > 0 && free[i-1].off+free[i-1].size == free[i].off {
		free[i-1].size += free[i].size
		free = append(free[:i], free[i+1:]...)
	}
	return free
}

func (p *pool[M]) lookupLocked(b Block) (*placement[M], error) {
	if p.closed {
		return nil, errClosed
	}
	pl, ok := p.blocks[b.ID]
	if !ok || pl.size != b.Size {
		return nil, fmt.Errorf("%w: block %d of %d bytes", ErrNoBlock, b.ID, b.Size)
	}
	return pl, nil
}

// acquire returns where b lives and holds its allocation until release is
// called. It also checks that the n bytes at off lie in the block.
func (p *pool[M]) acquire(b Block, off, n int64) (pl *placement[M], release func(), err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pl, err = p.lookupLocked(b); err != nil {
		return nil, nil, err
	}
	if off < 0 || n < 0 || off > b.Size || n > b.Size-off {
		return nil, nil, fmt.Errorf("%w: range at %d of %d bytes in a block of %d", ErrInvalid, off, n, b.Size)
	}
	a := pl.alloc
	a.busy++
	return pl, func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		a.busy--
		if a.gone && a.busy == 0 {
			_ = p.freeMem(a.mem) // its Free already returned; nobody to tell
		}
	}, nil
}

// stats counts what the pool holds.
func (p *pool[M]) stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	var s Stats
	for _, pl := range p.blocks {
		s.Blocks++
		s.BlockBytes += pl.size
		if pl.alloc.pooled {
			s.PooledBlocks++
		}
	}
	for a := range p.allocs {
		s.Allocations++
		s.DeviceBytes += a.size
		if a.pooled {
			s.PoolChunks++
		}
	}
	return s
}

// close frees every block and allocation; later calls fail with
// ErrUnavailable. Allocations held by running operations are released when
// those end.
func (p *pool[M]) close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	var errs []error
	for a := range p.allocs {
		errs = append(errs, p.dropLocked(a))
	}
	p.closed = true
	clear(p.blocks)
	return errors.Join(errs...)
}
