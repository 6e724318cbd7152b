// Package fdpass frames messages with descriptors attached (SCM_RIGHTS)
// on unix sockets of type SOCK_SEQPACKET, one message per packet: the
// framing that the control socket (package ctl) and the GPU helper
// protocol (package gpu) share. It knows nothing of what the bytes mean.
//
// Descriptors received are close-on-exec and belong to the caller, who
// must close them; so must a caller that drops a Msg.
package fdpass

import (
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// Msg is one received message.
type Msg struct {
	// Data is the message's bytes, a copy the caller owns.
	Data []byte
	// FDs are the descriptors attached to it, in order.
	FDs []int
	// Truncated is set when the message was longer than the room Recv
	// gave it (MSG_TRUNC): Data holds its start, the rest is lost.
	Truncated bool
	// FDsTruncated is set when more descriptors came than Recv had room
	// for (MSG_CTRUNC): the kernel closed those that did not fit.
	FDsTruncated bool
}

// buffers holds receive buffers, taken only once a message is there, so
// that connections waiting for one pin none.
var buffers sync.Pool

// Recv reads one message of up to maxBytes bytes with room for maxFDs
// descriptors; it honours c's read deadline. At the end of a session (the
// peer closed, or sent a zero-length message, which SOCK_SEQPACKET cannot
// tell apart) it returns io.EOF, having closed any descriptors that came.
func Recv(c *net.UnixConn, maxBytes, maxFDs int) (Msg, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return Msg{}, err
	}
	var m Msg
	var recvErr error
	oob := make([]byte, unix.CmsgSpace(4*maxFDs))
	err = rc.Read(func(fd uintptr) bool {
		bp, _ := buffers.Get().(*[]byte)
		if bp == nil || cap(*bp) < maxBytes {
			b := make([]byte, maxBytes)
			bp = &b
		}
		defer buffers.Put(bp)
		buf := (*bp)[:maxBytes]
		var n, oobn, flags int
		for {
			n, oobn, flags, _, recvErr = unix.Recvmsg(int(fd), buf, oob, unix.MSG_CMSG_CLOEXEC)
			if recvErr != unix.EINTR {
				break
			}
		}
		if recvErr == unix.EAGAIN {
			return false // wait until readable
		}
		if recvErr == nil {
			m.Data = append([]byte(nil), buf[:n]...)
			m.FDs = parseRights(oob[:oobn])
			m.Truncated = flags&unix.MSG_TRUNC != 0
			m.FDsTruncated = flags&unix.MSG_CTRUNC != 0
		}
		return true
	})
	switch {
	case err != nil:
		return Msg{}, err
	case recvErr != nil:
		return Msg{}, recvErr
	case len(m.Data) == 0:
		Close(m.FDs)
		return Msg{}, io.EOF
	}
	return m, nil
}

// parseRights returns the descriptors of all SCM_RIGHTS control messages
// in oob.
func parseRights(oob []byte) []int {
	var fds []int
	for len(oob) > 0 {
		hdr, data, rest, err := unix.ParseOneSocketControlMessage(oob)
		if err != nil {
			break // the kernel writes whole headers, even when truncating
		}
		if hdr.Level == unix.SOL_SOCKET && hdr.Type == unix.SCM_RIGHTS {
			rights, _ := unix.ParseUnixRights(&unix.SocketControlMessage{Header: hdr, Data: data})
			fds = append(fds, rights...)
		}
		oob = rest
	}
	return fds
}

// Send sends b as one message with fds attached. The descriptors stay the
// caller's.
func Send(c *net.UnixConn, b []byte, fds ...int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	n, _, err := c.WriteMsgUnix(b, oob, nil)
	if err == nil && n != len(b) {
		err = fmt.Errorf("short write: %d of %d bytes", n, len(b))
	}
	return err
}

// Raw returns f's descriptor itself, without putting f into blocking mode
// as f.Fd would: valid while f stays open, e.g. to send it.
func Raw(f *os.File) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	if err := rc.Control(func(d uintptr) { fd = int(d) }); err != nil {
		return -1, err
	}
	return fd, nil
}

// Dup returns a close-on-exec duplicate of f's descriptor, without
// putting f into blocking mode as f.Fd would.
func Dup(f *os.File) (int, error) {
	if f == nil {
		return -1, os.ErrInvalid
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return -1, err
	}
	dup, dupErr := -1, error(nil)
	if err := rc.Control(func(fd uintptr) { dup, dupErr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return -1, err
	}
	return dup, dupErr
}

// Reopen opens the file open at fd again with flags (O_RDONLY, O_RDWR),
// close-on-exec, through /proc/self/fd: a new open file description, with
// the access the file's own mode grants, checked to be the same file
// (ESTALE otherwise). Unlike a dup, it shares no offset, flags or locks
// with fd. A regular file is reopened without waiting for a lease on it
// to break: its owner may hold one, and the open answers an error that
// wraps EAGAIN at once (OpenNoWait).
func Reopen(fd, flags int) (int, error) {
	var st, nst unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return -1, err
	}
	nfd, err := reopen(fd, flags, st.Mode&unix.S_IFMT == unix.S_IFREG)
	if err != nil {
		return -1, err
	}
	if err := unix.Fstat(nfd, &nst); err != nil || nst.Ino != st.Ino || nst.Dev != st.Dev {
		unix.Close(nfd)
		return -1, fmt.Errorf("reopen reached another file: %w", syscall.ESTALE)
	}
	return nfd, nil
}

// reopen opens /proc/self/fd/fd with flags: a regular file (noWait)
// without waiting for a lease (OpenNoWait), other files with flags as
// given: O_NONBLOCK changes what an open of a FIFO or a device does.
func reopen(fd, flags int, noWait bool) (int, error) {
	path := "/proc/self/fd/" + strconv.Itoa(fd)
	if !noWait {
		return unix.Open(path, flags|unix.O_CLOEXEC, 0)
	}
	return OpenNoWait(path, flags)
}

// OpenNoWait opens the regular file at path with flags, close-on-exec,
// without waiting for a lease on it to break. The file's owner can take
// a lease on it (fcntl F_SETLEASE) through any descriptor of it; an open
// that conflicts would sleep until the holder gives it up or
// lease-break-time (45 s by default) passes, holding the caller's thread,
// descriptor slot and locks. The open is made with O_NONBLOCK, so the
// kernel starts the break and answers EWOULDBLOCK at once: ErrLeased,
// which wraps EAGAIN, for the requester to try again. O_NONBLOCK is then
// cleared unless flags ask for it, so the descriptor, which may be handed
// to the kernel (passthrough) or to a peer (export), is exactly what
// flags say; on a regular file it changes nothing else anyway. Only for
// regular files: O_NONBLOCK changes what an open of a FIFO or a device
// does.
func OpenNoWait(path string, flags int) (int, error) {
	return OpenAtNoWait(unix.AT_FDCWD, path, flags)
}

// OpenAtNoWait is OpenNoWait of name in the directory open at dirfd.
func OpenAtNoWait(dirfd int, name string, flags int) (int, error) {
	fd, err := unix.Openat(dirfd, name, flags|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	switch {
	case err == unix.EWOULDBLOCK:
		return -1, ErrLeased
	case err != nil:
		return -1, err
	case flags&unix.O_NONBLOCK != 0:
		return fd, nil
	}
	// F_SETFL changes only the status flags (O_APPEND, O_DIRECT,
	// O_NOATIME, O_NONBLOCK...): those of flags, less O_NONBLOCK, are
	// what the open set, so no F_GETFL is needed on this hot path.
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETFL, flags&^unix.O_NONBLOCK); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("clear O_NONBLOCK: %w", err)
	}
	return fd, nil
}

// ErrLeased is OpenNoWait's answer when a lease on the file stands in the
// way; it wraps EAGAIN.
var ErrLeased = fmt.Errorf("a lease on the file stands in the way; the daemon does not wait for it to break: %w", syscall.EAGAIN)

// Close closes descriptors, ignoring errors and skipping -1 (none).
func Close(fds []int) {
	for _, fd := range fds {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
}
