package integration

// Attacks on SHARED segments' disk files: what recovery puts at a user's
// path is that user's own segment, whatever renames raced its creates.

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// sharedPlantScript plants, as its user, SHARED segments whose disk files
// record the path argv[1]/alice/model while they live elsewhere: each
// attempt creates alice/model while a child renames the directory alice
// away; a create whose marker gets its disk id after the rename walked
// the directory (recordSharedPath) keeps the path it computed before.
const sharedPlantScript = `
import os, sys
base, n = sys.argv[1], int(sys.argv[2])
r1, w1 = os.pipe()
pid = os.fork()
if pid == 0:
    for i in range(n):
        if os.read(r1, 1) != b"g":
            break
        try:
            os.rename(base + "/alice", "%s/h%d" % (base, i))
        except OSError:
            pass
    os._exit(0)
for i in range(n):
    try:
        os.mkdir(base + "/alice")
    except FileExistsError:
        pass
    os.write(w1, b"g")
    try:
        fd = os.open(base + "/alice/model", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
        os.write(fd, b"attacker")
        os.close(fd)
    except OSError:
        pass
    for _ in range(1000):
        if os.path.isdir("%s/h%d" % (base, i)):
            break
    try:
        os.rename(base + "/alice", "%s/late%d" % (base, i))
    except OSError:
        pass
os.write(w1, b"s")
os.waitpid(pid, 0)
print("done")
`

// TestAttackSharedRecordedPath (G3): a SHARED segment's disk file records
// the path its create computed (d.Path when the create began), and a
// rename of its directory that walks the directory before the new marker
// carries its disk id does not correct it. uid 1000 races its own creates
// against renames of its own directory "alice" in a 1777 SHARED directory
// and leaves disk files that all record persist/alice/model but live
// elsewhere. uid 1001 then keeps its checkpoint at persist/alice/model.
// After unmount --purge (or a reboot: what SHARED is for), recovery from
// the disk puts the first disk file in id order at the recorded path and
// the others beside it: uid 1001's path then holds uid 1000's bytes. What
// recovery puts at a user's path must be that user's own segment.
func TestAttackSharedRecordedPath(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		disk := filepath.Join(t.TempDir(), "disk")
		if err := os.Mkdir(disk, 0o700); err != nil {
			t.Fatal(err)
		}
		m := mountFS(t, mode, "--allow-other", "--disk", disk)
		reachable(t, m.dir)
		persist := m.path("persist")
		if err := os.Mkdir(persist, 0o1777); err != nil {
			t.Fatal(err)
		}
		if err := unix.Chmod(persist, 0o1777); err != nil {
			t.Fatal(err)
		}
		if err := unix.Setxattr(persist, "user.tensorfs.flags", []byte("SHARED"), 0); err != nil {
			t.Fatal(err)
		}
		pythonAs(t, userA, "/", sharedPlantScript, persist, "300")
		planted := 0
		ents, _ := os.ReadDir(disk)
		for _, e := range ents {
			v := make([]byte, 4096)
			if n, err := unix.Getxattr(filepath.Join(disk, e.Name()), "trusted.tensorfs.path", v); err == nil && string(v[:n]) == "persist/alice/model" {
				planted++
			}
		}
		t.Logf("uid %d left %d disk files that record persist/alice/model", userA, planted)
		if _, err := os.Stat(filepath.Join(persist, "alice")); !os.IsNotExist(err) {
			t.Fatalf("persist/alice after the attacker: %v, want it absent", err)
		}
		if out, err := runAs(t, userB, "/", "sh", "-c", "mkdir "+persist+"/alice && echo victim > "+persist+"/alice/model"); err != nil {
			t.Fatalf("uid %d's checkpoint: %v\n%s", userB, err, out)
		}
		m.unmount(t, true)
		m2 := m.remount(t)
		p := m2.path("persist/alice/model")
		b, err := os.ReadFile(p)
		var st unix.Stat_t
		unix.Stat(p, &st)
		if err != nil || string(b) != "victim\n" || st.Uid != userB {
			t.Errorf("after unmount --purge and mount, uid %d's persist/alice/model holds %q (owner %d, %v); want its own %q", userB, b, st.Uid, err, "victim\n")
		}
	})
}
