package ctl

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"tensorfs/fdpass"
	"tensorfs/ledger"
)

var errBoom = errors.New("boom")

// fakeBackend serves segments from memfds.
type fakeBackend struct {
	mu       sync.Mutex
	segs     map[string]*os.File // read-write memfds
	imported map[string]*imported
	creds    []Cred
	slow     chan struct{} // Export("slow") waits for it
}

type imported struct {
	f            *os.File // a duplicate of the peer's descriptor
	data         string   // read through it during Import
	dtype, shape string
}

func newFakeBackend(t *testing.T, segs map[string]string) *fakeBackend {
	b := &fakeBackend{segs: make(map[string]*os.File), imported: make(map[string]*imported), slow: make(chan struct{})}
	for name, data := range segs {
		b.segs[name] = memfd(t, data)
	}
	t.Cleanup(func() {
		for _, f := range b.segs {
			f.Close()
		}
		for _, im := range b.imported {
			im.f.Close()
		}
	})
	return b
}

func (b *fakeBackend) Export(cred Cred, path string, write bool) (*os.File, error) {
	b.mu.Lock()
	b.creds = append(b.creds, cred)
	f := b.segs[path]
	b.mu.Unlock()
	switch {
	case path == "slow":
		<-b.slow
		return nil, syscall.EAGAIN
	case path == "secret":
		return nil, &os.PathError{Op: "export", Path: path, Err: syscall.EPERM}
	case path == "boom":
		return nil, fmt.Errorf("export: %w", errBoom)
	case f == nil:
		return nil, &os.PathError{Op: "export", Path: path, Err: syscall.ENOENT}
	}
	flag := os.O_RDONLY
	if write {
		flag = os.O_RDWR
	}
	return os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", f.Fd()), flag, 0)
}

func (b *fakeBackend) Import(cred Cred, path string, f *os.File, dtype, shape string) error {
	data, err := io.ReadAll(io.NewSectionReader(f, 0, 1<<20))
	if err != nil {
		return err
	}
	fd, err := fdpass.Dup(f)
	if err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.creds = append(b.creds, cred)
	if old := b.imported[path]; old != nil {
		old.f.Close()
	}
	b.imported[path] = &imported{f: os.NewFile(uintptr(fd), path), data: string(data), dtype: dtype, shape: shape}
	return nil
}

// memfd returns a memfd holding data.
func memfd(t *testing.T, data string) *os.File {
	t.Helper()
	fd, err := unix.MemfdCreate("ctl-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "memfd")
	if _, err := f.WriteString(data); err != nil {
		t.Fatal(err)
	}
	return f
}

// contents reads all of f from offset 0.
func contents(t *testing.T, f *os.File) string {
	t.Helper()
	b, err := io.ReadAll(io.NewSectionReader(f, 0, 1<<20))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// startServer listens on a fresh socket; Close runs at cleanup.
func startServer(t *testing.T, b Backend, wait time.Duration) (*Server, string) {
	t.Helper()
	return listen(t, Config{Backend: b, MaxGroupWait: wait})
}

// listen listens with cfg on a fresh socket (Path and Errno are set
// here); Close runs at cleanup.
func listen(t *testing.T, cfg Config) (*Server, string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "ctl")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	cfg.Path = filepath.Join(dir, "ctl.sock")
	cfg.Errno = func(err error) syscall.Errno {
		if errors.Is(err, errBoom) {
			return syscall.EBUSY
		}
		return defaultErrno(err)
	}
	s, err := Listen(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, cfg.Path
}

func dial(t *testing.T, path string) *Client {
	t.Helper()
	c, err := Dial(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func wantErrno(t *testing.T, err error, errno syscall.Errno) {
	t.Helper()
	var re *RemoteError
	if !errors.As(err, &re) || !errors.Is(err, errno) || re.Msg == "" {
		t.Fatalf("got %v, want a RemoteError with %v", err, errno)
	}
}

func TestExportImport(t *testing.T) {
	b := newFakeBackend(t, map[string]string{"a/w": "weights"})
	_, path := startServer(t, b, 0)
	c := dial(t, path)

	ro, err := c.Export("a//./w", false)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	if got := contents(t, ro); got != "weights" {
		t.Fatalf("exported %q", got)
	}
	if _, err := ro.WriteAt([]byte("x"), 0); err == nil {
		t.Fatal("read-only export is writable")
	}
	rw, err := c.Export("a/w", true)
	if err != nil {
		t.Fatal(err)
	}
	defer rw.Close()
	if _, err := rw.WriteAt([]byte("W"), 0); err != nil {
		t.Fatal(err)
	}
	if got := contents(t, ro); got != "Weights" {
		t.Fatalf("after a write through the rw export: %q", got)
	}

	src := memfd(t, "tensor")
	defer src.Close()
	if err := c.Import("x/./y/", src, "float32", "[6]"); err != nil {
		t.Fatal(err)
	}
	if err := c.Import("z", src, "", ""); err != nil {
		t.Fatal(err)
	}
	b.mu.Lock()
	im := b.imported["x/y"]
	b.mu.Unlock()
	if im == nil || im.data != "tensor" || im.dtype != "float32" || im.shape != "[6]" {
		t.Fatalf("imported %+v", im)
	}
	if _, err := src.WriteAt([]byte("T"), 0); err != nil {
		t.Fatal(err)
	}
	if got := contents(t, im.f); got != "Tensor" {
		t.Fatalf("import copied: the backend reads %q", got)
	}
	if _, err := src.Write(nil); err != nil {
		t.Fatalf("Import closed the caller's file: %v", err)
	}
	for _, cred := range b.creds {
		if cred.Pid != int32(os.Getpid()) || cred.Uid != uint32(os.Getuid()) || cred.Gid != uint32(os.Getgid()) {
			t.Fatalf("cred %+v", cred)
		}
	}
}

func TestErrorReplies(t *testing.T) {
	b := newFakeBackend(t, nil)
	_, path := startServer(t, b, 0)
	c := dial(t, path)
	for _, tc := range []struct {
		path  string
		errno syscall.Errno
	}{
		{"missing", syscall.ENOENT},
		{"secret", syscall.EPERM},
		{"boom", syscall.EBUSY},
		{"../etc/passwd", syscall.EINVAL},
		{"/etc/passwd", syscall.EINVAL},
		{"", syscall.EINVAL},
		{"a\x00b", syscall.EINVAL},
		{strings.Repeat("a", 5000), syscall.ENAMETOOLONG},
	} {
		f, err := c.Export(tc.path, false)
		if f != nil {
			t.Fatalf("Export(%q) returned a file", tc.path)
		}
		wantErrno(t, err, tc.errno)
		if re := (*RemoteError)(nil); errors.As(err, &re) && re.Op != "export" {
			t.Fatalf("op %q", re.Op)
		}
	}
	wantErrno(t, c.Import("x", nil, "", ""), syscall.EINVAL)
	if !errors.Is(c.Import("/x", memfdClosed(t), "", ""), syscall.EINVAL) {
		t.Fatal("absolute import path accepted")
	}
	_, err := c.AllGather("g", 5, 2, memfdClosed(t))
	wantErrno(t, err, syscall.EINVAL)
	_, err = c.AllGather("g", 0, 300, memfdClosed(t))
	wantErrno(t, err, syscall.EINVAL)
	if _, err := c.Broadcast("g", 0, 2, 0, nil); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("broadcast root without a file: %v", err)
	}
}

// memfdClosed returns a memfd closed at cleanup.
func memfdClosed(t *testing.T) *os.File {
	f := memfd(t, "x")
	t.Cleanup(func() { f.Close() })
	return f
}

func TestAllGather(t *testing.T) {
	_, path := startServer(t, newFakeBackend(t, nil), 0)
	const world = 4
	clients := make([]*Client, world)
	for i := range clients {
		clients[i] = dial(t, path)
	}
	for round := range 3 { // the group name is free again after each round
		var wg sync.WaitGroup
		got := make([][]*os.File, world)
		errs := make([]error, world)
		for rank := range world {
			wg.Go(func() {
				f := memfd(t, fmt.Sprintf("rank %d round %d", rank, round))
				defer f.Close()
				got[rank], errs[rank] = clients[rank].AllGather("step", rank, world, f)
			})
		}
		wg.Wait()
		for rank := range world {
			if errs[rank] != nil {
				t.Fatalf("rank %d: %v", rank, errs[rank])
			}
			if len(got[rank]) != world {
				t.Fatalf("rank %d got %d files", rank, len(got[rank]))
			}
			for i, f := range got[rank] {
				if s := contents(t, f); s != fmt.Sprintf("rank %d round %d", i, round) {
					t.Fatalf("rank %d, file %d: %q", rank, i, s)
				}
				f.Close()
			}
		}
	}
	one, err := clients[0].AllGather("solo", 0, 1, memfdClosed(t))
	if err != nil || len(one) != 1 || contents(t, one[0]) != "x" {
		t.Fatalf("world 1: %v, %v", one, err)
	}
	one[0].Close()
}

func TestBroadcast(t *testing.T) {
	_, path := startServer(t, newFakeBackend(t, nil), 0)
	const world, root = 3, 1
	var wg sync.WaitGroup
	got := make([]*os.File, world)
	errs := make([]error, world)
	for rank := range world {
		c := dial(t, path)
		wg.Go(func() {
			var f *os.File
			if rank == root {
				f = memfd(t, "from the root")
				defer f.Close()
			}
			got[rank], errs[rank] = c.Broadcast("bc", rank, world, root, f)
		})
	}
	wg.Wait()
	for rank := range world {
		switch {
		case errs[rank] != nil:
			t.Fatalf("rank %d: %v", rank, errs[rank])
		case rank == root && got[rank] != nil:
			t.Fatal("the root received a file")
		case rank != root && contents(t, got[rank]) != "from the root":
			t.Fatalf("rank %d got %q", rank, contents(t, got[rank]))
		}
		if got[rank] != nil {
			got[rank].Close()
		}
	}
}

func TestGroupTimeout(t *testing.T) {
	const wait = 300 * time.Millisecond
	s, path := startServer(t, newFakeBackend(t, nil), wait)
	start := time.Now()
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for rank := range 2 {
		c := dial(t, path)
		wg.Go(func() {
			_, errs[rank] = c.AllGather("late", rank, 3, memfdClosed(t))
		})
	}
	wg.Wait()
	if d := time.Since(start); d < wait {
		t.Fatalf("timed out after %v", d)
	}
	for _, err := range errs {
		wantErrno(t, err, syscall.ETIMEDOUT)
	}
	waitJoined(t, s, "late", 0)
	if _, err := dial(t, path).Broadcast("late", 0, 1, 0, memfdClosed(t)); err != nil {
		t.Fatalf("group name not free after a timeout: %v", err)
	}
}

// waitJoined waits until root's group name has n waiting members (0: is
// gone).
func waitJoined(t *testing.T, s *Server, name string, n int) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		s.groups.mu.Lock()
		joined := 0
		if g := s.groups.m[groupKey{name: name}]; g != nil {
			joined = g.joined
		}
		s.groups.mu.Unlock()
		if joined == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("group %q has %d members, want %d", name, joined, n)
		}
	}
}

func TestGroupMembership(t *testing.T) {
	s, path := startServer(t, newFakeBackend(t, nil), 0)

	// Rank 0 joins, then disconnects while waiting: it leaves the group.
	gone := dial(t, path)
	goneErr := make(chan error, 1)
	go func() {
		_, err := gone.AllGather("g", 0, 2, memfdClosed(t))
		goneErr <- err
	}()
	waitJoined(t, s, "g", 1)
	gone.Close()
	if err := <-goneErr; err == nil {
		t.Fatal("AllGather on a closed client succeeded")
	}
	waitJoined(t, s, "g", 0)

	// A new rank 0 waits; duplicates and inconsistent requests are refused
	// without disturbing it; rank 1 completes the group.
	c0 := dial(t, path)
	done := make(chan []*os.File, 1)
	go func() {
		f := memfd(t, "new rank 0")
		defer f.Close()
		files, err := c0.AllGather("g", 0, 2, f)
		if err != nil {
			t.Error(err)
		}
		done <- files
	}()
	waitJoined(t, s, "g", 1)
	c1 := dial(t, path)
	_, err := c1.AllGather("g", 0, 2, memfdClosed(t))
	wantErrno(t, err, syscall.EINVAL)
	_, err = c1.AllGather("g", 1, 3, memfdClosed(t))
	wantErrno(t, err, syscall.EINVAL)
	_, err = c1.Broadcast("g", 1, 2, 0, nil)
	wantErrno(t, err, syscall.EINVAL)
	waitJoined(t, s, "g", 1)
	files, err := c1.AllGather("g", 1, 2, memfdClosed(t))
	if err != nil {
		t.Fatal(err)
	}
	files0 := <-done
	for _, fs := range [][]*os.File{files, files0} {
		if len(fs) != 2 || contents(t, fs[0]) != "new rank 0" || contents(t, fs[1]) != "x" {
			t.Fatalf("got %v", fs)
		}
		for _, f := range fs {
			f.Close()
		}
	}
}

// TestGroupKeys: groups are keyed by uid and name. Root and another uid
// using a uid's group name form groups of their own and never get its
// descriptors, nor it theirs; an open group takes every uid that asks for
// one. Waiting members count in their uid's Parked.
func TestGroupKeys(t *testing.T) {
	q := newQuota(ledger.New(), nil, perUIDCap(defaultTotal), defaultTotal)
	gs := newGroups(time.Minute, q)
	newFD := func(uid uint32) int {
		f := memfd(t, "x")
		defer f.Close()
		fd, err := fdpass.Dup(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := q.adopt(uid, []int{fd}); err != nil {
			t.Fatal(err)
		}
		return fd
	}
	type joined struct {
		g  *group
		m  *member
		fd int
	}
	join := func(uid uint32, rank int, open bool) joined {
		t.Helper()
		fd := newFD(uid)
		g, m, err := gs.join(Cred{Uid: uid}, &request{Op: opAllGather, Group: "step7", Rank: rank, World: 2, Open: open}, fd)
		if err != nil {
			t.Fatal(err)
		}
		return joined{g, m, fd}
	}
	waiting := func(j joined) bool {
		select {
		case o := <-j.m.done:
			j.m.done <- o
			return false
		default:
			return true
		}
	}
	// got checks that ranks a and b received want, and releases them.
	got := func(a, b joined, want ...int) {
		t.Helper()
		for _, j := range []joined{a, b} {
			o := <-j.m.done
			if o.err != nil || !slices.Equal(o.fds, want) {
				t.Errorf("uid %d rank %d got %v, %v; want %v", j.m.uid, j.m.rank, o.fds, o.err, want)
			}
			o.shared.release()
		}
	}

	a1 := join(1000, 1, false)
	r0 := join(0, 0, false) // root, same name: its own group
	b0 := join(1001, 0, false)
	o0 := join(1000, 0, true) // open: another group again
	if !waiting(a1) || !waiting(r0) || !waiting(b0) || !waiting(o0) || len(gs.m) != 4 {
		t.Fatalf("%d groups, want 4 waiting", len(gs.m))
	}
	if q.sum().Parked != 4 || q.held(1000).Parked != 2 {
		t.Fatalf("parked: %+v in all, %+v for uid 1000", q.sum(), q.held(1000))
	}
	a0 := join(1000, 0, false)
	got(a0, a1, a0.fd, a1.fd)
	o1 := join(0, 1, true) // root opts in to the open group
	got(o0, o1, o0.fd, o1.fd)
	r1 := join(0, 1, false)
	got(r0, r1, r0.fd, r1.fd)
	if !gs.leave(b0.g, b0.m) {
		t.Fatal("uid 1001's rank could not leave")
	}
	q.waitClosing(time.Minute)
	if len(gs.m) != 0 || q.sum() != (Limits{}) || len(q.owner) != 0 {
		t.Fatalf("%d groups, %+v counted, %d descriptors left", len(gs.m), q.sum(), len(q.owner))
	}
}

// TestOpenGroup: ranks asking for an open group meet there, apart from
// their uid's own group of that name.
func TestOpenGroup(t *testing.T) {
	s, path := startServer(t, newFakeBackend(t, nil), 0)
	own := dial(t, path)
	go func() { own.AllGather("g", 1, 2, memfdClosed(t)) }() // ends with Close
	waitJoined(t, s, "g", 1)
	done := make(chan []*os.File, 1)
	c0 := dial(t, path)
	go func() {
		f := memfd(t, "open 0")
		defer f.Close()
		files, err := c0.AllGather("g", 0, 2, f, OpenGroup())
		if err != nil {
			t.Error(err)
		}
		done <- files
	}()
	open := groupKey{name: "g", open: true}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		s.groups.mu.Lock()
		g := s.groups.m[open]
		s.groups.mu.Unlock()
		if g != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no open group")
		}
	}
	f := memfd(t, "open 1")
	defer f.Close()
	files, err := dial(t, path).AllGather("g", 1, 2, f, OpenGroup())
	if err != nil {
		t.Fatal(err)
	}
	for _, fs := range [][]*os.File{files, <-done} {
		if len(fs) != 2 || contents(t, fs[0]) != "open 0" || contents(t, fs[1]) != "open 1" {
			t.Fatalf("got %v", fs)
		}
		for _, f := range fs {
			f.Close()
		}
	}
	waitJoined(t, s, "g", 1) // the uid's own group still waits

	bc := dial(t, path)
	go func() { bc.Broadcast("b", 0, 2, 0, f, OpenGroup()) }()
	got, err := dial(t, path).Broadcast("b", 1, 2, 0, nil, OpenGroup())
	if err != nil || contents(t, got) != "open 1" {
		t.Fatalf("open broadcast: %v", err)
	}
	got.Close()
}

// rawConn dials the socket without the Client, to send anything.
func rawConn(t *testing.T, path string) *net.UnixConn {
	t.Helper()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// exchange sends b with nfds memfds attached and returns the reply.
func exchange(t *testing.T, c *net.UnixConn, b []byte, nfds int) reply {
	t.Helper()
	var fds []int
	for range nfds {
		f := memfd(t, "x")
		defer f.Close()
		fds = append(fds, int(f.Fd()))
	}
	if err := fdpass.Send(c, b, fds...); err != nil {
		t.Fatal(err)
	}
	m, err := recvMsg(c, maxWorld)
	if err != nil {
		t.Fatal(err)
	}
	fdpass.Close(m.FDs)
	rep, err := checkReply(m)
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

func TestMalformed(t *testing.T) {
	_, path := startServer(t, newFakeBackend(t, map[string]string{"a": "A"}), 0)
	c := rawConn(t, path)
	exact := []byte(`{"v":1,"op":"export","path":"a"}`)
	exact = append(exact, strings.Repeat(" ", maxMessage-len(exact))...)
	for _, tc := range []struct {
		msg   string
		nfds  int
		errno syscall.Errno
	}{
		{"not json", 0, syscall.EINVAL},
		{"\x00\xff\xfe", 2, syscall.EINVAL},
		{`{"v":7,"op":"export","path":"a"}`, 0, syscall.EPROTONOSUPPORT},
		{`{"v":1,"op":"mmap","path":"a"}`, 1, syscall.EOPNOTSUPP},
		{`{"v":1,"op":"export","path":"a"}`, 1, syscall.EINVAL},
		{`{"v":1,"op":"import","path":"a"}`, 0, syscall.EINVAL},
		{`{"v":1,"op":"import","path":"a"}`, 3, syscall.EINVAL},
		{`{"v":1,"op":"import","path":"a"}`, maxRequestFDs + 1, syscall.EINVAL}, // MSG_CTRUNC
		{`{"v":1,"op":"export","path":"a","pad":"` + strings.Repeat("x", maxMessage) + `"}`, 1, syscall.EMSGSIZE},
		{string(exact), 0, 0},
	} {
		rep := exchange(t, c, []byte(tc.msg), tc.nfds)
		if tc.errno == 0 {
			if !rep.OK || rep.FDs != 1 {
				t.Fatalf("%.40q: %+v", tc.msg, rep)
			}
			continue
		}
		if rep.OK || syscall.Errno(rep.Errno) != tc.errno || rep.Error == "" {
			t.Fatalf("%.40q with %d fds: %+v, want errno %v", tc.msg, tc.nfds, rep, tc.errno)
		}
	}
	// An empty message ends the session, closing any descriptors that came
	// with it; a new connection works.
	sendEmpty(t, c, int(memfdClosed(t).Fd()))
	if n, _, _, _, err := c.ReadMsgUnix(make([]byte, 16), nil); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("after an empty message: %d, %v", n, err)
	}
	f, err := dial(t, path).Export("a", false)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
}

// sendEmpty sends a zero-length message with fd attached, as a C or Python
// client can (Go's sendmsg adds a byte).
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

// TestNoBlocking checks that a stuck backend call, an idle connection and
// a waiting group do not hold up other clients.
func TestNoBlocking(t *testing.T) {
	b := newFakeBackend(t, map[string]string{"a": "A"})
	s, path := startServer(t, b, 0)
	_ = rawConn(t, path) // idle
	slow := dial(t, path)
	slowErr := make(chan error, 1)
	go func() { _, err := slow.Export("slow", false); slowErr <- err }()
	waiter := dial(t, path)
	go func() { waiter.AllGather("never", 0, 2, memfdClosed(t)) }()
	waitJoined(t, s, "never", 1)
	f, err := dial(t, path).Export("a", false)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	close(b.slow)
	wantErrno(t, <-slowErr, syscall.EAGAIN)
}

func TestListenClose(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "s")

	// A stale socket file is replaced.
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: path}); err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)
	s, err := Listen(Config{Path: path, Backend: newFakeBackend(t, nil)})
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o666 {
		t.Fatalf("socket mode: %v, %v", fi, err)
	}
	// A live socket is not.
	if _, err := Listen(Config{Path: path, Backend: newFakeBackend(t, nil)}); !errors.Is(err, syscall.EADDRINUSE) {
		t.Fatalf("second Listen: %v", err)
	}

	// Close ends waiting members and is idempotent.
	c := dial(t, path)
	waitErr := make(chan error, 1)
	go func() { _, err := c.AllGather("g", 0, 2, memfdClosed(t)); waitErr <- err }()
	waitJoined(t, s, "g", 1)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-waitErr; err == nil {
		t.Fatal("AllGather survived Close")
	}
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket file after Close: %v", err)
	}
	if _, err := Dial(path); err == nil {
		t.Fatal("Dial after Close")
	}

	// A regular file is never removed.
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(Config{Path: path, Backend: newFakeBackend(t, nil)}); err == nil {
		t.Fatal("Listen over a regular file")
	}
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

// TestNoFDLeak runs every path, successful or not, and checks that the
// process holds the same descriptors afterwards.
func TestNoFDLeak(t *testing.T) {
	warm := newFakeBackend(t, nil)
	s0, p0 := startServer(t, warm, 0)
	dial(t, p0).Close()
	s0.Close()

	before := openFDs(t)
	func() {
		b := newFakeBackend(t, map[string]string{"a": "A"})
		s, path := startServer(t, b, 200*time.Millisecond)
		defer s.Close()
		c, err := Dial(path)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		f, err := c.Export("a", true)
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
		c.Export("missing", false)
		src := memfd(t, "imp")
		c.Import("i", src, "", "")
		c.Import("../i", src, "", "")
		src.Close()

		raw, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
		if err != nil {
			t.Fatal(err)
		}
		exchange(t, raw, []byte("junk"), 3)
		exchange(t, raw, []byte(`{"v":1,"op":"import","path":"a"}`), maxRequestFDs+5)
		exchange(t, raw, []byte(strings.Repeat(" ", maxMessage+10)), 2)
		ef := memfd(t, "empty")
		sendEmpty(t, raw, int(ef.Fd()))
		ef.Close()
		if _, err := recvMsg(raw, 0); !errors.Is(err, io.EOF) {
			t.Fatalf("after an empty message: %v", err)
		}
		raw.Close()

		var wg sync.WaitGroup
		for rank := range 3 {
			wg.Go(func() {
				c, err := Dial(path)
				if err != nil {
					t.Error(err)
					return
				}
				defer c.Close()
				f := memfd(t, "g")
				defer f.Close()
				files, err := c.AllGather("leak", rank, 3, f)
				if err != nil {
					t.Error(err)
				}
				for _, f := range files {
					f.Close()
				}
				c.AllGather("timeout", rank, 4, f) // times out
				var bf *os.File
				if rank == 0 {
					bf = f
				}
				if got, _ := c.Broadcast("bc", rank, 3, 0, bf); got != nil {
					got.Close()
				}
			})
		}
		wg.Wait()

		gone, err := Dial(path)
		if err != nil {
			t.Fatal(err)
		}
		lf := memfd(t, "left")
		left := make(chan struct{})
		go func() { gone.AllGather("left", 0, 2, lf); close(left) }()
		waitJoined(t, s, "left", 1)
		gone.Close()
		waitJoined(t, s, "left", 0)
		<-left
		lf.Close()

		b.mu.Lock()
		for name, im := range b.imported {
			im.f.Close()
			delete(b.imported, name)
		}
		b.mu.Unlock()
		for name, f := range b.segs {
			f.Close()
			delete(b.segs, name)
		}
		s.Close()
		if s.quota.sum() != (Limits{}) || len(s.quota.owner) != 0 {
			t.Errorf("after Close: %+v counted, %d descriptors", s.quota.sum(), len(s.quota.owner))
		}
	}()
	if after := openFDs(t); after != before {
		t.Fatalf("%d descriptors before, %d after", before, after)
	}
}

// TestCloseDrains: Close ends an idle connection at once, so that its
// client's next request fails to send (EPIPE: the server read nothing,
// so a client may send it again to a successor), answers the request
// being served before it closes that connection, and closes one still
// busy after drainWait (its answer then reaches no one).
func TestCloseDrains(t *testing.T) {
	b := newFakeBackend(t, map[string]string{"w": "weights"})
	s, path := startServer(t, b, time.Second)
	idle, busy := dial(t, path), dial(t, path)
	if f, err := idle.Export("w", false); err != nil {
		t.Fatal(err)
	} else {
		f.Close()
	}
	answered := make(chan error, 1)
	go func() { _, err := busy.Export("slow", false); answered <- err }()
	b.waitRequests(2) // busy's request is being served
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	deadline := time.Now().Add(drainWait)
	for {
		_, err := idle.Export("w", false)
		if errors.Is(err, syscall.EPIPE) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("an idle connection's request during Close: %v, want EPIPE", err)
		}
		time.Sleep(time.Millisecond)
	}
	b.slow <- struct{}{}
	wantErrno(t, <-answered, syscall.EAGAIN) // the backend's answer, not a closed connection
	if err := <-closed; err != nil {
		t.Fatal(err)
	}

	// A request still served after drainWait is cut off.
	b2 := newFakeBackend(t, nil)
	s2, path2 := startServer(t, b2, time.Second)
	stuck := dial(t, path2)
	go func() { _, err := stuck.Export("slow", false); answered <- err }()
	b2.waitRequests(1)
	t0 := time.Now()
	// Close waits for its handler to return, which this backend's does
	// only when told.
	go func() { time.Sleep(drainWait + 100*time.Millisecond); close(b2.slow) }()
	if err := s2.Close(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(t0); d < drainWait || d > drainWait+5*time.Second {
		t.Errorf("Close with a request served past drainWait took %v, want about %v", d, drainWait)
	}
	if err := <-answered; err == nil || errors.Is(err, syscall.EAGAIN) {
		t.Errorf("the request cut off by Close: %v, want a closed connection", err)
	}
}

// waitRequests waits until b has seen n requests.
func (b *fakeBackend) waitRequests(n int) {
	for {
		b.mu.Lock()
		seen := len(b.creds)
		b.mu.Unlock()
		if seen >= n {
			return
		}
		time.Sleep(time.Millisecond)
	}
}
