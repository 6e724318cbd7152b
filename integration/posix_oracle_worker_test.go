package integration

// The worker side of the POSIX oracle (posix_oracle_test.go): the test
// binary re-executed with oracleWorkerEnv set becomes one caller. It sets
// its credentials once and runs every operation it is sent on both trees,
// so both see the same caller; it answers each tree's errno and output.

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// oracleOp is one operation of a sequence, by one caller. Paths are
// relative to the tree's top.
type oracleOp struct {
	Caller int    `json:"c"`
	Op     string `json:"op"`
	Path   string `json:"p,omitempty"`
	Path2  string `json:"p2,omitempty"`
	Slot   int    `json:"slot,omitempty"`
	Flags  int    `json:"fl,omitempty"`
	Mode   uint32 `json:"mode,omitempty"`
	Uid    int    `json:"uid,omitempty"`
	Gid    int    `json:"gid,omitempty"`
	Size   int64  `json:"size,omitempty"`
	Off    int64  `json:"off,omitempty"`
	Data   string `json:"data,omitempty"`
	Name   string `json:"name,omitempty"`
	Atime  int64  `json:"at,omitempty"`
	Mtime  int64  `json:"mt,omitempty"`
	Dev    uint64 `json:"dev,omitempty"`
}

// oracleRequest is what a worker is sent: an operation and the two tops.
type oracleRequest struct {
	Tops [2]string
	Op   oracleOp
}

// oracleReply is a worker's answer: each tree's errno and output, and a
// mode to give the tmpfs file held in FixPath (setid-dropped-at-open).
type oracleReply struct {
	Errno   [2]int
	Out     [2]string
	FixPath string
	FixMode uint32
}

func init() {
	if spec := os.Getenv(oracleWorkerEnv); spec != "" {
		os.Exit(oracleWorker(spec))
	}
}

// oracleWorker sets the credentials in spec, then runs each request read
// from stdin on both trees and writes the reply to stdout.
func oracleWorker(spec string) int {
	var c oracleCred
	if err := json.Unmarshal([]byte(spec), &c); err != nil {
		fmt.Fprintln(os.Stderr, "oracle worker:", err)
		return 2
	}
	if err := setCred(c); err != nil {
		fmt.Fprintln(os.Stderr, "oracle worker:", err)
		return 2
	}
	w := &worker{}
	for i := range w.fds {
		w.fds[i] = [2]int{-1, -1}
	}
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(nil, 1<<20)
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		var req oracleRequest
		if err := json.Unmarshal(in.Bytes(), &req); err != nil {
			fmt.Fprintln(os.Stderr, "oracle worker:", err)
			return 2
		}
		if err := out.Encode(w.do(req)); err != nil {
			return 2
		}
	}
	return 0
}

// setCred sets the groups, the real, effective and saved ids and the
// umask of the whole process (the syscall package's set*id calls reach
// every thread).
func setCred(c oracleCred) error {
	if err := syscall.Setgroups(c.Groups); err != nil {
		return fmt.Errorf("setgroups %v: %w", c.Groups, err)
	}
	if err := syscall.Setresgid(c.Rgid, c.Egid, c.Sgid); err != nil {
		return fmt.Errorf("setresgid: %w", err)
	}
	if err := syscall.Setresuid(c.Ruid, c.Euid, c.Suid); err != nil {
		return fmt.Errorf("setresuid: %w", err)
	}
	syscall.Umask(c.Umask)
	return nil
}

// worker is a caller's state: the descriptors its slots hold on each tree.
type worker struct {
	fds [oracleSlots][2]int
}

// do runs req's operation on both trees.
func (w *worker) do(req oracleRequest) oracleReply {
	var r oracleReply
	for i, top := range req.Tops {
		out, err := w.run(req.Op, top, i)
		r.Errno[i], r.Out[i] = errnoOf(err), out
	}
	op := req.Op
	// An O_TRUNC clears them on tmpfs itself (not of a file it creates).
	if (op.Op == "open" || op.Op == "tmpfile") && r.Errno == [2]int{} && op.Flags&unix.O_ACCMODE != unix.O_RDONLY {
		r.FixPath, r.FixMode = w.dropSetid(w.fds[op.Slot][0])
	}
	return r
}

// errnoOf returns err's errno, 0 for nil.
func errnoOf(err error) int {
	if err == nil {
		return 0
	}
	var e syscall.Errno
	if errors.As(err, &e) {
		return int(e)
	}
	return -1
}

// dropSetid returns the magic link of the tmpfs descriptor fd and the
// mode that tensorfs gives a file on opening it for writing (the bits a
// write by this process would clear: should_remove_suid), or "" if the
// mode stays (intendedDiffs "setid-dropped-at-open").
func (w *worker) dropSetid(fd int) (string, uint32) {
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || unix.Geteuid() == 0 {
		return "", 0
	}
	kill := st.Mode & unix.S_ISUID
	if st.Mode&unix.S_ISGID != 0 && (st.Mode&unix.S_IXGRP != 0 || !inGroup(st.Gid)) {
		kill |= unix.S_ISGID
	}
	if kill == 0 {
		return "", 0
	}
	return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), fd), st.Mode & 07777 &^ kill
}

// inGroup reports whether gid is this process's effective group or one of
// its supplementary groups (in_group_p).
func inGroup(gid uint32) bool {
	if uint32(unix.Getegid()) == gid {
		return true
	}
	groups, _ := unix.Getgroups()
	return slices.Contains(groups, int(gid))
}

// timespec turns an oracleOp time into utimensat's.
func timespec(ns int64) unix.Timespec {
	switch ns {
	case utimeNow:
		return unix.Timespec{Nsec: unix.UTIME_NOW}
	case utimeOmit:
		return unix.Timespec{Nsec: unix.UTIME_OMIT}
	}
	return unix.NsecToTimespec(ns)
}

// run runs op on the tree at top (tree i: 0 tmpfs, 1 tensorfs) and
// returns what it read, if anything.
func (w *worker) run(op oracleOp, top string, i int) (string, error) {
	p, p2 := filepath.Join(top, op.Path), filepath.Join(top, op.Path2)
	slot := &w.fds[op.Slot][i]
	switch op.Op {
	case "open", "tmpfile":
		if *slot >= 0 {
			unix.Close(*slot)
			*slot = -1
		}
		flags := op.Flags | unix.O_CLOEXEC | unix.O_NONBLOCK
		if op.Op == "tmpfile" {
			flags |= unix.O_TMPFILE
		}
		fd, err := unix.Open(p, flags, op.Mode)
		if err == nil {
			*slot = fd
		}
		return "", err
	case "close":
		if *slot < 0 {
			return "", unix.EBADF
		}
		err := unix.Close(*slot)
		*slot = -1
		return "", err
	case "read":
		buf := make([]byte, op.Size)
		n, err := unix.Pread(*slot, buf, op.Off)
		if op.Off < 0 {
			n, err = unix.Read(*slot, buf)
		}
		return string(buf[:max(n, 0)]), err
	case "write":
		n, err := unix.Pwrite(*slot, []byte(op.Data), op.Off)
		if op.Off < 0 {
			n, err = unix.Write(*slot, []byte(op.Data))
		}
		return strconv.Itoa(n), err
	case "ftruncate":
		return "", unix.Ftruncate(*slot, op.Size)
	case "fallocate":
		return "", unix.Fallocate(*slot, uint32(op.Flags), op.Off, op.Size)
	case "fchmod":
		return "", unix.Fchmod(*slot, op.Mode)
	case "linkat":
		proc := fmt.Sprintf("/proc/self/fd/%d", *slot)
		return "", unix.Linkat(unix.AT_FDCWD, proc, unix.AT_FDCWD, p, unix.AT_SYMLINK_FOLLOW)
	case "mkdir":
		return "", unix.Mkdir(p, op.Mode)
	case "mknod":
		return "", unix.Mknod(p, op.Mode, int(op.Dev))
	case "symlink":
		return "", unix.Symlink(op.Data, p)
	case "link":
		return "", unix.Link(p, p2)
	case "rename":
		return "", unix.Renameat2(unix.AT_FDCWD, p, unix.AT_FDCWD, p2, uint(op.Flags))
	case "unlink":
		return "", unix.Unlink(p)
	case "rmdir":
		return "", unix.Rmdir(p)
	case "chmod":
		return "", unix.Chmod(p, op.Mode)
	case "chown":
		return "", unix.Fchownat(unix.AT_FDCWD, p, op.Uid, op.Gid, op.Flags)
	case "truncate":
		return "", unix.Truncate(p, op.Size)
	case "utimens":
		ts := []unix.Timespec{timespec(op.Atime), timespec(op.Mtime)}
		return "", unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, op.Flags)
	case "setxattr":
		if op.Flags&oracleNofollow != 0 {
			return "", unix.Lsetxattr(p, op.Name, []byte(op.Data), op.Flags&^oracleNofollow)
		}
		return "", unix.Setxattr(p, op.Name, []byte(op.Data), op.Flags)
	case "getxattr":
		buf := make([]byte, 256)
		n, err := unix.Lgetxattr(p, op.Name, buf)
		return string(buf[:max(n, 0)]), err
	case "listxattr":
		names, err := userXattrs(p)
		return strings.Join(names, ","), err
	case "removexattr":
		return "", unix.Lremovexattr(p, op.Name)
	}
	return "", fmt.Errorf("unknown operation %q", op.Op)
}

// oracleNofollow in a setxattr's Flags asks for lsetxattr.
const oracleNofollow = 1 << 16

// userXattrs lists p's user.* attributes, sorted, less tensorfs' virtual
// ones (intendedDiffs "virtual-xattrs").
func userXattrs(p string) ([]string, error) {
	buf := make([]byte, 4096)
	n, err := unix.Llistxattr(p, buf)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, name := range strings.Split(string(buf[:n]), "\x00") {
		if strings.HasPrefix(name, "user.") && !strings.HasPrefix(name, "user.tensorfs.") {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	return names, nil
}

// callerProc is the parent's end of one worker.
type callerProc struct {
	cmd *exec.Cmd
	in  *json.Encoder
	out *bufio.Scanner
}

// startCallers starts one worker per oracleCallers entry; the cleanup
// ends them (before the mounts' cleanups, registered earlier, run).
func startCallers(t *testing.T) []*callerProc {
	t.Helper()
	var procs []*callerProc
	for _, c := range oracleCallers {
		spec, err := json.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), oracleWorkerEnv+"="+string(spec))
		cmd.Dir = "/"
		cmd.Stderr = os.Stderr
		stdin, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatalf("starting the %s worker: %v", c.Name, err)
		}
		t.Cleanup(func() {
			stdin.Close()
			if err := cmd.Wait(); err != nil {
				t.Errorf("the %s worker: %v", c.Name, err)
			}
		})
		sc := bufio.NewScanner(stdout)
		sc.Buffer(nil, 1<<20)
		procs = append(procs, &callerProc{cmd: cmd, in: json.NewEncoder(stdin), out: sc})
	}
	return procs
}

// call sends one request and waits for its reply.
func (p *callerProc) call(t *testing.T, req oracleRequest) oracleReply {
	t.Helper()
	if err := p.in.Encode(req); err != nil {
		t.Fatalf("sending %v: %v", req.Op, err)
	}
	if !p.out.Scan() {
		t.Fatalf("worker %d ended before answering %v: %v", p.cmd.Process.Pid, req.Op, p.out.Err())
	}
	var r oracleReply
	if err := json.Unmarshal(p.out.Bytes(), &r); err != nil {
		t.Fatalf("worker's reply %q: %v", p.out.Bytes(), err)
	}
	return r
}
