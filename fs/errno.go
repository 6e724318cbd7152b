package fs

import (
	"errors"
	"io"
	"io/fs"
	"syscall"

	"tensorfs/alloc"
	"tensorfs/cluster"
	"tensorfs/gpu"
)

// errnos is the one table of which error a client sees as which errno.
// The first rule whose error the chain holds (errors.Is) decides, then
// the chain's own syscall.Errno (EPERM stays EPERM), then io/fs's
// generic errors; an error none of them knows is EIO.
var errnos = []struct {
	err   error
	errno syscall.Errno
}{
	{alloc.ErrInvalid, syscall.EINVAL},
	{alloc.ErrReadOnly, syscall.EPERM},
	{alloc.ErrNoCreate, syscall.EPERM},
	{alloc.ErrNotEmpty, syscall.EBUSY},
	{alloc.ErrExists, syscall.EEXIST},
	{alloc.ErrNoDisk, syscall.EOPNOTSUPP},
	{alloc.ErrNoDevice, syscall.EOPNOTSUPP},
	{alloc.ErrTooBig, syscall.EFBIG},
	{alloc.ErrNoSpace, syscall.ENOSPC},
	{alloc.ErrNoAttr, syscall.ENODATA},
	{alloc.ErrLeased, syscall.EAGAIN},          // the daemon never waits for a lease to break
	{gpu.ErrOutOfMemory, syscall.ENOMEM},       // CUDA out of memory
	{gpu.ErrUnavailable, syscall.EIO},          // the GPU helper died or never started
	{gpu.ErrNoBlock, syscall.EIO},              // device memory the daemon lost track of
	{gpu.ErrNotExportable, syscall.EOPNOTSUPP}, // no VMM export for this memory
	{gpu.ErrNoIPC, syscall.EOPNOTSUPP},         // exported memory has no legacy IPC handle
	{gpu.ErrInvalid, syscall.EINVAL},
	{io.ErrUnexpectedEOF, syscall.EIO},
	{cluster.ErrUnavailable, syscall.ETIMEDOUT}, // etcd did not answer in time
	{cluster.ErrNotPublished, syscall.ENOENT},   // no such published directory or content
	{cluster.ErrNotPublisher, syscall.EPERM},    // the directory is another uid's publish
	{cluster.ErrTooLarge, syscall.E2BIG},        // an entry's attributes exceed what etcd takes
	{cluster.ErrInvalid, syscall.EINVAL},        // a name or entry a publish refuses
	{cluster.ErrCorrupt, syscall.EBADMSG},       // what etcd holds does not match its address
	{cluster.ErrBadCopy, syscall.EIO},           // bytes held here fail their published hashes
	{cluster.ErrNameInUse, syscall.EADDRINUSE},  // another live daemon has this node's name
	{cluster.ErrNoHolder, syscall.EHOSTUNREACH}, // no live node holds a piece still needed
	{cluster.ErrBusy, syscall.EBUSY},            // the content is being pulled already
	{cluster.ErrClosed, syscall.ESHUTDOWN},      // the daemon is leaving the cluster
}

// toErrno maps an error from alloc, gpu or the kernel to the errno a
// client sees (errnos, then the chain's own syscall.Errno, else EIO).
func toErrno(err error) syscall.Errno {
	errno, _ := mapErrno(err)
	return errno
}

// mapErrno is toErrno that also reports whether a rule or the chain knew
// the error; an unknown one is EIO.
func mapErrno(err error) (syscall.Errno, bool) {
	if err == nil {
		return 0, true
	}
	for _, r := range errnos {
		if errors.Is(err, r.err) {
			return r.errno, true
		}
	}
	var errno syscall.Errno
	switch {
	case errors.As(err, &errno):
		return errno, true
	case errors.Is(err, fs.ErrNotExist):
		return syscall.ENOENT, true
	case errors.Is(err, fs.ErrPermission):
		return syscall.EACCES, true
	}
	return syscall.EIO, false
}
