package integration

// Findings of the fresh attack on the round-two build that the mount
// itself answers (A9, A10, A12), each as an unprivileged user in both
// modes.

import (
	"encoding/json"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestAttackFlagsByWriter (A10): a user who may write another user's 0666
// segment in the sticky shared directory may not set or remove its flags:
// UNLINK would have the daemon remove, as root, a name the user may not.
func TestAttackFlagsByWriter(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		victim := m.path("shared/vict")
		if out, err := runAs(t, userB, "/", "sh", "-c", "touch "+victim+" && chmod 666 "+victim); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		script := "setfattr -n user.tensorfs.flags -v UNLINK " + victim + "; echo $?; " +
			"setfattr -x user.tensorfs.flags " + victim + "; echo $?; " +
			"cat " + victim + "; rm -f " + victim + "; echo $?"
		out, _ := runAs(t, userA, "/", "sh", "-c", script)
		if codes := strings.Fields(out); len(codes) < 3 || codes[0] == "0" || codes[1] == "0" {
			t.Errorf("uid %d set or removed the flags of uid %d's segment: %q (want both refused)", userA, userB, out)
		}
		fi, err := os.Stat(victim)
		if err != nil {
			t.Fatalf("the victim's segment is gone: %v", err)
		}
		if st := fi.Sys().(*syscall.Stat_t); st.Uid != userB {
			t.Errorf("%s is uid %d's now, want uid %d's", victim, st.Uid, userB)
		}
		if v, _ := getxattr(victim, "user.tensorfs.flags"); strings.Contains(string(v), "UNLINK") {
			t.Errorf("the victim's flags: %q", v)
		}
		// Its owner still may.
		if out, err := runAs(t, userB, "/", "setfattr", "-n", "user.tensorfs.flags", "-v", "UNLINK", victim); err != nil {
			t.Errorf("the owner sets UNLINK on its own segment: %v\n%s", err, out)
		}
	})
}

// TestAttackRenameWithinNoCreate (A12): a NOCREATE directory's names are
// sealed: a rename within it neither makes a new name nor replaces one.
func TestAttackRenameWithinNoCreate(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		nc := m.path("shared/nc")
		if out, err := runAs(t, userA, "/", "sh", "-c", "mkdir "+nc+" && printf x > "+nc+"/x && printf y > "+nc+"/y && setfattr -n user.tensorfs.flags -v NOCREATE "+nc); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		for _, to := range []string{"new-name", "y"} {
			if out, err := runAs(t, userA, "/", "mv", "-T", nc+"/x", nc+"/"+to); err == nil || !strings.Contains(out, "not permitted") {
				t.Errorf("mv x %s within a NOCREATE directory: %v %q, want EPERM", to, err, out)
			}
		}
		for name, want := range map[string]string{"x": "x", "y": "y"} {
			if b, err := os.ReadFile(nc + "/" + name); err != nil || string(b) != want {
				t.Errorf("%s reads %q (%v), want %q", name, b, err, want)
			}
		}
		if _, err := os.Stat(nc + "/new-name"); err == nil {
			t.Errorf("a new name appeared in the NOCREATE directory")
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
