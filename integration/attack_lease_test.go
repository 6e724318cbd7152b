package integration

// Attacks by leases: a user may take a lease on a file of its own (a
// segment's backing file through export, its processes' /proc files), and
// the daemon never waits for one to break: the user's request is answered
// at once and no other user's waits. Each runs as an unprivileged user
// against a real --gpu sim mount, in both modes.

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

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
// and with EAGAIN, within 20 s (a truncate that waited for a lease would
// wait lease-break-time, 45 s; a loaded machine took more than 3 s to
// answer a thousand), and holds the leases until its stdin closes.
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
end = time.time() + 20
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
//
// Serial: while A's leases last, every daemon's scan of the machine's
// mappings is inconclusive (EAGAIN, never "unmapped"), which the holders,
// refcount and recovery of the tests beside it would see (a recovery
// rightly kept an UNLINK segment it could not prove unmapped).
func TestAttackProcLeaseStall(t *testing.T) {
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
