package gpu

import (
	"errors"

	"tensorfs/gpu/internal/devmem"
)

// Sentinel errors returned by this package and its backends. Callers
// match them with errors.Is; errors from a helper process keep their
// sentinel across the socket. Those that the backends' shared bookkeeping
// returns are devmem's.
var (
	// ErrUnavailable is returned when no device serves the call: the
	// helper process failed to start or died (the error text ends with its
	// last line of output, e.g. why cuInit failed), or left a call
	// unanswered past its deadline and was killed; the backend is none, or
	// the Device was closed. Blocks of a dead helper are gone with it.
	ErrUnavailable = devmem.ErrUnavailable
	// ErrOutOfMemory is returned when the device cannot hold another
	// allocation.
	ErrOutOfMemory = errors.New("out of device memory")
	// ErrNotExportable is returned when Export is called on a block that
	// AllocExportable did not make, or when AllocExportable is called on a
	// device without POSIX file descriptor handles for its virtual memory.
	ErrNotExportable = errors.New("block is not exportable")
	// ErrNoIPC is returned when IPC is called on a block from
	// AllocExportable: CUDA IPC handles do not cover such memory.
	ErrNoIPC = errors.New("block has no IPC handle")
	// ErrNoBlock is returned when a Block is not one the Device handed
	// out, or was freed already.
	ErrNoBlock = devmem.ErrNoBlock
	// ErrInvalid is returned when a size, offset, length or backend name is
	// out of range or unknown.
	ErrInvalid = devmem.ErrInvalid
)
