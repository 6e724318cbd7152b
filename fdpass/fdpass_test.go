package fdpass

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// pair returns the two ends of a SOCK_SEQPACKET socket pair.
func pair(t *testing.T) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var conns [2]*net.UnixConn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "seqpacket")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = c.(*net.UnixConn)
		t.Cleanup(func() { c.Close() })
	}
	return conns[0], conns[1]
}

// memfd returns a memfd's descriptor; the cleanup closes it.
func memfd(t *testing.T) int {
	t.Helper()
	fd, err := unix.MemfdCreate("fdpass-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// ino returns the inode fd refers to.
func ino(t *testing.T, fd int) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatalf("fstat %d: %v", fd, err)
	}
	return st.Ino
}

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestRoundTrip: bytes and descriptors arrive together, in order, as new
// close-on-exec descriptors of the same files; the sender keeps its own.
func TestRoundTrip(t *testing.T) {
	a, b := pair(t)
	sent := []int{memfd(t), memfd(t)}
	if err := Send(a, []byte("hello"), sent...); err != nil {
		t.Fatal(err)
	}
	m, err := Recv(b, 64, 4)
	if err != nil {
		t.Fatal(err)
	}
	defer Close(m.FDs)
	if string(m.Data) != "hello" || m.Truncated || m.FDsTruncated || len(m.FDs) != 2 {
		t.Fatalf("got %+v", m)
	}
	for i, fd := range m.FDs {
		if ino(t, fd) != ino(t, sent[i]) {
			t.Errorf("descriptor %d is not the file sent", i)
		}
		if flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil || flags&unix.FD_CLOEXEC == 0 {
			t.Errorf("descriptor %d: flags %#x, %v; want close-on-exec", i, flags, err)
		}
	}
	for _, fd := range sent {
		ino(t, fd) // still open
	}

	// Without descriptors.
	if err := Send(b, []byte("plain")); err != nil {
		t.Fatal(err)
	}
	if m, err := Recv(a, 64, 0); err != nil || string(m.Data) != "plain" || len(m.FDs) != 0 {
		t.Fatalf("plain message: %+v, %v", m, err)
	}
}

// TestTruncation: a message longer than the room is cut and flagged; more
// descriptors than the room are flagged and those beyond it never reach
// the receiver.
func TestTruncation(t *testing.T) {
	a, b := pair(t)
	long := bytes.Repeat([]byte("x"), 100)
	if err := Send(a, long); err != nil {
		t.Fatal(err)
	}
	m, err := Recv(b, 10, 0)
	if err != nil || !m.Truncated || string(m.Data) != string(long[:10]) {
		t.Fatalf("long message: %+v, %v", m, err)
	}

	three := []int{memfd(t), memfd(t), memfd(t)}
	before := openFDs(t)
	if err := Send(a, []byte("fds"), three...); err != nil {
		t.Fatal(err)
	}
	m, err = Recv(b, 64, 1)
	// Room for one descriptor may hold two, as control messages are
	// padded to 8 bytes; never three.
	if err != nil || !m.FDsTruncated || len(m.FDs) == 0 || len(m.FDs) > 2 {
		t.Fatalf("too many descriptors: %+v, %v", m, err)
	}
	Close(m.FDs)
	if after := openFDs(t); after != before {
		t.Errorf("%d descriptors open after a truncated receive, %d before", after, before)
	}
}

// TestEOF: a zero-length message ends the session and closes what came
// with it; so does the peer closing.
func TestEOF(t *testing.T) {
	a, b := pair(t)
	fd := memfd(t)
	before := openFDs(t)
	sendEmpty(t, a, fd)
	if _, err := Recv(b, 64, 4); !errors.Is(err, io.EOF) {
		t.Fatalf("zero-length message: %v, want io.EOF", err)
	}
	if after := openFDs(t); after != before {
		t.Errorf("%d descriptors open after a zero-length message with one attached, %d before", after, before)
	}
	a.Close()
	if _, err := Recv(b, 64, 4); !errors.Is(err, io.EOF) {
		t.Fatalf("after the peer closed: %v, want io.EOF", err)
	}
}

// sendEmpty sends a zero-length message with fd attached, which Send
// cannot (the syscall package sends a byte with descriptors).
func sendEmpty(t *testing.T, c *net.UnixConn, fd int) {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	oob := unix.UnixRights(fd)
	msg := unix.Msghdr{Control: &oob[0]}
	msg.SetControllen(len(oob))
	var errno syscall.Errno
	if err := rc.Control(func(s uintptr) {
		_, _, errno = unix.Syscall(unix.SYS_SENDMSG, s, uintptr(unsafe.Pointer(&msg)), 0)
	}); err != nil {
		t.Fatal(err)
	}
	if errno != 0 {
		t.Fatal(errno)
	}
}

// TestDeadline: Recv honours the connection's read deadline.
func TestDeadline(t *testing.T) {
	_, b := pair(t)
	b.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	if _, err := Recv(b, 64, 1); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Recv with nothing to read: %v, want a deadline error", err)
	}
}

// TestDup: a duplicate is a new close-on-exec descriptor of the same file,
// and the file stays non-blocking (f.Fd would have cleared O_NONBLOCK).
func TestDup(t *testing.T) {
	if _, err := Dup(nil); !errors.Is(err, os.ErrInvalid) {
		t.Errorf("Dup(nil) = %v, want os.ErrInvalid", err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	fd, err := Dup(r)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	rc, _ := r.SyscallConn()
	var orig int
	var status int
	rc.Control(func(p uintptr) {
		orig = int(p)
		status, _ = unix.FcntlInt(p, unix.F_GETFL, 0)
	})
	if fd == orig || ino(t, fd) != ino(t, orig) {
		t.Errorf("Dup gave %d for %d", fd, orig)
	}
	if flags, _ := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); flags&unix.FD_CLOEXEC == 0 {
		t.Error("duplicate is not close-on-exec")
	}
	if status&unix.O_NONBLOCK == 0 {
		t.Error("Dup put the file into blocking mode")
	}
}

// TestReopen: a reopen is the same file on a description of its own, with
// the access asked for.
func TestReopen(t *testing.T) {
	fd, err := unix.MemfdCreate("reopen", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	unix.Write(fd, []byte("abcd"))
	ro, err := Reopen(fd, unix.O_RDONLY)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(ro)
	b := make([]byte, 4)
	if n, err := unix.Read(ro, b); err != nil || string(b[:n]) != "abcd" {
		t.Errorf("read through the reopen: %q, %v; want abcd from offset 0", b[:n], err)
	}
	if _, err := unix.Write(ro, []byte("x")); err == nil {
		t.Error("a read-only reopen took a write")
	}
}

// TestReopenNeverWaitsForLease: Reopen of a regular file that its owner
// holds a lease on answers EAGAIN at once instead of sleeping for
// lease-break-time, and a reopen that succeeds has no O_NONBLOCK.
func TestReopenNeverWaitsForLease(t *testing.T) {
	fd, err := unix.Open(t.TempDir(), unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	holder, err := Reopen(fd, unix.O_RDONLY)
	unix.Close(fd) // a read lease needs no writer
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(holder)
	if _, err := unix.FcntlInt(uintptr(holder), unix.F_SETLEASE, unix.F_RDLCK); err != nil {
		t.Skipf("no lease: %v", err)
	}
	start := time.Now()
	rw, err := Reopen(holder, unix.O_RDWR)
	if took := time.Since(start); !errors.Is(err, syscall.EAGAIN) || took > 2*time.Second {
		if err == nil {
			unix.Close(rw)
		}
		t.Fatalf("read-write reopen against a read lease: %v after %v, want EAGAIN at once", err, took)
	}
	unix.FcntlInt(uintptr(holder), unix.F_SETLEASE, unix.F_UNLCK)
	if rw, err = Reopen(holder, unix.O_RDWR); err != nil {
		t.Fatalf("read-write reopen once the lease is gone: %v", err)
	}
	defer unix.Close(rw)
	if fl, err := unix.FcntlInt(uintptr(rw), unix.F_GETFL, 0); err != nil || fl&unix.O_NONBLOCK != 0 {
		t.Errorf("reopen's flags %#o, %v: O_NONBLOCK kept", fl, err)
	}
}
