package gpu

import "os"

// Device is one GPU, or its simulation. Methods are safe for concurrent use.
//
// Ranges are checked: off and n must lie within the block (ErrInvalid), and
// a Block must be one this Device handed out and has not freed (ErrNoBlock).
// A Device returned by Start forwards every call to its helper process; once
// the helper is gone every call fails with ErrUnavailable.
type Device interface {
	// Name is the device the daemon names segments by: "cuda:N" for the
	// cuda and sim backends alike, "none" for Unavailable.
	Name() string
	// Backend is "cuda", "sim" or "none".
	Backend() string

	// Alloc returns a block of size bytes (size > 0). A size up to
	// PoolThreshold is sub-allocated from a pooled device allocation of
	// PoolChunkSize bytes, at an offset aligned to PoolAlign; a larger one
	// gets a device allocation of its own. ErrOutOfMemory when the device is
	// full (collect the Limbo and retry).
	Alloc(size int64) (Block, error)
	// AllocExportable returns a block with a device allocation of its own,
	// made with the virtual memory management API so that Export can hand
	// out a POSIX file descriptor for it. ErrNotExportable when the device
	// cannot do that.
	AllocExportable(size int64) (Block, error)
	// Free releases a block. Its bytes may be handed out again at once, so
	// free only blocks no consumer references (see Limbo).
	Free(b Block) error

	// CopyIn copies src into the block at off, through pinned staging.
	CopyIn(b Block, off int64, src []byte) error
	// CopyOut copies len(dst) bytes of the block at off into dst.
	CopyOut(b Block, off int64, dst []byte) error
	// CopyFromFile copies n bytes of the file fd at fileOff into the block
	// at off. The device reads the file itself (pread into pinned buffers,
	// double-buffered with the device copies), so a helper process receives
	// a duplicate of fd. The caller keeps fd and closes it. A file shorter
	// than fileOff+n fails with io.ErrUnexpectedEOF.
	CopyFromFile(b Block, off int64, fd int, fileOff, n int64) error
	// CopyToFile copies n bytes of the block at off into the file fd at
	// fileOff (pwrite; the file grows as needed). The caller keeps fd.
	CopyToFile(b Block, off int64, fd int, fileOff, n int64) error

	// IPC returns what another process needs to open the block with its own
	// CUDA stack: the IPC handle of the device allocation holding it, the
	// block's offset in that allocation, and the handle of an interprocess
	// event recorded after the last write to the block. The result is the
	// same on every call for a block. Blocks from AllocExportable have no
	// IPC handle (ErrNoIPC): share them with Export.
	IPC(b Block) (IPCInfo, error)
	// Export returns a new POSIX file descriptor for the allocation of a
	// block from AllocExportable (ErrNotExportable for any other block). The
	// caller owns the file. With cuda it is the shareable handle of
	// cuMemExportToShareableHandle, to import with
	// cuMemImportFromShareableHandle; with sim it is a memfd holding the
	// block's bytes.
	Export(b Block) (*os.File, error)

	// Stats counts blocks and device allocations. It reports zero once the
	// device is unavailable.
	Stats() Stats
	// Close frees every block and releases the device; a helper process
	// exits. Later calls fail with ErrUnavailable.
	Close() error
}

// Block is a range of device memory handed out by a Device. It is a value:
// copy it freely, and pass it back to the Device that made it.
type Block struct {
	// ID names the block within its Device; 0 is never used.
	ID uint64
	// Size is the size the block was allocated with.
	Size int64
}

// IPCInfo is how a consumer process opens a block with its own CUDA stack:
// cuIpcOpenMemHandle(MemHandle) + Offset is the block's first byte, and
// waiting on cuIpcOpenEventHandle(EventHandle) orders the consumer after
// the last write to the block.
//
// The sim backend fills the handles with a deterministic layout (all
// integers little-endian, the rest zero):
//
//	MemHandle   [0:16] "tensorfs-sim-mem"  [16:24] allocation number
//	            [24:32] allocation size    [32:36] helper pid   [36:40] memfd
//	EventHandle [0:16] "tensorfs-sim-evt"  [16:24] block ID
//
// so /proc/PID/fd/FD opens the simulated allocation.
type IPCInfo struct {
	MemHandle   [64]byte
	Offset      int64
	EventHandle [64]byte
}

// Stats describes what a Device holds.
type Stats struct {
	// Blocks is the number of live blocks and BlockBytes their sizes added up.
	Blocks     int
	BlockBytes int64
	// PooledBlocks is how many of Blocks are sub-allocated from pool chunks.
	PooledBlocks int
	// Allocations is the number of device allocations held, PoolChunks of
	// them pool chunks, and DeviceBytes their sizes (at least BlockBytes).
	Allocations int
	PoolChunks  int
	DeviceBytes int64
}

// Sizes of the sub-allocator beneath Alloc (the MemPool idea): small blocks
// share device allocations, so thousands of small tensors cost a few device
// allocations and IPC handles, not thousands.
const (
	// PoolThreshold is the largest size Alloc sub-allocates.
	PoolThreshold = 2 << 20
	// PoolChunkSize is the size of each pooled device allocation.
	PoolChunkSize = 16 << 20
	// PoolAlign is the alignment of a sub-allocated block's offset; sizes
	// are rounded up to it within a chunk.
	PoolAlign = 512
)
