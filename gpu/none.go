package gpu

import (
	"errors"
	"fmt"
	"os"
)

// Unavailable returns a Device that serves nothing: its Name and Backend
// are "none", its Granularity 1, Stats is zero, Close does nothing, and every other call fails
// with an error that wraps ErrUnavailable and says reason. It is what
// `--gpu none` gets from Start, and what a daemon keeps when Start fails
// (Unavailable(err)), so that GPU segments fail with one clear error while
// host segments go on.
func Unavailable(reason error) Device {
	if !errors.Is(reason, ErrUnavailable) {
		reason = fmt.Errorf("%w: %w", ErrUnavailable, reason)
	}
	return none{err: reason}
}

type none struct{ err error }

func (n none) Name() string                                       { return "none" }
func (n none) Backend() string                                    { return "none" }
func (n none) Granularity() int64                                 { return 1 }
func (n none) Alloc(int64) (Block, error)                         { return Block{}, n.err }
func (n none) AllocExportable(int64) (Block, error)               { return Block{}, n.err }
func (n none) Free(Block) error                                   { return n.err }
func (n none) CopyIn(Block, int64, []byte) error                  { return n.err }
func (n none) CopyOut(Block, int64, []byte) error                 { return n.err }
func (n none) CopyFromFile(Block, int64, int, int64, int64) error { return n.err }
func (n none) CopyToFile(Block, int64, int, int64, int64) error   { return n.err }
func (n none) IPC(Block) (IPCInfo, error)                         { return IPCInfo{}, n.err }
func (n none) Export(Block) (*os.File, error)                     { return nil, n.err }
func (n none) Stats() Stats                                       { return Stats{} }
func (n none) Close() error                                       { return nil }
