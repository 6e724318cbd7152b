package ctl

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/fdpass"
	"tensorfs/ledger"
)

// wantLimit checks that err is the EAGAIN refusal naming limit.
func wantLimit(t *testing.T, err error, limit string) {
	t.Helper()
	var pe *protoErr
	var re *RemoteError
	switch {
	case errors.As(err, &pe) && pe.errno == syscall.EAGAIN && strings.Contains(pe.msg, limit):
	case errors.As(err, &re) && re.Errno == syscall.EAGAIN && strings.Contains(re.Msg, limit):
	default:
		t.Fatalf("got %v, want EAGAIN for %q", err, limit)
	}
}

func TestQuota(t *testing.T) {
	q := newQuota(ledger.New(), nil, Limits{Conns: 2, Parked: 1, FDs: 3}, Limits{Conns: 3, Parked: 5, FDs: 5})
	conn := Limits{Conns: 1}
	for range 2 {
		if err := q.take(1000, conn); err != nil {
			t.Fatal(err)
		}
	}
	wantLimit(t, q.take(1000, conn), "uid 1000 reached the limit of 2 connections per uid")
	if err := q.take(1001, conn); err != nil {
		t.Fatal(err)
	}
	wantLimit(t, q.take(1001, conn), "uid 1001 reached the limit of 3 connections for users other than root")
	q.give(1000, conn)
	if err := q.take(1001, conn); err != nil {
		t.Fatalf("after a connection of another uid closed: %v", err)
	}
	if err := q.take(1000, Limits{Parked: 1}); err != nil {
		t.Fatal(err)
	}
	wantLimit(t, q.take(1000, Limits{Parked: 1}), "1 waiting collective requests per uid")

	fds := make([]int, 4)
	for i := range fds {
		f := memfd(t, "x")
		fd, err := fdpass.Dup(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		fds[i] = fd
	}
	if err := q.adopt(1000, fds[:3]); err != nil {
		t.Fatal(err)
	}
	wantLimit(t, q.adopt(1000, fds[3:]), "3 socket descriptors per uid")
	if _, err := unix.FcntlInt(uintptr(fds[3]), unix.F_GETFD, 0); err != syscall.EBADF {
		t.Fatalf("a descriptor over the limit is still open: %v", err)
	}
	q.release(fds[:3]...)
	q.waitClosing(time.Minute)
	q.give(1000, Limits{Conns: 1, Parked: 1})
	q.give(1001, Limits{Conns: 2})
	if q.sum() != (Limits{}) || len(q.owner) != 0 {
		t.Fatalf("%+v counted, %d descriptors", q.sum(), len(q.owner))
	}
}

func TestFitTotal(t *testing.T) {
	if got := fitTotal(defaultTotal, 1<<20); got != defaultTotal {
		t.Fatalf("with room: %+v", got)
	}
	for _, budget := range []int{10000, 2000, 512} {
		got := fitTotal(defaultTotal, budget)
		if got.Conns+got.FDs+maxTurningAway > budget || got.Conns < 1 || got.Parked > got.Conns || got.FDs <= backendFDs {
			t.Errorf("budget %d: %+v", budget, got)
		}
	}

	// Listen fits the socket into half of RLIMIT_NOFILE.
	var old unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	low := old
	low.Cur = min(old.Cur, 2000)
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	defer unix.Setrlimit(unix.RLIMIT_NOFILE, &old)
	s, _ := listen(t, Config{Backend: newFakeBackend(t, nil), PerUID: Limits{Conns: 5000}})
	total, per := s.cfg.Total, s.cfg.PerUID
	if total.Conns+total.FDs+maxTurningAway > int(low.Cur)/2 || per != perUIDCap(total) || 8*per.Conns > total.Conns-total.Conns/8 {
		t.Fatalf("RLIMIT_NOFILE %d: total %+v, per uid %+v", low.Cur, total, per)
	}
}

// TestPrivate: a private socket serves its owner and root only, whatever
// the op.
func TestPrivate(t *testing.T) {
	s, path := listen(t, Config{Backend: newFakeBackend(t, map[string]string{"a": "A"}), Private: true, Owner: 1000})
	err := s.admit(Cred{Uid: 1001})
	var pe *protoErr
	if !errors.As(err, &pe) || pe.errno != syscall.EACCES || !strings.Contains(pe.msg, "private") {
		t.Fatalf("uid 1001: %v, want EACCES", err)
	}
	for _, uid := range []uint32{1000, 0} {
		if err := s.admit(Cred{Uid: uid}); err != nil {
			t.Fatalf("uid %d: %v", uid, err)
		}
		s.quota.give(uid, Limits{Conns: 1})
	}
	f, err := dial(t, path).Export("a", false) // this test runs as root
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
}

// TestConnLimit: a connection over the limit gets EAGAIN for its first
// request and is closed; the others keep working, and a closed one frees
// its place.
func TestConnLimit(t *testing.T) {
	s, path := listen(t, Config{Backend: newFakeBackend(t, map[string]string{"a": "A"}), Total: Limits{Conns: 2}}) // the test runs as root: bound by the total alone
	c1, c2 := dial(t, path), dial(t, path)
	export := func(c *Client) {
		t.Helper()
		f, err := c.Export("a", false)
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	export(c1)
	export(c2)
	over := dial(t, path)
	_, err := over.Export("a", false)
	wantLimit(t, err, "2 connections for all users")
	if _, err := over.Export("a", false); err == nil || errors.Is(err, syscall.EAGAIN) {
		t.Fatalf("second request on a refused connection: %v, want it closed", err)
	}
	// Descriptors sent to a refused connection are dropped by the kernel.
	_, err = dial(t, path).AllGather("g", 0, 1, memfdClosed(t))
	wantLimit(t, err, "connections")
	export(c1)
	export(c2)
	c2.Close()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		f, err := dial(t, path).Export("a", false)
		if err == nil {
			f.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after a connection closed: %v", err)
		}
	}

	// Connections that send nothing are closed within a second or so,
	// all the more beyond maxTurningAway.
	idle := make([]*os.File, maxTurningAway+16)
	for i := range idle {
		f, err := rawConn(t, path).File()
		if err != nil {
			t.Fatal(err)
		}
		idle[i] = f
	}
	deadline := time.Now().Add(5 * time.Second)
	for i, f := range idle {
		for {
			n, _, err := unix.Recvfrom(int(f.Fd()), make([]byte, 1), unix.MSG_DONTWAIT)
			if n == 0 && err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("idle connection %d still open after 5s: %d, %v", i, n, err)
			}
			time.Sleep(10 * time.Millisecond)
		}
		f.Close()
	}
	if n := s.turning.Load(); n != 0 {
		t.Fatalf("%d connections still being turned away", n)
	}
}

// TestParkedLimit: a uid's collective requests wait up to its limit; the
// rank that completes a group never needs a place.
func TestParkedLimit(t *testing.T) {
	s, path := listen(t, Config{Backend: newFakeBackend(t, nil), Total: Limits{Parked: 2}})
	errs := make(chan error, 2)
	for _, g := range []string{"p0", "p1"} {
		c := dial(t, path)
		go func() {
			files, err := c.AllGather(g, 0, 2, memfdClosed(t))
			for _, f := range files {
				f.Close()
			}
			errs <- err
		}()
		waitJoined(t, s, g, 1)
	}
	third := dial(t, path)
	_, err := third.AllGather("p2", 0, 2, memfdClosed(t))
	wantLimit(t, err, "2 waiting collective requests for all users")
	files, err := third.AllGather("p0", 1, 2, memfdClosed(t))
	if err != nil {
		t.Fatalf("completing a group at the limit: %v", err)
	}
	for _, f := range files {
		f.Close()
	}
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	go func() {
		third.AllGather("p2", 0, 2, memfdClosed(t)) // ends with Close
	}()
	waitJoined(t, s, "p2", 1)
}

// TestFDLimit: descriptors received and held, and those a backend call
// may use, count against the limit; a message over it is refused whole
// (EAGAIN), its descriptors closed.
func TestFDLimit(t *testing.T) {
	b := newFakeBackend(t, map[string]string{"a": "A"})
	s, path := listen(t, Config{Backend: b, Total: Limits{FDs: backendFDs + 2}})
	parked := dial(t, path)
	go func() { parked.AllGather("p", 0, 3, memfdClosed(t)) }()
	waitJoined(t, s, "p", 1)
	c := dial(t, path)
	f, err := c.Export("a", false) // 1 held + backendFDs
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	second := dial(t, path)
	go func() { second.AllGather("p", 1, 3, memfdClosed(t)) }()
	waitJoined(t, s, "p", 2)
	wantLimit(t, c.Import("i", memfdClosed(t), "", ""), "socket descriptors for all users")
	if rep := exchange(t, rawConn(t, path), []byte(`{"v":1,"op":"import","path":"i"}`), 5); syscall.Errno(rep.Errno) != syscall.EAGAIN {
		t.Fatalf("5 descriptors over the limit: %+v, want EAGAIN", rep)
	}
	parked.Close()
	waitJoined(t, s, "p", 1)
	s.quota.waitClosing(time.Minute)
	if err := c.Import("i", memfdClosed(t), "", ""); err != nil {
		t.Fatalf("once a waiting rank left: %v", err)
	}
	s.quota.waitClosing(time.Minute)
	// The import's backend descriptors are given back just after its
	// reply is sent.
	for deadline := time.Now().Add(5 * time.Second); s.quota.held(0).FDs != 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d descriptors counted, want 1 (the waiting rank's)", s.quota.held(0).FDs)
		}
	}
}

// TestFDLimitPerUID (ledger row "socket descriptors"): a user who parks
// collectives, each holding the descriptor it sent, stops at her share of
// the socket's descriptors with EAGAIN naming it; another user's and
// root's collectives are served meanwhile, and her descriptors are given
// back once she leaves.
func TestFDLimitPerUID(t *testing.T) {
	b := newFakeBackend(t, nil)
	s, path := listen(t, Config{Backend: b, Total: Limits{FDs: 64}})
	per := perUIDCap(Limits{FDs: 64}).FDs
	cmd := peerCommand(t, "park", path, &syscall.Credential{Uid: 1000, Gid: 1000}, fmt.Sprintf("CTL_TEST_PARK=%d", per+3))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	defer stdin.Close()
	lines := bufio.NewScanner(out)
	if !lines.Scan() {
		t.Fatalf("the peer of uid 1000 said nothing: %v", lines.Err())
	}
	if want := fmt.Sprintf("uid 1000 reached the limit of %d socket descriptors per uid", per); !strings.Contains(lines.Text(), want) {
		t.Errorf("uid 1000 past her share: %q, want it to say %q", lines.Text(), want)
	}
	if held := s.quota.held(1000).FDs; held > per {
		t.Errorf("uid 1000 holds %d socket descriptors, past her share of %d", held, per)
	}
	if _, got := runPeer(t, "solo", path, &syscall.Credential{Uid: 1001, Gid: 1001}); got != "ok" {
		t.Errorf("uid 1001's all_gather while uid 1000 is at her share: %s", got)
	}
	files, err := parkedGather(path, 0, 1)
	if err != nil {
		t.Errorf("root's all_gather while uid 1000 is at her share: %v", err)
	}
	for _, f := range files {
		f.Close()
	}
	stdin.Close()
	for deadline := time.Now().Add(5 * time.Second); s.quota.held(1000).FDs != 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("uid 1000 left, and %d of her socket descriptors are still counted", s.quota.held(1000).FDs)
		}
	}
}

// TestQuotaRootReserve (A5): other uids together stop an eighth short of
// the total, one uid at an eighth of the rest, so that eight users fit and
// root is refused only at the total itself; the default limits fit a
// group of the largest world in one uid's.
func TestQuotaRootReserve(t *testing.T) {
	total := Limits{Conns: 64, Parked: 64, FDs: 128}
	per := perUIDCap(total)
	if per != (Limits{Conns: 7, Parked: 7, FDs: 14}) {
		t.Fatalf("per uid %+v, want an eighth of 7/8 of %+v", per, total)
	}
	q := newQuota(ledger.New(), nil, per, total)
	conn := Limits{Conns: 1}
	for uid := uint32(1000); uid < 1008; uid++ {
		for range per.Conns {
			if err := q.take(uid, conn); err != nil {
				t.Fatalf("uid %d: %v", uid, err)
			}
		}
		wantLimit(t, q.take(uid, conn), fmt.Sprintf("uid %d reached the limit of 7 connections per uid", uid))
	}
	// 56 taken by eight uids: the other 8 are root's.
	wantLimit(t, q.take(1008, conn), "uid 1008 reached the limit of 56 connections for users other than root")
	for i := range total.Conns - 8*per.Conns {
		if err := q.take(0, conn); err != nil {
			t.Fatalf("root's connection %d: %v", i, err)
		}
	}
	wantLimit(t, q.take(0, conn), "uid 0 reached the limit of 64 connections for all users")
	// Root's place is not another user's when root lets it go.
	q.give(0, conn)
	wantLimit(t, q.take(1008, conn), "for users other than root")
	q.give(1000, conn)
	if err := q.take(1008, conn); err != nil {
		t.Fatalf("once uid 1000 let one go: %v", err)
	}

	def := perUIDCap(defaultTotal)
	if def.Conns < maxWorld || def.Parked < maxWorld-1 || def.FDs < maxWorld+backendFDs {
		t.Errorf("default per uid %+v: a group of %d ranks does not fit", def, maxWorld)
	}
}

// sum returns what all uids hold.
func (q *quota) sum() Limits {
	return Limits{Conns: int(q.conns.Used()), Parked: int(q.parked.Used()), FDs: int(q.fds.Used())}
}

// held returns what uid holds.
func (q *quota) held(uid uint32) Limits {
	return Limits{Conns: int(q.conns.Held(uid)), Parked: int(q.parked.Held(uid)), FDs: int(q.fds.Held(uid))}
}
