package integration

// Attacks that stall the control socket, by unprivileged users (DESIGN.md
// §9): wedging every collective with a descriptor whose close blocks (A2),
// and filling the socket's totals so that root is refused (A5).

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/fdpass"
)

// The test binary, run with blockFlushEnv set to a directory, is the
// attacker of TestAttackWedgeGroups (blockFlushMain).
const blockFlushEnv = "TENSORFS_TEST_BLOCKFLUSH"

// blockFlushOpEnv says what the attacker sends its file with: "import"
// (an import request), else an all_gather.
const blockFlushOpEnv = "TENSORFS_TEST_BLOCKOP"

// blockFlushNEnv says how many times the attacker sends its file, each on
// a connection of its own (1 if unset).
const blockFlushNEnv = "TENSORFS_TEST_BLOCKN"

func init() {
	if dir := os.Getenv(blockFlushEnv); dir != "" {
		n, err := strconv.Atoi(os.Getenv(blockFlushNEnv))
		if err != nil {
			n = 1
		}
		os.Exit(blockFlushMain(dir, os.Getenv("TENSORFS_TEST_SOCKET"), os.Getenv(blockFlushOpEnv), n))
	}
}

// blockFlushMain serves, on the /dev/fuse descriptor 3 that its parent
// mounted at dir for it, a FUSE filesystem holding one file f whose FLUSH,
// and whose STATFS, from any other process are answered only once told
// to; it sends f n times, each on a connection of its own to the control
// socket sock, with an all_gather (rank 0 of 2, group "wedgeI"), or with
// an import to "pub/x" when op is "import". On stdout: "mounted", "sent",
// "reply ERRNO" for each (0 for success, -1 for no reply), and "flush
// TID" or "statfs TID" for each request of another process that waits
// (these may come before "sent": the daemon can refuse and close f at
// once). On stdin: "leave" closes the connections ("left"), "release"
// answers the waiting requests and closes f ("done"); it exits at the
// end of stdin.
func blockFlushMain(dir, sock, op string, n int) int {
	var mu sync.Mutex
	say := func(a ...any) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Println(a...)
	}
	release := make(chan struct{})
	root := &blockFlushRoot{file: &blockFlushNode{say: say, release: release}, say: say, release: release}
	if _, err := fusefs.Mount("/dev/fd/3", root, &fusefs.Options{}); err != nil {
		say("serve:", err)
		return 1
	}
	say("mounted")
	fd, err := unix.Open(filepath.Join(dir, "f"), unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		say("open:", err)
		return 1
	}
	var conns []*net.UnixConn
	for i := range n {
		c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: sock, Net: "unixpacket"})
		req := fmt.Sprintf(`{"v":1,"op":"all_gather","group":"wedge%d","rank":0,"world":2}`, i)
		if op == "import" {
			req = `{"v":1,"op":"import","path":"pub/x"}`
		}
		if err == nil {
			err = fdpass.Send(c, []byte(req), fd)
		}
		if err != nil {
			say("send:", err)
			return 1
		}
		conns = append(conns, c)
		go func() {
			var r struct{ Errno int }
			msg, err := fdpass.Recv(c, 1<<16, 0)
			if err == nil {
				err = json.Unmarshal(msg.Data, &r)
			}
			if err != nil {
				r.Errno = -1
			}
			say("reply", r.Errno)
		}()
	}
	say("sent")
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		switch sc.Text() {
		case "leave":
			for _, c := range conns {
				c.Close()
			}
			say("left")
		case "release":
			close(release)
			unix.Close(fd)
			say("done")
		}
	}
	return 0
}

// blockFlushRoot is the attacker's root directory, holding its file "f";
// its filesystem's STATFS from other processes waits for release.
type blockFlushRoot struct {
	fusefs.Inode
	file    *blockFlushNode
	say     func(...any)
	release chan struct{}
}

var (
	_ = (fusefs.NodeOnAdder)((*blockFlushRoot)(nil))
	_ = (fusefs.NodeStatfser)((*blockFlushRoot)(nil))
)

func (r *blockFlushRoot) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	if caller, ok := fuse.FromContext(ctx); ok && otherProcess(caller.Pid) {
		r.say("statfs", caller.Pid)
		<-r.release
	}
	return 0
}

// otherProcess reports whether thread tid (FUSE names threads) is not one
// of this process's.
func otherProcess(tid uint32) bool {
	_, err := os.Stat(fmt.Sprintf("/proc/self/task/%d", tid))
	return err != nil
}

func (r *blockFlushRoot) OnAdd(ctx context.Context) {
	r.AddChild("f", r.NewPersistentInode(ctx, r.file, fusefs.StableAttr{Mode: syscall.S_IFREG}), false)
}

// blockFlushNode is the file "f": empty, and its handles' flushes from
// other processes wait for release.
type blockFlushNode struct {
	fusefs.Inode
	say     func(...any)
	release chan struct{}
}

var (
	_ = (fusefs.NodeOpener)((*blockFlushNode)(nil))
	_ = (fusefs.NodeGetattrer)((*blockFlushNode)(nil))
	_ = (fusefs.FileFlusher)((*blockFlushHandle)(nil))
)

func (n *blockFlushNode) Open(ctx context.Context, flags uint32) (fusefs.FileHandle, uint32, syscall.Errno) {
	return &blockFlushHandle{n}, fuse.FOPEN_DIRECT_IO, 0
}

func (n *blockFlushNode) Getattr(ctx context.Context, fh fusefs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFREG | 0o600
	return 0
}

type blockFlushHandle struct{ n *blockFlushNode }

func (h *blockFlushHandle) Flush(ctx context.Context) syscall.Errno {
	if caller, ok := fuse.FromContext(ctx); ok && otherProcess(caller.Pid) {
		h.n.say("flush", caller.Pid)
		<-h.n.release
	}
	return 0
}

// lineChild is a child process that talks line by line.
type lineChild struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string
	out   *lockedBuffer
}

// next returns the child's next line, failing after commandTimeout.
func (c *lineChild) next(t *testing.T, what string) string {
	t.Helper()
	select {
	case line, ok := <-c.lines:
		if !ok {
			t.Fatalf("the attacker exited before %s:\n%s", what, c.out.String())
		}
		return line
	case <-time.After(commandTimeout):
		t.Fatalf("the attacker said nothing of %s within %v:\n%s", what, commandTimeout, c.out.String())
	}
	return ""
}

// until reads the child's lines up to want, handing each other line to
// other.
func (c *lineChild) until(t *testing.T, want, what string, other func(string)) {
	t.Helper()
	for line := c.next(t, what); line != want; line = c.next(t, what) {
		other(line)
	}
}

// startBlockFlush copies the test binary where userA can run it and runs
// blockFlushMain as userA, serving a FUSE filesystem at a directory of
// its own. The test mounts it for userA as the setuid fusermount3 does for
// any user (open /dev/fuse, mount with user_id and the descriptor, hand
// the descriptor over): this environment does not honour set-uid bits.
// The cleanup releases and unmounts it. op is blockFlushMain's; an import
// attacker's mount is allow_other (fuse.conf's user_allow_other), so that
// the daemon may reach its file at all.
func startBlockFlush(t *testing.T, sock, op string, n int) *lineChild {
	t.Helper()
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	reachable(t, dir)
	bin := filepath.Join(dir, "attacker")
	self, err := os.ReadFile("/proc/self/exe")
	if err == nil {
		err = writeExecutable(bin, self)
	}
	mnt := filepath.Join(dir, "mnt")
	if err == nil {
		err = os.Mkdir(mnt, 0o755)
	}
	if err == nil {
		err = os.Chown(mnt, userA, userA)
	}
	if err != nil {
		t.Fatal(err)
	}
	dev, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=%d,group_id=%d", dev.Fd(), userA, userA)
	if op == "import" {
		opts += ",allow_other"
	}
	if err := unix.Mount("blockflush", mnt, "fuse.blockflush", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	c := &lineChild{cmd: asUser(exec.Command(bin), userA), lines: make(chan string, 64), out: &lockedBuffer{}}
	c.cmd.ExtraFiles = []*os.File{dev}
	c.cmd.Dir = "/"
	c.cmd.Env = []string{blockFlushEnv + "=" + mnt, "TENSORFS_TEST_SOCKET=" + sock, blockFlushOpEnv + "=" + op, fmt.Sprintf("%s=%d", blockFlushNEnv, n), "PATH=/usr/bin:/bin"}
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
	done := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			c.out.Write([]byte(sc.Text() + "\n"))
			c.lines <- sc.Text()
		}
		close(c.lines)
		c.cmd.Wait()
		close(done)
	}()
	t.Cleanup(func() {
		io.WriteString(c.stdin, "release\n")
		unix.Unmount(mnt, unix.MNT_DETACH)
		c.stdin.Close()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			c.cmd.Process.Kill()
			<-done
		}
	})
	return c
}

// TestAttackWedgeGroups (A2): user A sends, with an all_gather, a file on
// a FUSE filesystem it serves itself (mounted with fusermount3, as any
// user may) whose FLUSH never answers, and leaves. The daemon's close of
// it blocks; root's and user B's collectives still complete meanwhile.
func TestAttackWedgeGroups(t *testing.T) {
	t.Parallel()
	m := mountFS(t, "passthrough", "--allow-other")
	reachable(t, m.dir)
	sock := controlSocket(t, m)
	a := startBlockFlush(t, sock, "all_gather", 1)
	if line := a.next(t, "mounting"); line != "mounted" {
		t.Fatalf("the attacker: %q\n%s", line, a.out.String())
	}
	// The daemon refuses A's file, or holds it in the group until A leaves;
	// either way it closes the file, and that close waits on A's FLUSH.
	var reply, flush string
	hear := func(line string) {
		switch {
		case strings.HasPrefix(line, "reply "):
			reply = line
		case strings.HasPrefix(line, "flush "):
			flush = strings.TrimPrefix(line, "flush ")
		case line == "left":
		default:
			t.Fatalf("the attacker: %q\n%s", line, a.out.String())
		}
	}
	a.until(t, "sent", "sending", hear)
	eventually(t, "the daemon answered or holds A's file", func() (bool, string) {
		select {
		case line := <-a.lines:
			hear(line)
		default:
		}
		out, _ := exec.Command("ls", "-l", fmt.Sprintf("/proc/%d/fd/", m.pid)).CombinedOutput()
		return reply != "" || strings.Contains(string(out), "/mnt/f"), string(out)
	})
	io.WriteString(a.stdin, "leave\n")
	for flush == "" {
		hear(a.next(t, "the daemon's flush"))
	}
	status, err := os.ReadFile("/proc/" + flush + "/status")
	if err != nil || !strings.Contains(string(status), fmt.Sprintf("\nTgid:\t%d\n", m.pid)) {
		t.Fatalf("a flush from thread %s, not the daemon's (pid %d): %v\n%s", flush, m.pid, err, status)
	}
	t.Logf("the attacker's all_gather: %s", reply)

	// Root's group of two and user B's group of one complete meanwhile.
	root := startCtlAgent(t, 0, sock)
	b := startCtlAgent(t, userB, sock)
	root.gather(t, "r0", "after", 0, "R0", false)
	root.gather(t, "r1", "after", 1, "R1", false)
	root.wantGot(t, "r0", "rank 0 while a close blocks", "R0", "R1")
	root.wantGot(t, "r1", "rank 1 while a close blocks", "R0", "R1")
	b.send(t, "b", map[string]any{"op": "all_gather", "group": "solo", "rank": 0, "world": 1}, "B")
	b.wantGot(t, "b", "all_gather of one while a close blocks", "B")

	io.WriteString(a.stdin, "release\n")
	for line := ""; line != "done"; {
		line = a.next(t, "letting the flush go")
	}
}

// TestAttackImportHang (fresh attack, second round): user A imports a
// file of a FUSE filesystem it serves (allow_other, as fuse.conf's
// user_allow_other lets any user) whose STATFS and FLUSH never answer.
// The daemon refuses it (EINVAL: not shared memory) without asking that
// filesystem, and user B's import works meanwhile.
func TestAttackImportHang(t *testing.T) {
	t.Parallel()
	m := mountFS(t, "passthrough", "--allow-other")
	reachable(t, m.dir)
	if err := unix.Mkdir(m.path("pub"), 0o777); err == nil {
		err = unix.Chmod(m.path("pub"), 0o1777)
	}
	sock := controlSocket(t, m)
	a := startBlockFlush(t, sock, "import", 1)
	if line := a.next(t, "mounting"); line != "mounted" {
		t.Fatalf("the attacker: %q\n%s", line, a.out.String())
	}
	var reply string
	hear := func(line string) {
		switch {
		case strings.HasPrefix(line, "reply "):
			reply = line
		case strings.HasPrefix(line, "statfs "), strings.HasPrefix(line, "flush "):
			// The daemon asked; it must answer the request all the same.
		default:
			t.Fatalf("the attacker: %q\n%s", line, a.out.String())
		}
	}
	a.until(t, "sent", "sending", hear)
	for reply == "" {
		hear(a.next(t, "the daemon's answer to the import"))
	}
	if reply != fmt.Sprintf("reply %d", int(syscall.EINVAL)) {
		t.Errorf("the import of a file on the attacker's FUSE filesystem: %q, want EINVAL", reply)
	}
	if _, err := os.Lstat(m.path("pub/x")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the refused import left a name: %v", err)
	}
	out := pythonAs(t, userB, "/", `
import array, json, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
fd = os.memfd_create("m")
s.sendmsg([json.dumps({"v": 1, "op": "import", "path": "pub/b"}).encode()],
          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
print(json.loads(s.recv(65536))["ok"])
`, sock)
	if strings.TrimSpace(out) != "True" {
		t.Errorf("user B's import meanwhile: %q", out)
	}
	// The daemon's close of the refused file waits for the attacker's
	// FLUSH, which the kernel sends forced: no signal ends that wait, so
	// the daemon could not exit before the attacker answers (README,
	// Security model). Let it answer; the daemon then exits at unmount.
	io.WriteString(a.stdin, "release\n")
	for line := ""; line != "done"; {
		line = a.next(t, "letting the flush go")
	}
	m.unmount(t, true)
}

// limitsLog and reserveLog read the control socket's limits in the
// daemon's log.
var (
	limitsLog  = regexp.MustCompile(`ctl: listening.* conns_per_uid=(\d+) .* conns=(\d+) `)
	reserveLog = regexp.MustCompile(`ctl: listening.* conns_root_reserve=(\d+)`)
)

// TestAttackFillConnections (A5): users other than root open connections
// until EAGAIN, each parking an all_gather. One user stops at its share
// while another is still served; however many users fill the rest, root
// still connects and is answered.
func TestAttackFillConnections(t *testing.T) {
	t.Parallel()
	m := mountFS(t, "passthrough", "--allow-other")
	reachable(t, m.dir)
	sock := controlSocket(t, m)
	sub := m.logMatch(t, "the ctl limits", limitsLog)
	perUID, _ := strconv.Atoi(sub[1])
	total, _ := strconv.Atoi(sub[2])
	reserve := 0
	if sub := reserveLog.FindStringSubmatch(m.stderr.String()); sub != nil {
		reserve, _ = strconv.Atoi(sub[1])
	}
	if perUID > (total-reserve)/8 || reserve < total/8 {
		t.Errorf("limits: %d connections per uid, %d in all, %d root's: want at most an eighth of the rest per uid", perUID, total, reserve)
	}
	solo := map[string]any{"op": "all_gather", "group": "solo", "rank": 0, "world": 1}
	root := startCtlAgent(t, 0, sock)

	flood := func(uid int) ctlReply {
		a := startCtlAgent(t, uid, sock)
		r := a.do(t, map[string]any{"cmd": "flood", "n": perUID + 20, "group": "fill"})
		t.Logf("uid %d: %d parked, refused %v, %d closed without a reply", uid, r.Parked, r.Refused, r.Unanswered)
		if r.Parked > perUID || len(r.Refused) == 0 {
			t.Errorf("uid %d: %d parked, refused %v; want at most %d, then EAGAIN", uid, r.Parked, r.Refused, perUID)
		}
		for k := range r.Refused {
			if !strings.HasPrefix(k, strconv.Itoa(int(syscall.EAGAIN))+" ") {
				t.Errorf("uid %d: refused %q, want EAGAIN", uid, k)
			}
		}
		return r
	}
	refusedFor := func(r ctlReply, scope string) bool {
		for k := range r.Refused {
			if strings.Contains(k, scope) {
				return true
			}
		}
		return false
	}

	// One user fills its share; another user and root are served.
	if r := flood(userA); !refusedFor(r, "per uid") {
		t.Errorf("user A: refused %v, want its limit per uid", r.Refused)
	}
	b := startCtlAgent(t, userB, sock)
	b.send(t, "b", solo, "B")
	b.wantGot(t, "b", "all_gather of one once user A is at its limit", "B")
	b.close(t, "b")
	root.send(t, "r", solo, "root")
	root.wantGot(t, "r", "all_gather of one once user A is at its limit", "root")

	// More users, until the daemon refuses them all.
	full := ""
	for uid := userB + 1; full == "" && uid < userB+1+total/max(perUID, 1)+2; uid++ {
		r := flood(uid)
		for _, scope := range []string{"for users other than root", "for all users"} {
			if refusedFor(r, scope) {
				full = scope
			}
		}
	}
	// Root connects anew and is served, however full the rest is.
	root.send(t, "r2", solo, "root again")
	root.wantGot(t, "r2", "all_gather of one on a new connection once every other user is refused", "root again")
	if full != "for users other than root" {
		t.Errorf("the last users were refused %q, want for users other than root", full)
	}
	wantLog(t, m, "for users other than root")
	if fds, limit := daemonFDs(t, m.pid); fds >= limit/2 {
		t.Errorf("the daemon holds %d descriptors, limit %d", fds, limit)
	}
}
