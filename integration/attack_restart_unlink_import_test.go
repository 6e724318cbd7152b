package integration

import (
	"fmt"
	"os"
	"strings"
	"testing"
)

// unlinkImportScript imports a memfd it maps (named argv[3]) over the
// control socket argv[1] at argv[2], in a directory whose segments are
// UNLINK; reads it once through the mount at argv[4], so that its last
// close leaves the daemon waiting for the last mapping; says "ready", and
// exits (unmapping it) on any line.
const unlinkImportScript = `
import array, json, mmap, os, socket, sys
sock, dest, name, seg = sys.argv[1:5]
fd = os.memfd_create(name)
os.write(fd, b"x" * 4096)
m = mmap.mmap(fd, 4096)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sock)
s.sendmsg([json.dumps({"v": 1, "op": "import", "path": dest}).encode()],
          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
print(s.recv(65536).decode().replace(" ", ""))
with open(seg, "rb") as f:
    f.read(1)
print("ready")
sys.stdin.readline()
`

// TestAttackRestartUnlinkImport: uid userA imports a memfd she maps into
// a directory of UNLINK segments and reads it once (the daemon then waits
// for her last mapping); the mount is restarted (and, below, crashed);
// then her process exits. An UNLINK segment goes with its last holder:
// the successor must remove it and give back its descriptor, not keep
// her memory, her descriptor and an inode for as long as it serves.
func TestAttackRestartUnlinkImport(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		reachable(t, m.dir)
		sock := controlSocket(t, m)
		for _, how := range []string{"restart", "crash"} {
			dir := "unlink-" + how
			if err := os.Mkdir(m.path(dir), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(m.path(dir), userA, userA); err != nil {
				t.Fatal(err)
			}
			if out, err := runAs(t, userA, "/", "setfattr", "-n", xaFlags, "-v", "UNLINK", m.path(dir)); err != nil {
				t.Fatalf("uid %d sets UNLINK on %s: %v\n%s", userA, dir, err, out)
			}
			name := "tensorfs-unlink-import-" + how
			c := startPythonAs(t, userA, "importer", unlinkImportScript, sock, dir+"/seg", name, m.path(dir+"/seg"))
			if reply := c.next(t); !strings.Contains(reply, `"ok":true`) {
				t.Fatalf("uid %d's import: %s", userA, reply)
			}
			c.expect(t, "ready")
			if _, err := os.Lstat(m.path(dir + "/seg")); err != nil {
				t.Fatalf("the import its sender maps is gone before the %s: %v", how, err)
			}
			if how == "restart" {
				m.restart(t, "")
			} else {
				m.crash(t)
			}
			c.send(t, "exit")
			c.wait(t)
			waitUnlinkImportGone(t, m, "after a "+how, dir+"/seg", name)
		}
	}, "--allow-other")
}

// waitUnlinkImportGone waits until userA's UNLINK import at rel (a memfd
// named name), whose sender has exited, is gone: its name, her charge,
// the daemon's descriptor and the keeper's (which it lets go when the
// daemon's journal says the import is removed, after the daemon's own).
func waitUnlinkImportGone(t *testing.T, m *mount, when, rel, name string) {
	t.Helper()
	eventually(t, "the UNLINK import goes with its sender's last mapping "+when, func() (bool, string) {
		_, err := os.Lstat(m.path(rel))
		held := ledgerHeld(t, m, "descriptors", userA)
		fds := procMemfds(t, m.daemonPid(t), name)
		kept := keeperMemfds(t, m, name)
		return err != nil && held == 0 && len(fds) == 0 && len(kept) == 0,
			fmt.Sprintf("lstat: %v; uid %d charged %d descriptors; the daemon holds %v, the keeper %v", err, userA, held, fds, kept)
	})
}
