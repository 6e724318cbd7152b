package integration

// Attacks through directories, each run as an unprivileged user in both
// modes: floods of lookups and of open directories hold no unbounded
// daemon descriptors, walks deeper than the bound are refused, and subtree
// counts show nothing of a directory the asker may not list.

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestAttackDirectoryFlood (F2): a user who makes the daemon look up
// thousands of directories cannot make it hold a descriptor for each: the
// daemon's descriptors stay bounded, and root's cat, create and ls on the
// mount keep working.
func TestAttackDirectoryFlood(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		os.WriteFile(m.path("plain"), []byte("still here"), 0o644)
		out, err := runAs(t, userA, "/", systemPython, "-c", `
import os, sys
d = sys.argv[1] + "/flood"
os.mkdir(d)
for i in range(3000):
    p = "%s/%d" % (d, i)
    os.mkdir(p)
    try:
        os.stat(p + "/x")
    except FileNotFoundError:
        pass
print("done")`, m.path("shared"))
		if err != nil {
			t.Fatalf("flood: %v\n%s", err, out)
		}
		fds, _ := daemonFDs(t, m.pid)
		t.Logf("the daemon holds %d descriptors", fds)
		if fds > 1024+256 {
			t.Errorf("after 3000 directories the daemon holds %d descriptors; the directory cache bounds them to 1024 idle", fds)
		}
		if b, err := os.ReadFile(m.path("plain")); err != nil || string(b) != "still here" {
			t.Errorf("root's cat after the flood: %q, %v", b, err)
		}
		if err := os.WriteFile(m.path("new"), []byte("x"), 0o644); err != nil {
			t.Errorf("root's create after the flood: %v", err)
		}
		if _, err := os.ReadDir(m.path("shared/flood")); err != nil {
			t.Errorf("root's ls after the flood: %v", err)
		}
	})
}

// TestAttackSubtreeUsage (F8): rbytes and rsegments of a directory count
// nothing of a subdirectory the asker may not list.
func TestAttackSubtreeUsage(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		private := m.path("shared/private")
		os.Mkdir(private, 0o700)
		if err := os.WriteFile(private+"/w", make([]byte, 1<<20), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(m.path("shared/open"), make([]byte, 1000), 0o644); err != nil {
			t.Fatal(err)
		}
		get := func(uid int, attr string) string {
			out, err := runAs(t, uid, "/", "getfattr", "--absolute-names", "--only-values", "-n", attr, m.path("shared"))
			if err != nil {
				t.Fatalf("getfattr %s as %d: %v\n%s", attr, uid, err, out)
			}
			return out
		}
		if b, s := get(0, "user.tensorfs.rbytes"), get(0, "user.tensorfs.rsegments"); b != strconv.Itoa(1<<20+1000) || s != "2" {
			t.Errorf("root: rbytes %s, rsegments %s; want %d and 2", b, s, 1<<20+1000)
		}
		if b, s := get(userA, "user.tensorfs.rbytes"), get(userA, "user.tensorfs.rsegments"); b != "1000" || s != "1" {
			t.Errorf("uid %d: rbytes %s, rsegments %s; want 1000 and 1 (nothing of root's 0700 directory)", userA, b, s)
		}
	})
}

// dirFloodScript opens the directory argv[1] (OPENDIR) again and again
// until the first error or its own limit, prints how far it got, and holds
// the descriptors until its stdin closes.
const dirFloodScript = `
import os, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
fds = []
try:
    while len(fds) < hard - 64:
        fds.append(os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY))
    print("held", len(fds), flush=True)
except OSError as e:
    print("errno", e.errno, "after", len(fds), flush=True)
sys.stdin.read()
`

// TestAttackOpendirFlood (G1): every open directory is a descriptor the
// daemon holds (OpendirHandle) and no per-uid bound counts them, unlike
// open segments (TestAttackOpenFlood). A user who opens one directory
// again and again, from as many processes as it takes, fills the daemon's
// descriptor table: root's and other users' creates then fail with EMFILE
// and the control socket stops accepting. Per-uid bounds must hold for
// directory handles too: root and other users keep working.
func TestAttackOpendirFlood(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		_, limit := daemonFDs(t, m.pid)
		var floods []*exec.Cmd
		t.Cleanup(func() {
			for _, f := range floods {
				f.Process.Kill()
				f.Wait()
			}
		})
		var stdins []io.Closer
		held := 0
		// As many processes as the daemon's limit takes (each process
		// stops at its own hard limit, or at the daemon's refusal).
		for i := 0; i < 8 && held < limit; i++ {
			flood := asUser(pyCommand(dirFloodScript, m.path("shared")), userA)
			stdin, _ := flood.StdinPipe()
			stdout, _ := flood.StdoutPipe()
			if err := flood.Start(); err != nil {
				t.Fatal(err)
			}
			floods = append(floods, flood)
			stdins = append(stdins, stdin)
			line, _ := bufio.NewReader(stdout).ReadString('\n')
			t.Logf("flood %d: %s", i, strings.TrimSpace(line))
			var n int
			if _, err := fmt.Sscanf(line, "held %d", &n); err != nil {
				var errno int
				if _, err := fmt.Sscanf(line, "errno %d after %d", &errno, &n); err != nil {
					t.Fatalf("flood %d: %q", i, line)
				}
				held += n
				break // the daemon (or the process) said no
			}
			held += n
		}
		fds, _ := daemonFDs(t, m.pid)
		t.Logf("uid %d holds %d directory handles; the daemon holds %d descriptors of %d", userA, held, fds, limit)
		if err := os.WriteFile(m.path("rootfile"), []byte("root"), 0o644); err != nil {
			t.Errorf("root's create during uid %d's directory flood: %v", userA, err)
		}
		if out, err := runAs(t, userB, "/", "sh", "-c", "echo b > "+m.path("shared/bfile")+" && cat "+m.path("shared/bfile")); err != nil || out != "b\n" {
			t.Errorf("uid %d's create during uid %d's directory flood: %q, %v", userB, userA, out, err)
		}
		if _, err := os.ReadDir(m.path("shared")); err != nil {
			t.Errorf("root's ls during uid %d's directory flood: %v", userA, err)
		}
		for _, s := range stdins {
			s.Close()
		}
	})
}

// loadScript (argv: socket, path) asks load and prints the reply's ok and
// errno.
const loadScript = `
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.send(json.dumps({"v": 1, "op": "load", "path": sys.argv[2]}).encode())
msg, _, _, _ = s.recvmsg(1 << 20, 4096)
r = json.loads(msg)
print(json.dumps({"ok": r.get("ok", False), "errno": r.get("errno", 0)}))
`

// TestAttackDeepChain (A9): a chain of directories deeper than the walk
// bound (256) makes neither a load nor rbytes hold a descriptor per
// level: both are refused ELOOP, never a wrong count, and leave the
// daemon's descriptors as they were.
func TestAttackDeepChain(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		chain := m.path("shared/chain")
		if out, err := runAs(t, userA, "/", systemPython, "-c",
			"import os, sys; os.makedirs(sys.argv[1] + '/d' * 300); open(sys.argv[1] + '/d' * 300 + '/w', 'w').write('deep')", chain); err != nil {
			t.Fatalf("making the chain: %v\n%s", err, out)
		}
		before, _ := daemonFDs(t, m.pid) // the chain's directories are in the lookup cache
		out, err := runAs(t, userA, "/", "getfattr", "--absolute-names", "--only-values", "-n", "user.tensorfs.rbytes", chain)
		if err == nil || !strings.Contains(out, "Too many levels") {
			t.Errorf("rbytes of a 300-deep chain: %v %q, want ELOOP", err, out)
		}
		var got struct {
			OK    bool
			Errno int
		}
		out = pythonAs(t, userA, "/", loadScript, controlSocket(t, m), "shared/chain")
		if err := json.Unmarshal([]byte(out), &got); err != nil || got.OK || got.Errno != int(syscall.ELOOP) {
			t.Errorf("load of a 300-deep chain: %q, want errno %d (ELOOP)", out, syscall.ELOOP)
		}
		if fds, _ := daemonFDs(t, m.pid); fds > before+16 {
			t.Errorf("the daemon holds %d descriptors after the chain's walks, %d before", fds, before)
		}
		if _, err := os.ReadFile(chain + strings.Repeat("/d", 300) + "/w"); err != nil {
			t.Errorf("the deep segment itself: %v", err)
		}
		if out, err := runAs(t, userA, "/", "getfattr", "--absolute-names", "--only-values", "-n", "user.tensorfs.rbytes", chain+strings.Repeat("/d", 100)); err != nil || out != strconv.Itoa(len("deep")) {
			t.Errorf("rbytes 200 levels above the segment: %v %q, want 4", err, out)
		}
	})
}
