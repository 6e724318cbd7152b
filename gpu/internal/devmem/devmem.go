// Package devmem is the bookkeeping that tensorfs's GPU backends share:
// a Table of blocks over device allocations, and Lanes of double-buffered
// staging buffers with the staged copies that use them. The sim backend
// (package gpu) and the cuda backend (package gpu/cuda) each supply the
// allocations and the device copies; this package knows neither.
//
// Block and Stats have the fields of gpu.Block and gpu.Stats, so that a
// backend converts between them, and the errors here are gpu's sentinel
// errors of the same names.
package devmem

import "errors"

// Sentinel errors, exported again by package gpu as its own.
var (
	// ErrUnavailable is returned by a closed Table.
	ErrUnavailable = errors.New("gpu unavailable")
	// ErrNoBlock is returned for a Block the Table did not hand out, or
	// freed already.
	ErrNoBlock = errors.New("no such block")
	// ErrInvalid is returned for a size, offset or length out of range.
	ErrInvalid = errors.New("invalid argument")
)

// RoundUp returns size rounded up to a multiple of granularity (> 0).
func RoundUp(size, granularity int64) int64 {
	return (size + granularity - 1) / granularity * granularity
}

// Block is a block handed out by a Table: gpu.Block's fields.
type Block struct {
	ID   uint64
	Size int64
}

// Stats counts what a Table holds: gpu.Stats's fields.
type Stats struct {
	Blocks      int
	BlockBytes  int64
	DeviceBytes int64
}
