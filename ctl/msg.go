package ctl

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// A message is one received SOCK_SEQPACKET message.
type message struct {
	data  []byte
	fds   []int // close-on-exec, owned by the receiver
	flags int   // recvmsg flags: MSG_TRUNC, MSG_CTRUNC
	// err refuses the message before it is parsed: its descriptors were
	// over a limit and are closed.
	err error
}

// msgBuffers holds receive buffers of maxMessage bytes, so that idle
// connections pin none.
var msgBuffers = sync.Pool{New: func() any { return new([maxMessage]byte) }}

// recvMsg reads one message of up to maxMessage bytes with room for maxFDs
// descriptors, which are received close-on-exec. At end of session (the
// peer closed, or sent a zero-length message: SOCK_SEQPACKET cannot tell
// them apart) it returns io.EOF, having closed any descriptors that came
// with it.
func recvMsg(c *net.UnixConn, maxFDs int) (message, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return message{}, err
	}
	var m message
	var recvErr error
	oob := make([]byte, unix.CmsgSpace(4*maxFDs))
	err = rc.Read(func(fd uintptr) bool {
		buf := msgBuffers.Get().(*[maxMessage]byte)
		defer msgBuffers.Put(buf)
		var n, oobn int
		for {
			n, oobn, m.flags, _, recvErr = unix.Recvmsg(int(fd), buf[:], oob, unix.MSG_CMSG_CLOEXEC)
			if recvErr != unix.EINTR {
				break
			}
		}
		if recvErr == unix.EAGAIN {
			return false // wait until readable
		}
		if recvErr == nil {
			m.data = append([]byte(nil), buf[:n]...)
			m.fds = parseRights(oob[:oobn])
		}
		return true
	})
	switch {
	case err != nil:
		return message{}, err
	case recvErr != nil:
		return message{}, recvErr
	case len(m.data) == 0:
		closeFDs(m.fds)
		return message{}, io.EOF
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

// sendMsg sends b as one message with fds attached.
func sendMsg(c *net.UnixConn, b []byte, fds []int) error {
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

// dupFile returns a close-on-exec duplicate of f's descriptor, without
// putting f into blocking mode as f.Fd would.
func dupFile(f *os.File) (int, error) {
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

// sendReply sends r with fds attached.
func sendReply(c *net.UnixConn, r reply, fds []int) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return sendMsg(c, b, fds)
}

// closeFDs closes descriptors this package owns.
func closeFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}
