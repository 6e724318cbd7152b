package integration

// Attacks of the fourth fresh round (H*), each run as an unprivileged user
// against a real --gpu sim mount, in both modes.

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// limboFillScript opens the GPU segment argv[1] once and, holding that
// handle, grows it to argv[2] bytes, reads its IPC handle (as a consumer
// would before mapping it) and truncates it to 0 again and again, halving
// the size on each refusal down to one page: every truncate moves the
// segment to a new block, and the open handle keeps each old one, whose
// IPC handle left the daemon, in limbo. It prints how many rounds it
// made, and holds the handle until its stdin closes.
const limboFillScript = `
import os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
size, rounds = int(sys.argv[2]), 0
while size >= 4096 and rounds < 100000:
    try:
        os.ftruncate(fd, size)
        os.getxattr(sys.argv[1], "user.tensorfs.cuda.ipc_handle")
        os.ftruncate(fd, 0)
        rounds += 1
    except OSError:
        size //= 2
print("rounds", rounds, flush=True)
sys.stdin.read()
`

// userDirs makes a directory for each of users A and B, owned by them.
func userDirs(t *testing.T, m *mount) {
	t.Helper()
	reachable(t, m.dir)
	for uid, dir := range map[int]string{userA: "a", userB: "b"} {
		if err := os.Mkdir(m.path(dir), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(m.path(dir), uid, uid); err != nil {
			t.Fatal(err)
		}
	}
}

// h4Background starts script as uid with args, returns the first line it
// prints, and ends it (closing its stdin) at cleanup.
func h4Background(t *testing.T, uid int, script string, args ...string) string {
	t.Helper()
	cmd := asUser(pyCommand(script, args...), uid)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close()
		cmd.Process.Kill()
		cmd.Wait()
	})
	line, _ := bufio.NewReader(stdout).ReadString('\n')
	return strings.TrimSpace(line)
}

// TestAttackGPULimboFill (H1): the device memory that a truncate replaces
// waits in limbo while any handle of the segment is open (devSeg.retire).
// User A, on a 32 MiB mount, holds one handle of its own GPU segment and
// grows and truncates it again and again: before, limbo took the whole
// device (the simulated device's 16 GiB; with CUDA, the GPU's memory)
// while df said the mount was empty. Device memory in limbo now counts
// against --capacity like the segments' own (a growth must leave the
// backing room for it), and df counts it as used: A stops at the
// capacity, as with host bytes, and once A lets its handle go the room
// comes back: user B's write into its own GPU segment and root's new one
// work.
func TestAttackGPULimboFill(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		atk := gtDeviceSegment(t, m.path("a/leak"))
		if err := os.Chown(atk, userA, userA); err != nil {
			t.Fatal(err)
		}
		vic := gtDeviceSegment(t, m.path("b/w"))
		if err := os.Chown(vic, userB, userB); err != nil {
			t.Fatal(err)
		}
		a := startPythonAs(t, userA, "limbo filler", limboFillScript, atk, "25165824")
		line := a.next(t)
		_, limbo := gtLimbo(t, m)
		t.Logf("uid %d: %s; limbo %d bytes", userA, line, limbo)
		if limbo > 32<<20 {
			t.Errorf("uid %d's one handle keeps %d bytes of device memory in limbo on a 32 MiB mount", userA, limbo)
		}
		var st unix.Statfs_t
		if err := unix.Statfs(m.dir, &st); err != nil {
			t.Fatal(err)
		}
		if used := int64(st.Blocks-st.Bfree) * st.Bsize; used < limbo {
			t.Errorf("df says %d bytes used while %d wait in limbo", used, limbo)
		}
		a.stdin.Close()
		a.wait(t)
		gtWantLimboEmpty(t, m, "uid "+strconv.Itoa(userA)+" let its handle go")
		if out, err := runAs(t, userB, "/", "dd", "if=/dev/zero", "of="+vic, "bs=1M", "count=1", "conv=notrunc", "status=none"); err != nil {
			t.Errorf("uid %d's 1 MiB write into its GPU segment after uid %d's limbo went: %v\n%s", userB, userA, err, out)
		}
		root := gtDeviceSegment(t, m.path("rootgpu"))
		if err := os.Truncate(root, 1<<20); err != nil {
			t.Errorf("root's 1 MiB GPU segment after uid %d's limbo went: %v", userA, err)
		}
	}, append(gtSim, "--allow-other", "--capacity", "32M")...)
}

// gpuFdFloodScript makes empty segments in the cuda:0 directory argv[1]
// until 50 in a row fail (the daemon's descriptors freed meanwhile go to
// the next) or it has tried argv[2], and prints how many it made and the
// last error; then it opens the directory up to 64 times (well within
// its budget of handles) to take the few descriptors left, and holds them
// until its stdin closes.
const gpuFdFloodScript = `
import os, sys
d, n = sys.argv[1], int(sys.argv[2])
made, fails, err = 0, 0, "none"
for i in range(n):
    try:
        os.close(os.open("%s/s%d" % (d, i), os.O_CREAT | os.O_WRONLY, 0o600))
        made += 1
        fails = 0
    except OSError as e:
        err = "errno %d" % e.errno
        fails += 1
        if fails == 50:
            break
held = []
try:
    while len(held) < 64:
        held.append(os.open(d, os.O_RDONLY | os.O_DIRECTORY))
except OSError:
    pass
print("made", made, err, "then held", len(held), "directory handles", flush=True)
sys.stdin.read()
`

// TestAttackGPUSegmentFdFlood (H2): every GPU segment keeps its backing
// file open in the daemon for as long as it exists (devices.segment
// opens it for the spill), and no per-uid budget counts those
// descriptors: only open handles, directories, imports and watches do.
// User A makes empty segments in a cuda:0 directory of its own (no
// device memory, no backing space: each is an inode) until the daemon's
// descriptor table is full; root's and user B's creates then fail with
// EMFILE, and a remount restores every segment, so the daemon starts
// full. Per-uid bounds must hold for these descriptors too.
func TestAttackGPUSegmentFdFlood(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		if err := os.Mkdir(m.path("a/gpu"), 0o755); err != nil {
			t.Fatal(err)
		}
		gtSetDevice(t, m.path("a/gpu"), "cuda:0")
		if err := os.Chown(m.path("a/gpu"), userA, userA); err != nil {
			t.Fatal(err)
		}
		_, limit := daemonFDs(t, m.pid)
		out := h4Background(t, userA, gpuFdFloodScript, m.path("a/gpu"), strconv.Itoa(limit+100))
		fds, _ := daemonFDs(t, m.pid)
		t.Logf("uid %d: %s; the daemon holds %d descriptors of %d", userA, strings.TrimSpace(out), fds, limit)
		if err := os.WriteFile(m.path("rootfile"), []byte("root"), 0o644); err != nil {
			t.Errorf("root's create after uid %d made empty GPU segments: %v", userA, err)
		}
		if out, err := runAs(t, userB, "/", "sh", "-c", "echo b > "+m.path("b/f")+" && cat "+m.path("b/f")); err != nil || out != "b\n" {
			t.Errorf("uid %d's create after uid %d made empty GPU segments: %q, %v", userB, userA, out, err)
		}
	}, append(gtSim, "--allow-other")...)
}

// exportSpamScript asks the control socket of the mount argv[2] (the
// tensorfs package at argv[1]) for a read-only descriptor of the segment
// argv[3] (relative to the mount) again and again for argv[4] seconds, and
// prints how many it got.
const exportSpamScript = `
import os, sys, time
sys.path.insert(0, sys.argv[1])
import tensorfs
c = tensorfs.Client(sys.argv[2])
stop, n = time.time() + float(sys.argv[4]), 0
while time.time() < stop:
    try:
        os.close(c.export(sys.argv[3]))
        n += 1
    except OSError:
        pass
print("exports", n, flush=True)
`

// truncateLoopScript, the owner's ordinary work on its GPU segment
// argv[1] for argv[2] seconds: grow it to 24 MiB, write its last page,
// read its last byte, shrink it to 8 MiB, and so on. It stops at the first
// error and prints it.
const truncateLoopScript = `
import os, sys, time
p, stop = sys.argv[1], time.time() + float(sys.argv[2])
fd, i = os.open(p, os.O_RDWR), 0
try:
    while time.time() < stop:
        size = (8 << 20) if i % 2 else (24 << 20)
        i += 1
        os.ftruncate(fd, size)
        os.pwrite(fd, b"v" * 4096, size - 4096)
        os.pread(fd, 1, size - 1)
    print("clean", i)
except OSError as e:
    print("error after", i, "truncates:", e)
`

// TestAttackGPUExportResizeRace (H3): devSeg.resize (a truncate through
// the mount) changes a GPU segment's block and size without devSeg.mu,
// while the control socket's export of a KEEPFD GPU segment moves it to a
// new exportable block of the size it read, under devSeg.mu. User A, who
// may only read user B's KEEPFD GPU segment, asks for its descriptor again
// and again while B grows and shrinks it: an export that read 8 MiB
// installs an 8 MiB block after B's truncate set 24 MiB. B's reads and
// writes past 8 MiB then fail with EINVAL, and a clean unmount cannot
// spill the segment ("not spilled; its contents are lost"): after the
// remount B's bytes are zeros. A reader must not be able to corrupt or
// empty an owner's segment. (The blocks the exports handed out wait in
// limbo while B's handle is open, against --capacity: B's loop may end
// with ENOSPC, never with another error.)
func TestAttackGPUExportResizeRace(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		seg := gtDeviceSegment(t, m.path("b/w"))
		run(t, "setfattr", "-n", "user.tensorfs.flags", "-v", "KEEPFD", seg)
		run(t, "truncate", "-s", "1M", seg)
		if err := os.Chown(seg, userB, userB); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(seg, 0o644); err != nil {
			t.Fatal(err)
		}
		const secs = "8"
		spam := asUser(pyCommand(exportSpamScript, filepath.Join(repoRoot, "python"), m.dir, "b/w", secs), userA)
		var spamOut strings.Builder
		spam.Stdout, spam.Stderr = &spamOut, &spamOut
		if err := spam.Start(); err != nil {
			t.Fatal(err)
		}
		out := strings.TrimSpace(pythonAs(t, userB, "/", truncateLoopScript, seg, secs))
		spam.Process.Kill()
		spam.Wait()
		t.Logf("uid %d: %s; uid %d: %s", userB, out, userA, strings.TrimSpace(spamOut.String()))
		if !strings.HasPrefix(out, "clean") && !strings.Contains(out, "No space left on device") {
			t.Errorf("uid %d's truncates and I/O on its own GPU segment while uid %d (a reader) exports it: %s", userB, userA, out)
		}
		m.unmount(t, false)
		if strings.Contains(m.stderr.String(), "not spilled") {
			t.Errorf("a clean unmount lost uid %d's GPU segment:\n%s", userB, m.stderr.String())
		}
		m2 := m.remount(t)
		size := gtSize(t, m2.path("b/w"))
		tail := run(t, "dd", "if="+m2.path("b/w"), "bs=4096", "skip="+strconv.FormatInt(size/4096-1, 10), "count=1", "status=none")
		if tail != strings.Repeat("v", 4096) {
			t.Errorf("uid %d's GPU segment after the remount: its last page (of %d bytes) is not what it wrote last", userB, size)
		}
	}, append(gtSim, "--allow-other", "--capacity", "64M")...)
}

// leaseScript (the tensorfs package at argv[1], the mount argv[2]): it
// makes the segment argv[3] (relative to the mount) KEEPFD, takes a read
// lease on its backing file through export, and moves the segment to
// cuda:0 on a thread of its own, which the lease stands in the way of. It
// prints what the move answered within a second ("waiting" if it had not)
// and the device the segment then has, and holds the lease until its
// stdin closes (SIGIO, the kernel's notice that the lease is being
// broken, is ignored).
const leaseScript = `
import errno, fcntl, os, signal, sys, threading
sys.path.insert(0, sys.argv[1])
import tensorfs
signal.signal(signal.SIGIO, signal.SIG_IGN)
m, rel = sys.argv[2], sys.argv[3]
p = os.path.join(m, rel)
os.setxattr(p, "user.tensorfs.flags", b"KEEPFD")
fd = tensorfs.Client(m).export(rel)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
answer = ["waiting"]
def move():
    try:
        os.setxattr(p, "user.tensorfs.device", b"cuda:0")
        answer[0] = "ok"
    except OSError as e:
        answer[0] = errno.errorcode[e.errno]
t = threading.Thread(target=move, daemon=True)
t.start()
t.join(1)
dev = os.getxattr(p, "user.tensorfs.device").decode() if answer[0] != "waiting" else "?"
print("leased, move:", answer[0], "device:", dev, flush=True)
sys.stdin.read()
`

// TestAttackGPULeaseStall (H4): devices.segment opened a segment's backing
// file for reading and writing while it held devices.mu, the lock of
// every GPU segment. The backing file belongs to the segment's owner, who
// can get a descriptor of it (export of a KEEPFD segment) and take a read
// lease on it: the daemon's open then waited for the lease to break, up to
// lease-break-time (45 s by default), with devices.mu held. User A does
// that to its own segment and moves it to cuda:0; meanwhile user B could
// not create (or remove) a GPU segment of its own, and A could start again
// with another segment. The daemon never waits for a lease: A's move is
// answered at once (EBUSY: the VFS turns a setxattr's EAGAIN into
// EOPNOTSUPP), its segment stays on the CPU, and B's create does not wait
// on A's lease.
func TestAttackGPULeaseStall(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		if err := os.Mkdir(m.path("b/gpu"), 0o755); err != nil {
			t.Fatal(err)
		}
		gtSetDevice(t, m.path("b/gpu"), "cuda:0")
		if err := os.Chown(m.path("b/gpu"), userB, userB); err != nil {
			t.Fatal(err)
		}
		if out, err := runAs(t, userA, "/", "touch", m.path("a/x")); err != nil {
			t.Fatalf("uid %d touch: %v\n%s", userA, err, out)
		}
		gtWaitRefcount0(t, m.path("a/x"))
		line := h4Background(t, userA, leaseScript, filepath.Join(repoRoot, "python"), m.dir, "a/x")
		if line != "leased, move: EBUSY device: cpu" {
			t.Errorf("uid %d's move of its own leased segment: %q, want EBUSY at once and the segment still on the CPU", userA, line)
		}
		start := time.Now()
		out, err := runAs(t, userB, "/", "timeout", "-s", "KILL", "10", "touch", m.path("b/gpu/w"))
		if took := time.Since(start); err != nil || took > 5*time.Second {
			t.Errorf("uid %d's create of a GPU segment while uid %d holds a lease on its own segment's backing file: %v after %v\n%s", userB, userA, err, took.Round(time.Millisecond), out)
		}
	}, append(gtSim, "--allow-other")...)
}

// leaseTruncScript (the tensorfs package at argv[1], the mount argv[2]):
// it makes argv[4] empty KEEPFD segments in the directory argv[3] (relative
// to the mount), takes a read lease on each backing file through export
// (once the daemon has let go of the descriptor the create wrote through),
// then truncates every one by path at once, each on a thread of its own:
// the daemon's open of the backing file for the truncate (resizeFile)
// conflicts with the lease. It prints how many truncates were answered,
// and with EAGAIN, within 3 s, and holds the leases until its stdin closes.
const leaseTruncScript = `
import errno, fcntl, os, resource, signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
import tensorfs
signal.signal(signal.SIGIO, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
m, d, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
for i in range(n):
    p = os.path.join(m, d, "s%d" % i)
    open(p, "w").close()
    os.setxattr(p, "user.tensorfs.flags", b"KEEPFD")
c, fds, deadline = tensorfs.Client(m), [], time.time() + 10
for i in range(n):
    fd = c.export("%s/s%d" % (d, i))
    while True:
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
            break
        except BlockingIOError:
            if time.time() > deadline:
                raise
            time.sleep(0.01)
    fds.append(fd)
answers = []
def trunc(p):
    try:
        os.truncate(p, 0)
        answers.append("ok")
    except OSError as e:
        answers.append(errno.errorcode[e.errno])
threading.stack_size(64 << 10)
threads = [threading.Thread(target=trunc, args=(os.path.join(m, d, "s%d" % i),), daemon=True) for i in range(n)]
for t in threads:
    t.start()
end = time.time() + 3
for t in threads:
    t.join(max(end - time.time(), 0))
print("leased and truncating", n, "answered", len(answers), "EAGAIN", answers.count("EAGAIN"), flush=True)
sys.stdin.read()
`

// daemonThreads returns the daemon's thread count.
func daemonThreads(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "Threads:") {
			return strings.TrimSpace(strings.TrimPrefix(l, "Threads:"))
		}
	}
	return "?"
}

// TestAttackLeaseHeldRequests (H5): a truncate by path opens the
// segment's backing file for writing (resizeFile), and while that open
// waited for a lease to break the request held two of the daemon's
// descriptors (the O_PATH reference and the slot of the open) and one of
// its OS threads, for lease-break-time (45 s), counted by no per-uid
// budget. User A takes read leases on its own segments' backing files
// (export of KEEPFD segments) and truncates them all at once: here twice
// its budget of descriptors; about half the daemon's open-file limit of
// them filled its descriptor table (root's and others' opens and creates
// failed with EMFILE, again and again as A renewed its leases), and where
// that limit is above 20000 the threads passed the Go runtime's 10000 and
// the daemon aborted. The daemon never waits for a lease: every truncate
// is answered EAGAIN at once, holds nothing after, and B keeps working.
func TestAttackLeaseHeldRequests(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		before, limit := daemonFDs(t, m.pid)
		perUID := max(limit/2-256-1024, 64) / 16
		n := 2 * perUID
		line := h4Background(t, userA, leaseTruncScript, filepath.Join(repoRoot, "python"), m.dir, "a", strconv.Itoa(n))
		fds, _ := daemonFDs(t, m.pid)
		t.Logf("uid %d: %s; the daemon holds %d descriptors (%d before, per-uid budget %d, limit %d) and %s threads", userA, line, fds, before, perUID, limit, daemonThreads(t, m.pid))
		if fds-before > perUID+64 {
			t.Errorf("uid %d's truncates waiting on its own leases hold %d of the daemon's descriptors, past its budget of %d", userA, fds-before, perUID)
		}
		if want := fmt.Sprintf("leased and truncating %d answered %d EAGAIN %d", n, n, n); line != want {
			t.Errorf("uid %d's truncates of its own leased segments: %q, want %q (EAGAIN at once)", userA, line, want)
		}
		if out, err := runAs(t, userB, "/", "timeout", "-s", "KILL", "10", "sh", "-c", "echo x > "+m.path("b/w")+" && truncate -s 0 "+m.path("b/w")); err != nil {
			t.Errorf("uid %d's create and truncate beside uid %d's leases: %v\n%s", userB, userA, err, out)
		}
	}, "--allow-other")
}

// procLeaseScript (the mount argv[1], a segment argv[2] relative to it):
// it takes write leases on its own /proc/self/maps, status and comm (a
// process's files there are its owner's, and owning a file is all a lease
// asks), then opens the segment through the mount from the same thread,
// whose status the daemon reads to learn the caller's process. It prints
// how long that open took, and holds the leases until its stdin closes.
const procLeaseScript = `
import fcntl, os, signal, sys, time
signal.signal(signal.SIGIO, signal.SIG_IGN)
fds = []
for name in ("maps", "status", "comm"):
    fd = os.open("/proc/self/" + name, os.O_RDONLY)
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    fds.append(fd)
start = time.time()
os.close(os.open(os.path.join(sys.argv[1], sys.argv[2]), os.O_WRONLY | os.O_CREAT, 0o644))
print("leased, open took %.0f s" % (time.time() - start), flush=True)
sys.stdin.read()
`

// TestAttackProcLeaseStall (found beside H4 and H5): the daemon reads
// /proc/PID/status of a request's caller (its process and groups) and
// every process's /proc/PID/maps (holders, refcount, UNLINK), and a user
// can take a lease on its own processes' files there. A plain open of one
// then slept for lease-break-time (45 s): the caller's own requests each
// held a daemon thread and descriptor that long, and a scan of the maps
// held mapTable.mu, so that every user's holders and refcount waited 45 s
// per leased file. The daemon never waits on a lease: A's open answers at
// once, and B's holders does not wait on A's leases.
func TestAttackProcLeaseStall(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		line := h4Background(t, userA, procLeaseScript, m.dir, "a/y")
		if line != "leased, open took 0 s" {
			t.Errorf("uid %d's open with leases on its own /proc files: %q, want an answer at once", userA, line)
		}
		if out, err := runAs(t, userB, "/", "touch", m.path("b/x")); err != nil {
			t.Fatalf("uid %d touch: %v\n%s", userB, err, out)
		}
		start := time.Now()
		out, err := runAs(t, userB, "/", "timeout", "-s", "KILL", "10", "getfattr", "-n", "user.tensorfs.holders", m.path("b/x"))
		if took := time.Since(start); err != nil || took > 5*time.Second {
			t.Errorf("uid %d's holders while uid %d leases its own /proc/PID/maps: %v after %v\n%s", userB, userA, err, took.Round(time.Millisecond), out)
		}
	}, "--allow-other")
}
