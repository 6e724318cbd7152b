package integration

// Record locks behave on the mount as on tmpfs, in both modes: POSIX
// (fcntl) locks belong to a process and go with any close by it or its
// exit, F_GETLK names the holder's pid, F_SETLKW is interruptible; flock
// locks belong to an open file description. The same script runs on a
// tmpfs directory and on the mount, and both must answer every rule the
// same, true way.

import (
	"encoding/json"
	"os"
	"testing"
)

// lockRulesScript (argv: dir) checks each lock rule with files in dir and
// prints a JSON object of rule -> bool. Every wait is bounded.
const lockRulesScript = `
import errno, fcntl, json, os, signal, struct, sys, time
d = sys.argv[1]
res = {}

def path(name):
    p = os.path.join(d, name)
    with open(p, "wb") as f:
        f.write(b"x" * 4096)
    return p

def getlk(fd):
    # struct flock: short type, short whence, off_t start, off_t len, pid_t pid
    lk = struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0)
    t, _, _, _, pid = struct.unpack("hhqqi", fcntl.fcntl(fd, fcntl.F_GETLK, lk))
    return t, pid

def in_child(fn):
    # runs fn in a forked child, returns what it wrote (one line)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = fn()
        except Exception as e:
            out = "error " + repr(e)
        os.write(w, (str(out) + "\n").encode())
        os._exit(0)
    os.close(w)
    out = os.read(r, 4096).decode().strip()
    os.close(r)
    os.waitpid(pid, 0)
    return out

def trylock(p):
    fd = os.open(p, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "locked"
    except OSError as e:
        return "busy" if e.errno in (errno.EAGAIN, errno.EACCES) else "error %d" % e.errno
    finally:
        os.close(fd)

# 1. F_GETLK from another process names the holder's pid.
p = path("getlk")
fd = os.open(p, os.O_RDWR)
fcntl.lockf(fd, fcntl.LOCK_EX)
def child_getlk():
    f = os.open(p, os.O_RDWR)
    t, pid = getlk(f)
    return "%d %d" % (t, pid)
res["getlk_names_holder"] = in_child(child_getlk) == "%d %d" % (fcntl.F_WRLCK, os.getpid())

# 2. A second descriptor in the same process does not conflict.
fd2 = os.open(p, os.O_RDWR)
try:
    fcntl.lockf(fd2, fcntl.LOCK_EX | fcntl.LOCK_NB)
    res["same_process_no_conflict"] = True
except OSError:
    res["same_process_no_conflict"] = False

# 3. Closing any descriptor of the file releases the process's locks.
os.close(fd2)
res["any_close_releases"] = in_child(lambda: trylock(p)) == "locked"
os.close(fd)

# 4. A child sharing an inherited descriptor is blocked by the parent's lock.
p = path("inherit")
fd = os.open(p, os.O_RDWR)
fcntl.lockf(fd, fcntl.LOCK_EX)
def child_inherited():
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "locked"
    except OSError:
        return "busy"
res["inherited_fd_child_blocked"] = in_child(child_inherited) == "busy"
os.close(fd)

# 5. flock belongs to the open file description.
p = path("flock")
a, b = os.open(p, os.O_RDWR), os.open(p, os.O_RDWR)
fcntl.flock(a, fcntl.LOCK_EX)
try:
    fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
    res["flock_per_open_file"] = False
except OSError:
    res["flock_per_open_file"] = True
os.close(a)
os.close(b)

# 6. No lock outlives its holder: a child's lock goes with its exit.
p = path("exit")
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    f = os.open(p, os.O_RDWR)
    fcntl.lockf(f, fcntl.LOCK_EX)
    os.write(w, b"x")
    os._exit(0)
os.read(r, 1)
os.waitpid(pid, 0)
res["lock_goes_with_exit"] = trylock(p) == "locked"

# 7. F_SETLKW is interruptible by a signal.
p = path("wait")
fd = os.open(p, os.O_RDWR)
fcntl.lockf(fd, fcntl.LOCK_EX)
class Interrupted(Exception):
    pass
def child_wait():
    # A handler that raises: Python retries a call whose handler returns.
    def alarm(*a):
        raise Interrupted()
    signal.signal(signal.SIGALRM, alarm)
    f = os.open(p, os.O_RDWR)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        fcntl.lockf(f, fcntl.LOCK_EX)
        return "locked"
    except Interrupted:
        return "eintr"
res["setlkw_interruptible"] = in_child(child_wait) == "eintr"
os.close(fd)

# 8. The first opener's lock goes with its close while another process
# keeps the file open (it survived that on passthrough once).
p = path("first")
r, w = os.pipe()
r2, w2 = os.pipe()
pid = os.fork()
if pid == 0:
    f = os.open(p, os.O_RDWR)
    os.write(w, b"x")
    os.read(r2, 1)  # keep it open until told
    os._exit(0)
os.read(r, 1)
fd = os.open(p, os.O_RDWR)
fcntl.lockf(fd, fcntl.LOCK_EX)
os.close(fd)
res["lock_goes_with_close_while_others_open"] = in_child(lambda: trylock(p)) == "locked"
os.write(w2, b"x")
os.waitpid(pid, 0)
print(json.dumps(res, sort_keys=True))
`

// TestLocksAsOnTmpfs runs the lock rules on a tmpfs directory and on the
// mount in both modes.
func TestLocksAsOnTmpfs(t *testing.T) {
	t.Parallel()
	ref, err := os.MkdirTemp("/dev/shm", "tensorfs-locks-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(ref) })
	want := lockRules(t, ref)
	for rule, ok := range want {
		if !ok {
			t.Errorf("on tmpfs the rule %s does not hold: the test is wrong", rule)
		}
	}
	forEachMode(t, func(t *testing.T, m *mount) {
		got := lockRules(t, m.dir)
		for rule, ok := range want {
			if got[rule] != ok {
				t.Errorf("%s: %v on the mount, %v on tmpfs", rule, got[rule], ok)
			}
		}
	})
}

func lockRules(t *testing.T, dir string) map[string]bool {
	t.Helper()
	out := python(t, lockRulesScript, dir)
	var res map[string]bool
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("lock script said %q: %v", out, err)
	}
	if len(res) != 8 {
		t.Fatalf("lock script checked %d rules, want 8: %v", len(res), res)
	}
	return res
}
