package fs

import (
	"errors"
	"fmt"
	"syscall"
	"testing"

	"tensorfs/alloc"
	"tensorfs/gpu"
)

func TestToErrno(t *testing.T) {
	for _, c := range []struct {
		err   error
		errno syscall.Errno
		known bool
	}{
		{nil, 0, true},
		{alloc.ErrInvalid, syscall.EINVAL, true},
		{fmt.Errorf("%w: shape [2] lays out 8 bytes", alloc.ErrInvalid), syscall.EINVAL, true},
		{alloc.ErrReadOnly, syscall.EPERM, true},
		{alloc.ErrNoCreate, syscall.EPERM, true},
		{alloc.ErrNotEmpty, syscall.EBUSY, true},
		{alloc.ErrExists, syscall.EEXIST, true},
		{alloc.ErrNoDisk, syscall.EOPNOTSUPP, true},
		{alloc.ErrNoDevice, syscall.EOPNOTSUPP, true},
		{alloc.ErrTooBig, syscall.EFBIG, true},
		{alloc.ErrNoSpace, syscall.ENOSPC, true},
		{alloc.ErrNoAttr, syscall.ENODATA, true},
		{fmt.Errorf("alloc 1 GiB: %w", gpu.ErrOutOfMemory), syscall.ENOMEM, true},
		{fmt.Errorf("%w: helper exited", gpu.ErrUnavailable), syscall.EIO, true},
		{gpu.ErrNoBlock, syscall.EIO, true},
		{gpu.ErrNoIPC, syscall.EOPNOTSUPP, true},
		{gpu.ErrInvalid, syscall.EINVAL, true},
		{fmt.Errorf("%w: import", syscall.EBADF), syscall.EBADF, true},
		{fmt.Errorf("stat: %w", syscall.ENOENT), syscall.ENOENT, true},
		{errors.New("something nobody expected"), syscall.EIO, false},
	} {
		errno, known := mapErrno(c.err)
		if errno != c.errno || known != c.known {
			t.Errorf("mapErrno(%v) = %v, %v; want %v, %v", c.err, errno, known, c.errno, c.known)
		}
		if got := toErrno(c.err); got != c.errno {
			t.Errorf("toErrno(%v) = %v, want %v", c.err, got, c.errno)
		}
	}
}
