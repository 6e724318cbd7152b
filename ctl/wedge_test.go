package ctl

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/fdpass"
	"tensorfs/ledger"
)

// blockingClose returns a descriptor whose close(2) blocks until unblock
// is called (or a minute passes): a TCP socket lingering on data its peer
// does not read. The cleanup unblocks it.
func blockingClose(t *testing.T) (fd int, unblock func()) {
	t.Helper()
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var err error
		c.Control(func(fd uintptr) { err = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, 4096) })
		return err // the accepted socket inherits a small window
	}}
	l, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := l.(*net.TCPListener)
	defer ln.Close()
	fd, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUF, 4096); err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().(*net.TCPAddr)
	if err := unix.Connect(fd, &unix.SockaddrInet4{Port: addr.Port, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	peer, err := ln.AcceptTCP()
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		t.Fatal(err)
	}
	// Fill the peer's receive buffer and ours, until they have taken
	// nothing for 100ms: what is left can only go once the peer reads.
	buf := make([]byte, 1<<16)
	for idle := 0; idle < 10; {
		if _, err := unix.Write(fd, buf); err == unix.EAGAIN {
			idle++
			time.Sleep(10 * time.Millisecond)
		} else if err != nil {
			t.Fatal(err)
		} else {
			idle = 0
		}
	}
	if err := unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 60}); err != nil {
		t.Fatal(err)
	}
	once := sync.OnceFunc(func() {
		peer.SetLinger(0)
		peer.Close() // unread data: a reset, which ends the lingering close
	})
	t.Cleanup(once)
	return fd, once
}

// within fails unless fn returns within d.
func within(t *testing.T, d time.Duration, what string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		fn()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s: still blocked after %v", what, d)
	}
}

// TestBlockingClose (A2): a descriptor whose close blocks, left by a rank
// that leaves its group or times out, holds up neither the groups of
// others (no close under groups.mu) nor Server.Close for more than
// closingWait; it counts in its owner's descriptors until it is closed.
func TestBlockingClose(t *testing.T) {
	q := newQuota(ledger.New(), nil, perUIDCap(defaultTotal), defaultTotal)
	gs := newGroups(200*time.Millisecond, q)
	join := func(uid uint32, name string, rank, world int, fd int) (*group, *member) {
		t.Helper()
		if fd >= 0 {
			if err := q.adopt(uid, []int{fd}); err != nil {
				t.Fatal(err)
			}
		}
		g, m, err := gs.join(Cred{Uid: uid}, &request{Op: opAllGather, Group: name, Rank: rank, World: world}, fd)
		if err != nil {
			t.Fatal(err)
		}
		return g, m
	}
	newFD := func() int {
		f := memfd(t, "x")
		defer f.Close()
		fd, err := fdpass.Dup(f)
		if err != nil {
			t.Fatal(err)
		}
		return fd
	}
	// other completes a group of root's of two ranks and releases it.
	other := func(name string) {
		t.Helper()
		within(t, 5*time.Second, "root's group "+name, func() {
			_, m0 := join(0, name, 0, 2, newFD())
			_, m1 := join(0, name, 1, 2, newFD())
			for _, m := range []*member{m0, m1} {
				o := <-m.done
				if o.err != nil {
					t.Error(o.err)
					return
				}
				o.shared.release()
			}
		})
	}

	leaving, unblockLeaving := blockingClose(t)
	g, m := join(1000, "wedge", 0, 2, leaving)
	within(t, 5*time.Second, "leaving a group with a descriptor whose close blocks", func() { gs.leave(g, m) })
	other("after-leave")

	expiring, unblockExpiring := blockingClose(t)
	_, m = join(1000, "expire", 0, 2, expiring)
	if o := <-m.done; o.err == nil {
		t.Fatal("a group of one of two ranks did not time out")
	}
	other("after-expire")

	held := q.held(1000).FDs
	if held != 2 {
		t.Errorf("uid 1000 holds %d descriptors while their closes block, want 2", held)
	}
	if q.waitClosing(100 * time.Millisecond) {
		t.Fatal("closes that block were done")
	}

	// Server.Close waits for such closes at most closingWait.
	var logs lockedLog
	s, _ := listen(t, Config{Backend: newFakeBackend(t, nil), Log: slog.New(slog.NewTextHandler(&logs, nil))})
	serverFD, unblockServer := blockingClose(t)
	if err := s.quota.adopt(1000, []int{serverFD}); err != nil {
		t.Fatal(err)
	}
	s.quota.release(serverFD)
	within(t, closingWait+5*time.Second, "Server.Close", func() { s.Close() })
	if !strings.Contains(logs.String(), "still being closed") {
		t.Errorf("Close logged no word of the closes it left:\n%s", logs.String())
	}

	unblockLeaving()
	unblockExpiring()
	unblockServer()
	if !q.waitClosing(10*time.Second) || !s.quota.waitClosing(10*time.Second) {
		t.Fatal("closes still blocked once their peers let go")
	}
	if q.sum() != (Limits{}) || len(q.owner) != 0 || len(gs.m) != 0 {
		t.Fatalf("after the closes: %+v counted, %d descriptors, %d groups", q.sum(), len(q.owner), len(gs.m))
	}
}

// TestCollectiveFDKinds (A2): all_gather and broadcast take memory to
// map; a FIFO, a socket, a directory or an O_PATH descriptor is refused
// with EINVAL, logged once, and never joins the group. Regular files and
// anonymous inodes (an eventfd here, as CUDA's exported handles are) are
// shared.
func TestCollectiveFDKinds(t *testing.T) {
	var logs lockedLog
	s, path := listen(t, Config{Backend: newFakeBackend(t, nil), Log: slog.New(slog.NewTextHandler(&logs, nil))})
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	plain := filepath.Join(dir, "plain")
	if err := os.WriteFile(plain, []byte("p"), 0o600); err != nil {
		t.Fatal(err)
	}
	open := func(path string, flags int) *os.File {
		t.Helper()
		fd, err := unix.Open(path, flags|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		f := os.NewFile(uintptr(fd), path)
		t.Cleanup(func() { f.Close() })
		return f
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	sock := os.NewFile(uintptr(pair[0]), "socket")
	defer sock.Close()
	defer unix.Close(pair[1])
	for _, tc := range []struct {
		name string
		f    *os.File
	}{
		{"FIFO", open(fifo, unix.O_RDWR)},
		{"socket", sock},
		{"directory", open(dir, unix.O_RDONLY)},
		{"O_PATH descriptor", open(plain, unix.O_PATH)},
	} {
		c := dial(t, path)
		_, err := c.AllGather("kinds", 0, 2, tc.f)
		wantErrno(t, err, syscall.EINVAL)
		if !strings.Contains(err.Error(), tc.name) || !strings.Contains(err.Error(), "memory to map") {
			t.Errorf("%s: %v", tc.name, err)
		}
		_, err = c.Broadcast("kinds-bc", 0, 2, 0, tc.f)
		wantErrno(t, err, syscall.EINVAL)
		if n := strings.Count(logs.String(), tc.name+`"`); n != 2 {
			t.Errorf("%s: %d log lines, want one per refusal:\n%s", tc.name, n, logs.String())
		}
	}
	s.groups.mu.Lock()
	n := len(s.groups.m)
	s.groups.mu.Unlock()
	if n != 0 {
		t.Errorf("%d groups formed by refused requests", n)
	}
	// Regular files, a memfd or one on a filesystem, and an anonymous
	// inode are shared.
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	anon := os.NewFile(uintptr(efd), "eventfd")
	defer anon.Close()
	for _, f := range []*os.File{memfdClosed(t), open(plain, unix.O_RDONLY), anon} {
		files, err := dial(t, path).AllGather("one", 0, 1, f)
		if err != nil {
			t.Fatalf("%s: %v", f.Name(), err)
		}
		for _, f := range files {
			f.Close()
		}
	}
}

// lockedLog is a log destination safe for concurrent use.
type lockedLog struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *lockedLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *lockedLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// TestClosersBounded (K6): the closes of one uid's descriptors that
// block take at most its share of the threads row; the rest wait in its
// queue, still counted in its descriptors, and run once a close returns.
// Another uid's closes, and root's, are not held up behind them.
func TestClosersBounded(t *testing.T) {
	l := ledger.New()
	threads := l.Row(ledger.Spec{Name: "threads", Unit: "thread", PerUID: 2, Total: 64})
	q := newQuota(l, threads, perUIDCap(defaultTotal), defaultTotal)
	var unblocks []func()
	for range 5 {
		fd, unblock := blockingClose(t)
		unblocks = append(unblocks, unblock)
		if err := q.adopt(1000, []int{fd}); err != nil {
			t.Fatal(err)
		}
		q.release(fd)
	}
	if n := threads.Held(1000); n > 2 {
		t.Errorf("uid 1000 holds %d closer threads, past its share of 2", n)
	}
	// Two closers block; the other closes wait behind them, counted.
	if n := q.held(1000).FDs; n < 3 {
		t.Errorf("uid 1000 is charged %d descriptors while their closes wait, want at least 3", n)
	}
	for _, uid := range []uint32{1001, 0} { // another user, and root
		other, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := q.adopt(uid, []int{other}); err != nil {
			t.Fatal(err)
		}
		q.release(other)
		for deadline := time.Now().Add(5 * time.Second); q.held(uid).FDs != 0; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("uid %d's close waited behind uid 1000's", uid)
			}
		}
	}
	for _, unblock := range unblocks {
		unblock()
	}
	if !q.waitClosing(10 * time.Second) {
		t.Fatal("queued closes did not run once the blocked ones returned")
	}
	for deadline := time.Now().Add(5 * time.Second); threads.Used() != 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d closer threads still counted once every close returned", threads.Used())
		}
	}
	if q.sum() != (Limits{}) {
		t.Fatalf("after the closes: %+v counted", q.sum())
	}
}

// TestCloserWhenRowFull: a uid the threads row refuses (the mount's
// imports hold its share) still gets one closer of its own, so its
// closes run and a refused adopt is answered.
func TestCloserWhenRowFull(t *testing.T) {
	l := ledger.New()
	threads := l.Row(ledger.Spec{Name: "threads", Unit: "thread", PerUID: 1, Total: 64})
	threads.Take(1000, 1) // the mount's, for uid 1000
	q := newQuota(l, threads, perUIDCap(defaultTotal), defaultTotal)
	fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := q.adopt(1000, []int{fd}); err != nil {
		t.Fatal(err)
	}
	q.release(fd)
	if !q.waitClosing(5 * time.Second) {
		t.Fatal("a close of a uid whose share of threads the mount holds never ran")
	}
	for deadline := time.Now().Add(5 * time.Second); threads.Held(1000) != 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("uid 1000 holds %d threads once its close returned, want the mount's 1", threads.Held(1000))
		}
	}
}
