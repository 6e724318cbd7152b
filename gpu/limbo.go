package gpu

import "sync"

// Limbo holds blocks whose segment was unlinked or shrunk while consumers
// still referenced them (PyTorch's CudaIPCSentDataLimbo): a consumer that
// opened the block's IPC handle may still read it, so its device memory
// must not be handed out again yet. Collect frees the blocks nobody
// references any more; call it periodically, when a reference is dropped,
// and when Alloc fails with ErrOutOfMemory (then retry the Alloc).
// Methods are safe for concurrent use.
//
// Collections run one at a time: a Collect that arrives while another
// runs waits for it, then runs its own, so that no block is hidden from
// it (the daemon collects after an out-of-memory error while its periodic
// collector may be running).
type Limbo struct {
	dev Device

	// collecting is held by the Collect that runs; it comes before mu.
	collecting sync.Mutex

	mu      sync.Mutex // guards entries, blocks, bytes, kept and freed
	entries []limboEntry
	// blocks and bytes count what is in limbo, entries being looked at
	// by a Collect included.
	blocks int
	bytes  int64
	// kept counts the blocks Collects found still referenced, each time.
	kept int64
	// freed counts the blocks Collects freed, ever.
	freed int64
}

type limboEntry struct {
	block           Block
	stillReferenced func() bool
}

// NewLimbo returns an empty limbo whose blocks are freed on dev.
func NewLimbo(dev Device) *Limbo { return &Limbo{dev: dev} }

// Add puts b in limbo until stillReferenced reports false, typically "the
// reference counter is not zero or a file handle is still open".
// stillReferenced is called from Collect, without the limbo's lock held.
func (l *Limbo) Add(b Block, stillReferenced func() bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.entries = append(l.entries, limboEntry{b, stillReferenced})
	l.blocks++
	l.bytes += b.Size
}

// Collect frees the blocks no longer referenced and returns how many
// blocks were freed between its call and its return: by it, or by a
// Collect that was running when it was called, which it waits for. So
// every block unreferenced when Collect is called has left the limbo when
// it returns, and counts in its result unless an earlier Collect freed it
// first. A block whose Free fails leaves the limbo all the same, uncounted:
// the device no longer has it (the helper died, or it was freed elsewhere).
func (l *Limbo) Collect() int {
	l.mu.Lock()
	before := l.freed
	l.mu.Unlock()
	l.collecting.Lock()
	defer l.collecting.Unlock()

	l.mu.Lock()
	entries := l.entries
	l.entries = nil
	l.mu.Unlock()
	var keep []limboEntry
	for _, e := range entries {
		if e.stillReferenced() {
			keep = append(keep, e)
			continue
		}
		err := l.dev.Free(e.block)
		l.mu.Lock()
		if err == nil {
			l.freed++
		}
		l.blocks--
		l.bytes -= e.block.Size
		l.mu.Unlock()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.entries = append(keep, l.entries...) // with those added meanwhile
	l.kept += int64(len(keep))
	return int(l.freed - before)
}

// Stats returns the number of blocks in limbo and their bytes.
func (l *Limbo) Stats() (blocks int, bytes int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.blocks, l.bytes
}

// Kept returns how many times a Collect found a block still referenced
// and kept it: a block that waited through n Collects counts n times.
func (l *Limbo) Kept() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.kept
}
