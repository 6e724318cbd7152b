package integration

// Attacks on a mount's life cycle and on the CLI's output: mounting over a
// mount that a daemon still serves detached, purging a busy mount,
// importing a FIFO, and process or file names that forge output.

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"tensorfs/alloc"
)

// lifeOpenScript creates or opens argv[1], writes "held" at its start,
// says "ready", and answers each line with the file's first 4 bytes,
// read through its descriptor.
const lifeOpenScript = `
import os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
os.pwrite(fd, b"held", 0)
print("ready", flush=True)
for line in sys.stdin:
    print(os.pread(fd, 4, 0).decode(), flush=True)
`

// lifeMapScript maps argv[1], closes its descriptor, says "ready", and
// answers each line with the first 4 bytes of the mapping.
const lifeMapScript = `
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, 0)
os.close(fd)
print("ready", flush=True)
for line in sys.stdin:
    print(m[:4].decode(), flush=True)
`

// lifeNamedScript names its process argv[2] (PR_SET_NAME), opens argv[1],
// creating it, says "ready", and holds it until its stdin closes.
const lifeNamedScript = `
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(15, ctypes.c_char_p(os.fsencode(sys.argv[2])), 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "prctl PR_SET_NAME")
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
print("ready", flush=True)
sys.stdin.read()
`

// lifeWaitExit waits for the daemon of m to exit by itself.
func lifeWaitExit(t *testing.T, m *mount) {
	t.Helper()
	select {
	case <-m.exited:
	case <-time.After(exitTimeout):
		t.Fatalf("daemon %d did not exit within %v after its last user", m.pid, exitTimeout)
	}
}

// TestAttackLifeMountOverServedMount: the mount is detached (umount -l)
// while a child holds an UNLINK segment, so its daemon serves on. A new
// tensorfs mount there must refuse at once, naming that daemon, and
// leave the backing alone: the held segment keeps its name and its
// holder its bytes. Once the daemon is gone, even a pid file naming some
// other live process does not stop the next mount.
func TestAttackLifeMountOverServedMount(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		if err := os.Mkdir(m.path("tmp"), 0o755); err != nil {
			t.Fatal(err)
		}
		run(t, "setfattr", "-n", "user.tensorfs.flags", "-v", "SHAREDMEM|UNLINK", m.path("tmp"))
		holder := startPython(t, "holder", lifeOpenScript, m.path("tmp/seg"))
		holder.expect(t, "ready")
		backing := filepath.Join(alloc.PrivateBacking(m.dir), "tmp", "seg")
		if _, err := os.Stat(backing); err != nil {
			t.Fatalf("backing of the held segment: %v", err)
		}

		run(t, "umount", "-l", m.dir)
		if isMounted(m.dir) {
			t.Fatalf("%s still mounted after umount -l", m.dir)
		}
		pid := strconv.Itoa(m.pid)
		ccExpectOneLineError(t, []string{"mount", m.dir}, m.dir, "pid "+pid, "kill "+pid)
		ccExpectOneLineError(t, []string{"mount", "-f", m.dir}, m.dir, "pid "+pid, "kill "+pid)

		if _, err := os.Stat(backing); err != nil {
			t.Errorf("the held UNLINK segment lost its name in the backing: %v", err)
		}
		if got := holder.do(t, "read"); got != "held" {
			t.Errorf("holder reads %q through the detached mount, want \"held\"", got)
		}
		select {
		case <-m.exited:
			t.Fatalf("the serving daemon exited: %v\n%s", m.exitErr, tail(m.stderr.String()))
		default:
		}

		holder.wait(t)
		lifeWaitExit(t, m)
		// A dead daemon's pid reused by a process that is no daemon.
		if err := os.WriteFile(alloc.StatePath(m.dir, ".pid"), []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		m2 := m.remount(t)
		if ents, err := os.ReadDir(m2.path("tmp")); err != nil || len(ents) != 0 {
			t.Errorf("after the remount, tmp holds %v (%v); want the UNLINK segment gone with its holder", ents, err)
		}
	})
}

// TestAttackLifePurgeBusyMount: unmount --purge of a mount whose segment
// a child still maps asks the daemon over its control socket to purge,
// detaches the mount, says who keeps it and who purges, and exits 0; the
// backing stays while the child uses it and is purged by the daemon once
// the child is gone.
func TestAttackLifePurgeBusyMount(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		data := append([]byte("data"), make([]byte, 4092)...)
		if err := os.WriteFile(m.path("w"), data, 0o644); err != nil {
			t.Fatal(err)
		}
		holder := startPython(t, "mapper", lifeMapScript, m.path("w"))
		holder.expect(t, "ready")
		backing := alloc.PrivateBacking(m.dir)

		out := run(t, tensorfs, "unmount", "--purge", m.dir)
		want := fmt.Sprintf("%s detached; 1 process still holds files; the daemon (pid %d) purges the backing when the last one exits", m.dir, m.pid)
		if !strings.Contains(out, want) {
			t.Errorf("tensorfs unmount --purge of a busy mount said %q, want %q", out, want)
		}
		if isMounted(m.dir) {
			t.Errorf("%s still mounted after unmount --purge", m.dir)
		}
		if got := holder.do(t, "read"); got != "data" {
			t.Errorf("the mapping reads %q after the purge request, want \"data\"", got)
		}
		if _, err := os.Stat(filepath.Join(backing, "w")); err != nil {
			t.Errorf("the backing went while a mapping uses it: %v", err)
		}

		holder.cmd.Process.Kill()
		<-holder.done
		eventually(t, "daemon exited and backing purged", func() (bool, string) {
			select {
			case <-m.exited:
			default:
				return false, "the daemon still runs"
			}
			if _, err := os.Lstat(backing); !errors.Is(err, fs.ErrNotExist) {
				return false, fmt.Sprintf("backing %s: %v", backing, err)
			}
			return true, ""
		})
		wantLog(t, m, "ctl: purge asked", "uid=0")
		wantLog(t, m, "purged the backing")
	})
}

// TestAttackLifePurgeOverSocket: the control socket's purge is for the
// daemon's user and root. userA, let in by --allow-other, is refused
// (EACCES, logged) and nothing is purged: after a plain unmount the next
// mount serves the segment. Root's purge, followed by a plain umount(8),
// has the daemon purge its backing as it exits.
func TestAttackLifePurgeOverSocket(t *testing.T) {
	t.Parallel()
	requireTorchFreePython(t)
	m := mountFS(t, "passthrough", "--allow-other")
	reachable(t, m.dir)
	if err := os.WriteFile(m.path("w"), []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	a := startCtlAgent(t, userA, controlSocket(t, m))
	a.send(t, "c", map[string]any{"op": "purge"}, "")
	a.wantErrno(t, "c", "purge", syscall.EACCES)
	a.close(t, "c")
	wantLog(t, m, "ctl: refused", "op=purge", fmt.Sprintf("uid=%d", userA))
	m.unmount(t, false)
	if strings.Contains(m.stderr.String(), "purged") {
		t.Errorf("the daemon purged after uid %d's refused request:\n%s", userA, tail(m.stderr.String()))
	}

	m2 := m.remount(t)
	if b, err := os.ReadFile(m2.path("w")); err != nil || string(b) != "kept" {
		t.Fatalf("after uid %d's refused purge, the next mount reads %q, %v; want the segment", userA, b, err)
	}
	c := controlDial(t, m2)
	if err := c.Purge(); err != nil {
		t.Fatalf("root's purge: %v", err)
	}
	c.Close()
	run(t, "umount", m2.dir)
	lifeWaitExit(t, m2)
	backing := alloc.PrivateBacking(m2.dir)
	if _, err := os.Lstat(backing); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("backing %s after root's purge and umount: %v", backing, err)
	}
	wantLog(t, m2, "purged the backing")
}

// TestAttackLifeImportFifo: a FIFO that a user put where root imports
// from is refused at once (it would block open forever), and an export
// whose output name is a FIFO replaces it rather than opening it.
func TestAttackLifeImportFifo(t *testing.T) {
	t.Parallel()
	m := mountFS(t, "passthrough")
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	reachable(t, dir)
	for _, name := range []string{"in.safetensors", "out.safetensors"} {
		if out, err := runAs(t, userA, dir, "mkfifo", name); err != nil {
			t.Fatalf("mkfifo %s as uid %d: %v\n%s", name, userA, err, out)
		}
	}
	in := filepath.Join(dir, "in.safetensors")
	ccExpectOneLineError(t, []string{"import", in, m.path("x")}, in, "not a regular file")
	if _, err := os.Lstat(m.path("x")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a refused import left %s: %v", m.path("x"), err)
	}

	if err := os.Mkdir(m.path("d"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(m.path("d/t"), make([]byte, 8), 0o644); err != nil {
		t.Fatal(err)
	}
	run(t, "setfattr", "-n", "user.tensor.dtype", "-v", "float32", m.path("d/t"))
	run(t, "setfattr", "-n", "user.tensor.shape", "-v", "[2]", m.path("d/t"))
	out := filepath.Join(dir, "out.safetensors")
	if stdout, stderr, code := stTensorfs(t, "export", m.path("d"), out); code != 0 {
		t.Fatalf("export to a FIFO's name: exit %d\n%s%s", code, stdout, stderr)
	}
	if fi, err := os.Lstat(out); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("export output %s: %v %v, want a regular file", out, fi, err)
	}
}

// lifeHoldAs starts a python child as uid that calls itself comm and
// holds path open (creating it), and returns its pid once it does.
func lifeHoldAs(t *testing.T, uid int, path, comm string) int {
	t.Helper()
	c := startPythonAs(t, uid, "holder "+comm, lifeNamedScript, path, comm)
	c.expect(t, "ready")
	pid := c.cmd.Process.Pid
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err != nil || string(b) != comm+"\n" {
		t.Fatalf("holder's comm is %q (%v), want %q", b, err, comm)
	}
	return pid
}

// TestAttackLifeForgedHolder: uid 1000 names its processes "x\n1 systemd
// 9" (a forged holders line) and "\x1b[2J,1:init" (a terminal escape and
// a forged ls holder) and holds a segment whose name carries escapes.
// user.tensorfs.holders keeps one line of three fields per process, and
// tensorfs ls -l shows every name escaped, no control byte reaching the
// terminal.
func TestAttackLifeForgedHolder(t *testing.T) {
	t.Parallel()
	m := mountFS(t, "passthrough", "--allow-other")
	reachable(t, m.dir)
	pub := m.path("pub")
	if err := os.Mkdir(pub, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(pub, 0o777); err != nil {
		t.Fatal(err)
	}
	name := "seg\x1b[31m\nfake"
	seg := filepath.Join(pub, name)
	comms := map[int]string{}
	for _, c := range []string{"x\n1 systemd 9", "\x1b[2J,1:init"} {
		comms[lifeHoldAs(t, userA, seg, c)] = c
	}
	pids := slices.Sorted(maps.Keys(comms))
	escaped := map[string]string{"x\n1 systemd 9": `x\x0a1\x20systemd\x209`, "\x1b[2J,1:init": `\x1b[2J,1:init`}

	var want, wantLs []string
	for _, pid := range pids {
		want = append(want, fmt.Sprintf("%d %s 1", pid, escaped[comms[pid]]))
		wantLs = append(wantLs, fmt.Sprintf("%d:%s(1)", pid, strings.ReplaceAll(escaped[comms[pid]], ",", `\x2c`)))
	}
	raw, err := getxattr(seg, "user.tensorfs.holders")
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Split(strings.TrimSuffix(string(raw), "\n"), "\n"); !slices.Equal(got, want) {
		t.Errorf("holders = %q, want %q", got, want)
	}

	out := stOK(t, "ls", "-l", pub)
	for i := 0; i < len(out); i++ {
		if c := out[i]; c < 0x20 && c != '\n' || c == 0x7f {
			t.Errorf("tensorfs ls -l wrote control byte %#x at %d:\n%q", c, i, out)
			break
		}
	}
	if lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n"); len(lines) != 3 {
		t.Errorf("tensorfs ls -l: %d lines, want a summary, a header and one row:\n%s", len(lines), out)
	}
	lsWantRow(t, out, `seg\x1b[31m\x0afake`, "0", "cpu", "SHAREDMEM", "2", "-", "-", strings.Join(wantLs, ","))
	if ents, err := os.ReadDir(pub); err != nil || len(ents) != 1 || ents[0].Name() != name {
		t.Errorf("pub holds %v (%v), want only %q", ents, err, name)
	}
}

// TestUnmountHeldInAnotherNamespace: a mount namespace made while the
// mount existed (unshare -m, a container) keeps a copy of it, and with it
// the daemon's connection, after the mount here is gone. tensorfs unmount
// says so, naming a process of that namespace, rather than only that the
// daemon did not exit; the daemon exits once that namespace is gone.
func TestUnmountHeldInAnotherNamespace(t *testing.T) {
	t.Parallel()
	m := mountFS(t, "passthrough")
	holder := exec.Command("unshare", "-m", "--propagation", "private", "sleep", "60")
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	defer holder.Process.Kill()
	self, _ := os.Readlink("/proc/self/ns/mnt")
	eventually(t, "unshare made its mount namespace", func() (bool, string) {
		ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", holder.Process.Pid))
		return err == nil && ns != self, ns
	})
	_, errs, code := stTensorfs(t, "unmount", m.dir)
	want := fmt.Sprintf("still mounted in another mount namespace (a container's, or one unshare made), that of pid %d (sleep)",
		holder.Process.Pid)
	if code != 1 || !strings.Contains(errs, want) {
		t.Errorf("tensorfs unmount of a mount another namespace holds: exit %d, %q; want 1 and %q", code, errs, want)
	}
	if isMounted(m.dir) {
		t.Errorf("%s still mounted here", m.dir)
	}
	holder.Process.Kill()
	holder.Wait()
	eventually(t, "the daemon exited once the namespace was gone", func() (bool, string) {
		select {
		case <-m.exited:
			return true, ""
		default:
			return false, "the daemon still runs"
		}
	})
}
