package ctl

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/fdpass"
)

// Tests with peers of other credentials run this test binary as a child
// with CTL_TEST_PEER set to what it should do (peerMain).
func TestMain(m *testing.M) {
	noAsyncPreempt()
	if mode := os.Getenv("CTL_TEST_PEER"); mode != "" {
		os.Exit(peerMain(mode, os.Getenv("CTL_TEST_SOCKET")))
	}
	code := m.Run()
	if peerDir != "" {
		os.RemoveAll(peerDir)
	}
	os.Exit(code)
}

// noAsyncPreempt runs this test binary again, in place, with Go's
// asynchronous preemption off, unless it is already. Its signal (SIGURG)
// can land on a thread that is entering a close which lingers
// (blockingClose) and end the close's wait at once: TestBlockingClose
// then found nothing left to wait for, about one close in fifteen.
func noAsyncPreempt() {
	settings := strings.FieldsFunc(os.Getenv("GODEBUG"), func(r rune) bool { return r == ',' })
	if slices.Contains(settings, "asyncpreemptoff=1") {
		return
	}
	env := slices.DeleteFunc(os.Environ(), func(kv string) bool { return strings.HasPrefix(kv, "GODEBUG=") })
	env = append(env, "GODEBUG="+strings.Join(append(settings, "asyncpreemptoff=1"), ","))
	err := syscall.Exec("/proc/self/exe", os.Args, env)
	fmt.Fprintf(os.Stderr, "ctl tests: run again without asynchronous preemption: %v\n", err)
	os.Exit(2)
}

// peerDir holds a copy of this binary that every uid may run, made by
// peerBinary.
var peerDir string

// peerBinary returns the path of that copy, making it the first time.
var peerBinary = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "ctl-peer")
	if err != nil {
		return "", err
	}
	peerDir = dir
	self, err := os.Open("/proc/self/exe")
	if err != nil {
		return "", err
	}
	defer self.Close()
	bin := filepath.Join(dir, "peer")
	out, err := os.OpenFile(bin, os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		return "", err
	}
	_, err = io.Copy(out, self)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(dir, 0o755)
	}
	return bin, err
})

// peerMain is a child peer of the socket sock. Modes:
//
//	groups   print getgroups(), then export "who"
//	regroup  connect, change the supplementary groups to
//	         CTL_TEST_REGROUP, send an export of "slow" and exit at once
//	purge    ask for a purge; print "ok" or the errno's number
//	park     park CTL_TEST_PARK all_gathers with a memfd each, one per
//	         connection, in a group that never fills; print each refusal
//	         as it comes, and hold the rest until stdin closes
//	solo     an all_gather of one with a memfd; print "ok" or the error
func peerMain(mode, sock string) int {
	c, err := Dial(sock)
	if err != nil {
		fmt.Println(err)
		return 1
	}
	defer c.Close()
	switch mode {
	case "groups":
		groups, err := unix.Getgroups()
		if err != nil {
			fmt.Println(err)
			return 1
		}
		fmt.Println(strings.Trim(fmt.Sprint(groups), "[]"))
		c.Export("who", false)
	case "regroup":
		g, _ := strconv.Atoi(os.Getenv("CTL_TEST_REGROUP"))
		if err := syscall.Setgroups([]int{g}); err != nil {
			fmt.Println("setgroups:", err)
			return 1
		}
		b, _ := (&request{Op: opExport, Path: "slow"}).marshal()
		if err := fdpass.Send(c.conn, b); err != nil {
			fmt.Println(err)
			return 1
		}
	case "park":
		n, _ := strconv.Atoi(os.Getenv("CTL_TEST_PARK"))
		for rank := range n {
			go func() {
				if _, err := parkedGather(sock, rank, n+1); err != nil {
					fmt.Println("refused:", err)
				}
			}()
		}
		io.Copy(io.Discard, os.Stdin)
	case "solo":
		if _, err := parkedGather(sock, 0, 1); err != nil {
			fmt.Println(err)
			return 1
		}
		fmt.Println("ok")
	case "purge":
		var errno syscall.Errno
		switch err := c.Purge(); {
		case err == nil:
			fmt.Println("ok")
		case errors.As(err, &errno):
			fmt.Println(int(errno))
		default:
			fmt.Println(err)
			return 1
		}
	default:
		return 2
	}
	return 0
}

// parkedGather sends an all_gather of group "park" as rank of world with
// a memfd, on a connection of its own, and returns what it got.
func parkedGather(sock string, rank, world int) ([]*os.File, error) {
	c, err := Dial(sock)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	fd, err := unix.MemfdCreate("peer", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), "memfd")
	defer f.Close()
	return c.AllGather("park", rank, world, f)
}

// runPeer runs peerMain(mode) on the socket at sock as cred and returns
// its pid and output. It needs root.
func runPeer(t *testing.T, mode, sock string, cred *syscall.Credential, env ...string) (int, string) {
	t.Helper()
	cmd := peerCommand(t, mode, sock, cred, env...)
	var stderr strings.Builder // apart: a binary built with -cover warns there
	cmd.Stderr = &stderr
	b, err := cmd.Output()
	if err != nil {
		t.Fatalf("peer %s as %+v: %v\n%s%s", mode, cred, err, b, stderr.String())
	}
	return cmd.Process.Pid, strings.TrimSpace(string(b))
}

// peerCommand returns the command of peerMain(mode) on the socket at
// sock as cred. It needs root.
func peerCommand(t *testing.T, mode, sock string, cred *syscall.Credential, env ...string) *exec.Cmd {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("peers of other credentials need root")
	}
	bin, err := peerBinary()
	if err == nil {
		err = os.Chmod(filepath.Dir(sock), 0o755) // reachable by cred's uid
	}
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin)
	cmd.Env = append([]string{"CTL_TEST_PEER=" + mode, "CTL_TEST_SOCKET=" + sock}, env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// sorted returns the groups sorted, nil for none.
func sorted(groups []uint32) []uint32 {
	if len(groups) == 0 {
		return nil
	}
	return slices.Sorted(slices.Values(groups))
}

// TestPeerGroups: a peer's Cred holds its uid, gid and supplementary
// groups, those getgroups() returns in it, primary group apart.
func TestPeerGroups(t *testing.T) {
	b := newFakeBackend(t, nil)
	_, path := startServer(t, b, 0)
	dial(t, path).Export("who", false)
	own, err := unix.Getgroups()
	if err != nil {
		t.Fatal(err)
	}
	var want []uint32
	for _, g := range own {
		want = append(want, uint32(g))
	}
	b.mu.Lock()
	got := b.creds[0]
	b.mu.Unlock()
	if got.Uid != uint32(os.Getuid()) || !slices.Equal(sorted(got.Groups), sorted(want)) {
		t.Errorf("this process: %+v, want uid %d, groups %v", got, os.Getuid(), want)
	}

	// More groups than peerGroups first makes room for: it must grow.
	groups := []uint32{3000, 4, 2000}
	for g := range uint32(40) {
		groups = append(groups, 10000+g)
	}
	pid, out := runPeer(t, "groups", path, &syscall.Credential{Uid: 1000, Gid: 1000, Groups: groups})
	want = nil
	for _, f := range strings.Fields(out) {
		g, err := strconv.ParseUint(f, 10, 32)
		if err != nil {
			t.Fatalf("peer's getgroups(): %q", out)
		}
		want = append(want, uint32(g))
	}
	if !slices.Equal(sorted(want), sorted(groups)) {
		t.Fatalf("peer's getgroups() = %v, want the groups it was started with", want)
	}
	b.mu.Lock()
	got = b.creds[1]
	b.mu.Unlock()
	if got.Pid != int32(pid) || got.Uid != 1000 || got.Gid != 1000 || !slices.Equal(sorted(got.Groups), sorted(want)) {
		t.Errorf("peer's cred %+v, want pid %d, uid and gid 1000, groups %v", got, pid, want)
	}
	for gid, in := range map[uint32]bool{1000: true, 4: true, 2000: true, 3000: true, 10039: true, 0: false, 5: false, 10040: false} {
		if got.InGroup(gid) != in {
			t.Errorf("InGroup(%d) = %v, want %v", gid, !in, in)
		}
	}
}

// TestCredAtConnect: the groups are those the peer had when it connected:
// it changes them and exits before the backend sees its request, and the
// backend still gets (and checks against) the groups it connected with.
func TestCredAtConnect(t *testing.T) {
	b := newFakeBackend(t, nil)
	_, path := startServer(t, b, 0)
	release := sync.OnceFunc(func() { close(b.slow) })
	defer release() // a failure below must not leave the server waiting on the backend
	pid, out := runPeer(t, "regroup", path, &syscall.Credential{Uid: 0, Gid: 0, Groups: []uint32{2001}}, "CTL_TEST_REGROUP=2002")
	if out != "" {
		t.Fatalf("peer said %q", out)
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("peer %d still has /proc: %v", pid, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	var got []Cred
	for len(got) == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
		b.mu.Lock()
		got = slices.Clone(b.creds)
		b.mu.Unlock()
	}
	release()
	if len(got) != 1 {
		t.Fatalf("the backend got %d requests, want 1", len(got))
	}
	if c := got[0]; c.Pid != int32(pid) || !slices.Equal(c.Groups, []uint32{2001}) || !c.InGroup(2001) || c.InGroup(2002) {
		t.Errorf("cred %+v of exited peer %d: want the groups it connected with, [2001]", c, pid)
	}
}

// TestPurge: the daemon's user and root may ask for a purge, which calls
// Config.Purge; another uid gets EACCES and changes nothing; a daemon
// without Purge answers EOPNOTSUPP, and Purge's error goes to the peer.
func TestPurge(t *testing.T) {
	var asked atomic.Int32
	var fail atomic.Bool
	_, path := listen(t, Config{Backend: newFakeBackend(t, nil), Owner: 1000, Purge: func() error {
		if fail.Load() {
			return fmt.Errorf("purge: %w", errBoom)
		}
		asked.Add(1)
		return nil
	}})
	if err := dial(t, path).Purge(); err != nil || asked.Load() != 1 {
		t.Fatalf("root's purge: %v, %d asked", err, asked.Load())
	}
	if _, out := runPeer(t, "purge", path, &syscall.Credential{Uid: 1001, Gid: 1001, Groups: []uint32{}}); out != strconv.Itoa(int(syscall.EACCES)) || asked.Load() != 1 {
		t.Errorf("uid 1001's purge: %q, %d asked; want EACCES and none", out, asked.Load())
	}
	if _, out := runPeer(t, "purge", path, &syscall.Credential{Uid: 1000, Gid: 1000, Groups: []uint32{}}); out != "ok" || asked.Load() != 2 {
		t.Errorf("the owner's purge: %q, %d asked; want ok", out, asked.Load())
	}
	fail.Store(true)
	wantErrno(t, dial(t, path).Purge(), syscall.EBUSY)

	_, path = listen(t, Config{Backend: newFakeBackend(t, nil)})
	wantErrno(t, dial(t, path).Purge(), syscall.EOPNOTSUPP)
}

// TestPeer: a client learns the daemon's credentials.
func TestPeer(t *testing.T) {
	_, path := startServer(t, newFakeBackend(t, nil), 0)
	cred, err := dial(t, path).Peer()
	if err != nil || cred.Pid != int32(os.Getpid()) || cred.Uid != uint32(os.Geteuid()) {
		t.Errorf("Peer() = %+v, %v; want pid %d uid %d", cred, err, os.Getpid(), os.Geteuid())
	}
}
