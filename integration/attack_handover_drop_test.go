package integration

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestAttackHandoverDropImport: uid userA imports a memfd she maps into a
// directory of UNLINK segments and reads it once (the daemon waits for her
// last mapping). While a restart hands the mount over (the mount's
// requests wait: she sees a lookup hang), her process exits: the old
// daemon's watch removes the import after it listed the imports for its
// successor, which then adopted a descriptor with no name. It must not
// keep her memory and her descriptor for as long as it serves.
func TestAttackHandoverDropImport(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		reachable(t, m.dir)
		sock := controlSocket(t, m)
		dir := "unlink-handover"
		if err := os.Mkdir(m.path("nodes"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Mkdir(m.path(dir), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(m.path(dir), userA, userA); err != nil {
			t.Fatal(err)
		}
		if out, err := runAs(t, userA, "/", "setfattr", "-n", xaFlags, "-v", "UNLINK", m.path(dir)); err != nil {
			t.Fatalf("uid %d sets UNLINK on %s: %v\n%s", userA, dir, err, out)
		}
		name := "tensorfs-handover-drop"
		c := startPythonAs(t, userA, "importer", unlinkImportScript, sock, dir+"/seg", name, m.path(dir+"/seg"))
		if reply := c.next(t); !strings.Contains(reply, `"ok":true`) {
			t.Fatalf("uid %d's import: %s", userA, reply)
		}
		c.expect(t, "ready")
		// Nodes the kernel holds, which the successor looks up one by one
		// before it serves: the handover lasts long enough to be seen.
		python(t, "import os, sys\nfor i in range(4000): os.mknod(os.path.join(sys.argv[1], str(i)))", m.path("nodes"))
		restarted := make(chan error, 1)
		go func() {
			out, err := exec.Command(tensorfs, "restart", m.dir).CombinedOutput()
			if err != nil {
				err = fmt.Errorf("%v: %s", err, out)
			}
			restarted <- err
		}()
		// Her process exits once a lookup waits, or once the restart
		// ended if none was seen to: the import must go either way.
		var restartErr error
		frozen, ended := false, false
		for i := 0; !frozen && !ended; i++ {
			looked := make(chan struct{})
			go func() {
				os.Lstat(m.path(fmt.Sprintf("probe-%d", i)))
				close(looked)
			}()
			select {
			case <-looked:
			case <-time.After(30 * time.Millisecond):
				frozen = true
			}
			select {
			case restartErr = <-restarted:
				ended = true
				t.Log("the restart ended before a lookup was seen to wait")
			default:
			}
		}
		c.send(t, "exit")
		c.wait(t)
		if !ended {
			restartErr = <-restarted
		}
		if restartErr != nil {
			t.Fatalf("tensorfs restart: %v", restartErr)
		}
		waitUnlinkImportGone(t, m, "after the handover", dir+"/seg", name)
	}, "--allow-other")
}
