package fs

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"strings"
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

// TestErrnoLogsRefusalsOnly: a refusal is logged with its reason; an
// absent name or attribute, and a buffer too small for a value (ERANGE,
// which every getxattr of a value larger than the caller's first guess
// gets), are answers and are not.
func TestErrnoLogsRefusalsOnly(t *testing.T) {
	fsys := testFS(t)
	var out bytes.Buffer
	fsys.log = slog.New(slog.NewTextHandler(&out, nil))
	for _, err := range []error{syscall.ENOENT, alloc.ErrNoAttr, syscall.ERANGE} {
		if errno := fsys.errnoOf("getxattr", &fsys.root.nodeBase, err); errno == 0 {
			t.Fatalf("errno(%v) = 0", err)
		}
	}
	if out.Len() != 0 {
		t.Errorf("answers were logged:\n%s", out.String())
	}
	fsys.errnoOf("setxattr", &fsys.root.nodeBase, alloc.ErrReadOnly)
	if !strings.Contains(out.String(), "refused") {
		t.Errorf("a refusal was not logged: %q", out.String())
	}
}
