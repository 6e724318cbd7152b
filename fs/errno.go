package fs

import (
	"errors"
	"io"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"

	"tensorfs/alloc"
	"tensorfs/gpu"
)

// toErrno maps an error from alloc or the kernel to the errno a client
// sees. It is the only such mapping in tensorfs.
func toErrno(err error) syscall.Errno {
	switch {
	case err == nil:
		return 0
	case errors.Is(err, alloc.ErrInvalid):
		return syscall.EINVAL
	case errors.Is(err, alloc.ErrReadOnly), errors.Is(err, alloc.ErrNoCreate):
		return syscall.EPERM
	case errors.Is(err, alloc.ErrNotEmpty):
		return syscall.EBUSY
	case errors.Is(err, alloc.ErrExists):
		return syscall.EEXIST
	case errors.Is(err, alloc.ErrNoDisk), errors.Is(err, alloc.ErrNoDevice):
		return syscall.EOPNOTSUPP
	case errors.Is(err, alloc.ErrTooBig):
		return syscall.EFBIG
	case errors.Is(err, alloc.ErrNoSpace):
		return syscall.ENOSPC
	case errors.Is(err, alloc.ErrNoAttr):
		return syscall.ENODATA
	case errors.Is(err, gpu.ErrUnavailable):
		return syscall.ENODEV
	case errors.Is(err, gpu.ErrInvalid):
		return syscall.EINVAL
	case errors.Is(err, io.ErrUnexpectedEOF):
		return syscall.EIO
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return errno
	}
	return fusefs.ToErrno(err)
}
