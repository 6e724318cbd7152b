package integration

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/fdpass"
	tfs "tensorfs/fs"
)

// takeoverEnv runs the test binary as one process of
// TestTakeoverExperiment: "first", "second" or "client".
const takeoverEnv = "TENSORFS_TEST_TAKEOVER"

func init() {
	if role := os.Getenv(takeoverEnv); role != "" {
		os.Exit(takeoverMain(role, os.Getenv("TENSORFS_TEST_DIR"), os.Getenv("TENSORFS_TEST_MNT")))
	}
}

// handover is what the first daemon sends the second with the FUSE
// descriptor.
type handover struct {
	Init  []byte
	State tfs.State
}

// takeoverMain is one process of the experiment. "first" mounts a
// loopback of dir at mnt (passthrough, node IDs the backing's inodes),
// says "mounted", and at "handover" on stdin sends its FUSE descriptor,
// its INIT and its nodes on descriptor 3, says "handed" and waits to be
// killed. "second" takes that connection over, says "adopted N lost M",
// and at the end of descriptor 3 (the first is gone) asks the kernel to
// resend what the first had read, says "serving" and serves. "client"
// works in mnt/d with f open: at each "check" on stdin it writes and
// reads f through its descriptor, stats it, lists its working directory,
// makes a file there, and says "ok" or the first error.
func takeoverMain(role, dir, mnt string) int {
	say := func(a ...any) { fmt.Println(a...) }
	switch role {
	case "first":
		root, err := fusefs.NewLoopbackRoot(dir)
		if err != nil {
			say("root:", err)
			return 1
		}
		opts := &fusefs.Options{ExternalNodeID: true, MountOptions: fuse.MountOptions{DirectMount: true, FsName: "takeover"}}
		raw := tfs.NewHandoverFS(fusefs.NewNodeFS(root, opts), 0)
		srv, err := fuse.NewServer(raw, mnt, &opts.MountOptions)
		if err == nil {
			go srv.Serve()
			err = srv.WaitMount()
		}
		if err != nil {
			say("mount:", err)
			return 1
		}
		say("mounted")
		bufio.NewReader(os.Stdin).ReadString('\n')
		fd, err := tfs.ConnectionFd()
		if err != nil {
			say("fd:", err)
			return 1
		}
		msg, _ := json.Marshal(handover{Init: tfs.InitBytes(srv), State: raw.State(root.EmbeddedInode())})
		if err := fdpass.Send(peer(), msg, fd); err != nil {
			say("send:", err)
			return 1
		}
		say("handed")
		select {}
	case "second":
		c := peer()
		m, err := fdpass.Recv(c, 1<<20, 1)
		if err != nil || len(m.FDs) != 1 {
			say("recv:", err)
			return 1
		}
		var h handover
		if err := json.Unmarshal(m.Data, &h); err != nil {
			say("decode:", err)
			return 1
		}
		root, err := fusefs.NewLoopbackRoot(dir)
		if err != nil {
			say("root:", err)
			return 1
		}
		raw := tfs.NewHandoverFS(fusefs.NewNodeFS(root, &fusefs.Options{ExternalNodeID: true}), 1)
		srv, err := tfs.ServeConnection(raw, m.FDs[0], h.Init, fuse.MountOptions{FsName: "takeover"})
		if err != nil {
			say("takeover:", err)
			return 1
		}
		lost := raw.Adopt(h.State)
		say("adopted", len(h.State.Nodes)-len(lost.Nodes), "lost", len(lost.Nodes))
		fdpass.Recv(c, 1, 0) // io.EOF once the first has exited
		if err := tfs.NotifyResend(); err != nil {
			say("resend:", err)
			return 1
		}
		say("serving")
		srv.Serve()
		return 0
	case "client":
		if err := os.Chdir(filepath.Join(mnt, "d")); err != nil {
			say("chdir:", err)
			return 1
		}
		f, err := os.OpenFile("f", os.O_RDWR, 0)
		if err != nil {
			say("open:", err)
			return 1
		}
		say("ready")
		sc := bufio.NewScanner(os.Stdin)
		for i := 0; sc.Scan(); i++ {
			say(clientCheck(f, i))
		}
		return 0
	}
	return 2
}

// clientCheck is one check of the experiment's client: "ok" or what
// failed.
func clientCheck(f *os.File, i int) string {
	want := fmt.Sprintf("round %d", i)
	if _, err := f.WriteAt([]byte(want), 0); err != nil {
		return "pwrite: " + err.Error()
	}
	got := make([]byte, len(want))
	if _, err := f.ReadAt(got, 0); err != nil || string(got) != want {
		return fmt.Sprintf("pread: %q %v", got, err)
	}
	if _, err := f.Stat(); err != nil {
		return "fstat: " + err.Error()
	}
	if _, err := os.ReadDir("."); err != nil {
		return "readdir: " + err.Error()
	}
	name := fmt.Sprintf("new%d", i)
	if err := os.WriteFile(name, []byte(want), 0o644); err != nil {
		return "create: " + err.Error()
	}
	if b, err := os.ReadFile(name); err != nil || string(b) != want {
		return fmt.Sprintf("read back: %q %v", b, err)
	}
	return "ok"
}

// peer is descriptor 3, the socket between the two daemons.
func peer() *net.UnixConn {
	c, err := net.FileConn(os.NewFile(3, "peer"))
	if err != nil {
		panic(err)
	}
	return c.(*net.UnixConn)
}

// startTakeover starts the test binary as role with descriptor 3 (if
// any) and the experiment's directories.
func startTakeover(t *testing.T, role, dir, mnt string, fd3 *os.File) *lineChild {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	c := &lineChild{cmd: exec.Command(self), lines: make(chan string, 64), out: &lockedBuffer{}}
	if fd3 != nil {
		c.cmd.ExtraFiles = []*os.File{fd3}
	}
	c.cmd.Env = []string{takeoverEnv + "=" + role, "TENSORFS_TEST_DIR=" + dir, "TENSORFS_TEST_MNT=" + mnt}
	c.cmd.Stderr = c.out
	c.cmd.WaitDelay = 5 * time.Second
	if c.stdin, err = c.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	stdout, err := c.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			c.out.Write([]byte(sc.Text() + "\n"))
			c.lines <- sc.Text()
		}
		close(c.lines)
	}()
	t.Cleanup(func() {
		c.stdin.Close()
		c.cmd.Process.Kill()
		c.cmd.Wait()
	})
	return c
}

// TestTakeoverExperiment is the smallest experiment of a daemon handing
// its live FUSE connection to a successor (issue 27, step 1): a go-fuse
// loopback (passthrough, ExternalNodeID) mounts; a client keeps a
// descriptor open and its working directory in the mount; the daemon
// sends its /dev/fuse descriptor (SCM_RIGHTS), its INIT and its node
// list to a second process and is SIGKILLed; the second serves the same
// connection (a synthetic INIT, then the kernel's requests), and the
// client's descriptor, working directory and new files work on, with no
// error and no remount.
func TestTakeoverExperiment(t *testing.T) {
	t.Parallel()
	requireEnvironment(t)
	dir, mnt := t.TempDir(), t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "d"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "d", "f"), []byte("start"), 0o644); err != nil {
		t.Fatal(err)
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	a, b := os.NewFile(uintptr(pair[0]), "a"), os.NewFile(uintptr(pair[1]), "b")
	first := startTakeover(t, "first", dir, mnt, a)
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	if l := first.next(t, "the mount"); l != "mounted" {
		t.Fatalf("first: %s\n%s", l, first.out.String())
	}
	client := startTakeover(t, "client", dir, mnt, nil)
	if l := client.next(t, "the open"); l != "ready" {
		t.Fatalf("client: %s", l)
	}
	check := func(when string) {
		t.Helper()
		io.WriteString(client.stdin, "check\n")
		if l := client.next(t, "a check"); l != "ok" {
			t.Fatalf("client %s: %s", when, l)
		}
	}
	check("before the takeover")
	second := startTakeover(t, "second", dir, mnt, b)
	a.Close()
	b.Close()
	io.WriteString(first.stdin, "handover\n")
	if l := first.next(t, "the handover"); l != "handed" {
		t.Fatalf("first: %s", l)
	}
	adopted := second.next(t, "the adoption")
	if !strings.HasPrefix(adopted, "adopted ") || !strings.HasSuffix(adopted, " lost 0") {
		t.Fatalf("second: %s\n%s", adopted, second.out.String())
	}
	first.cmd.Process.Kill()
	if l := second.next(t, "serving"); l != "serving" {
		t.Fatalf("second: %s\n%s", l, second.out.String())
	}
	for i := 0; i < 3; i++ {
		check("after the takeover")
	}
	if !isMounted(mnt) {
		t.Fatal("the mount is gone")
	}
	for i := 0; i < 4; i++ {
		b, err := os.ReadFile(filepath.Join(dir, "d", fmt.Sprintf("new%d", i)))
		if want := fmt.Sprintf("round %d", i); err != nil || string(b) != want {
			t.Fatalf("new%d in the backing: %q %v, want %q", i, b, err, want)
		}
	}
	t.Logf("second daemon: %s; its log:\n%s", adopted, second.out.String())
}
