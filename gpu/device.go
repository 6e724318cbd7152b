package gpu

import (
	"os"

	"tensorfs/gpu/internal/devmem"
)

// Device is one GPU, or its simulation. Methods are safe for concurrent use.
//
// Ranges are checked: off and n must lie within the block (ErrInvalid), and
// a Block must be one this Device handed out and has not freed (ErrNoBlock).
// A Device returned by Start forwards every call to its helper process, each
// with a deadline past which the helper is killed (see the package doc);
// once the helper is gone every call fails with ErrUnavailable.
type Device interface {
	// Name is the device the daemon names segments by: "cuda:N" for the
	// cuda and sim backends alike, "none" for Unavailable.
	Name() string
	// Backend is "cuda", "sim" or "none".
	Backend() string
	// Granularity is what every device allocation is rounded up to (a
	// power of two; 2 MiB on current GPUs and for sim): a block of n bytes
	// takes DeviceBytes(n) of device memory, not n.
	Granularity() int64

	// Alloc returns a zeroed block of size bytes (size > 0) in a device
	// allocation of its own, never shared with another block: the IPC
	// handle of a block reaches that block alone. The allocation is rounded
	// up to 2 MiB, so that the driver places nothing else in it either, and
	// zeroed whole, since a consumer of the handle sees all of it.
	// ErrOutOfMemory when the device is full (collect the Limbo and retry).
	Alloc(size int64) (Block, error)
	// AllocExportable returns a zeroed block in a device allocation of its
	// own, made with the virtual memory management API so that Export can
	// hand out a POSIX file descriptor for it. ErrNotExportable when the
	// device cannot do that.
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
	// CUDA stack: the IPC handle of the block's device allocation, whose
	// first byte is the block's, and the handle of an interprocess event
	// recorded after the last write to the block. The result is the same on
	// every call for a block. Blocks from AllocExportable have no IPC handle
	// (ErrNoIPC): share them with Export.
	IPC(b Block) (IPCInfo, error)
	// Export returns a new POSIX file descriptor for the allocation of a
	// block from AllocExportable (ErrNotExportable for any other block),
	// never a duplicate of one the device keeps. The caller owns the file.
	// With cuda it is the shareable handle that cuMemExportToShareableHandle
	// makes for this call, to import with cuMemImportFromShareableHandle:
	// its holder can map the memory writable, and it cannot be opened again
	// read-only. With sim it is the block's memfd opened again for reading
	// and writing, a new open file description: owner-only and sealed
	// against any change of size, so that it opens again (through
	// /proc/self/fd, say) for its owner alone, and no holder can shrink it
	// under the device's mapping.
	Export(b Block) (*os.File, error)

	// Stats counts blocks and device allocations. It reports zero once the
	// device is unavailable.
	Stats() Stats
	// Close frees every block and releases the device; a helper process
	// exits. Later calls fail with ErrUnavailable.
	Close() error
}

// DeviceBytes returns the device memory a block of size bytes takes on
// dev: size rounded up to dev's granularity, 0 for no block.
func DeviceBytes(dev Device, size int64) int64 {
	return devmem.RoundUp(size, dev.Granularity())
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
// cuIpcOpenMemHandle(MemHandle) is the block's first byte (its offset in
// the allocation is always 0), and waiting on
// cuIpcOpenEventHandle(EventHandle) orders the consumer after the last
// write to the block.
//
// The sim backend fills the handles with a deterministic layout (all
// integers little-endian, the rest zero):
//
//	MemHandle   [0:16] "tensorfs-sim-mem"  [16:24] block ID
//	            [24:32] allocation size    [32:36] helper pid   [36:40] memfd
//	EventHandle [0:16] "tensorfs-sim-evt"  [16:24] block ID
//
// so /proc/PID/fd/FD opens the simulated allocation.
type IPCInfo struct {
	MemHandle   [64]byte
	EventHandle [64]byte
}

// Stats describes what a Device holds.
type Stats struct {
	// Blocks is the number of live blocks (and of device allocations, one
	// each) and BlockBytes their sizes added up.
	Blocks     int
	BlockBytes int64
	// DeviceBytes is the size of their device allocations, at least
	// BlockBytes.
	DeviceBytes int64
}
