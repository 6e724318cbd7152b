package integration

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// walkChainScript makes, in argv[1], a chain of 250 directories with
// argv[2] FIFOs at its bottom, so that a walk of it holds 250 descriptors
// for as long as it lists them.
const walkChainScript = `
import os, sys
os.chdir(sys.argv[1])
for _ in range(250):
    os.mkdir("d")
    os.chdir("d")
for i in range(int(sys.argv[2])):
    os.mkfifo("%05d" % i, 0o600)
`

// walkFloodScript asks for argv[1]'s rbytes from argv[2] threads for
// argv[3] seconds, and prints how many answers and refusals it got.
const walkFloodScript = `
import os, sys, threading, time
end = time.time() + float(sys.argv[3])
got = {"ok": 0, "refused": 0}
def ask():
    while time.time() < end:
        try:
            os.getxattr(sys.argv[1], "user.tensorfs.rbytes")
            got["ok"] += 1
        except OSError:
            got["refused"] += 1
ts = [threading.Thread(target=ask) for _ in range(int(sys.argv[2]))]
for t in ts: t.start()
for t in ts: t.join()
print(got["ok"], got["refused"])
`

// walkVictimScript makes, writes, reads and removes a segment in argv[1]
// for argv[2] seconds, and prints each failure's errno once.
const walkVictimScript = `
import os, sys, time
end, failed = time.time() + float(sys.argv[2]), set()
while time.time() < end:
    p = os.path.join(sys.argv[1], "s")
    try:
        with open(p, "w") as f:
            f.write("mine")
        with open(p) as f:
            f.read()
        os.unlink(p)
    except OSError as e:
        failed.add(e.errno)
print(" ".join(str(e) for e in sorted(failed)))
`

// TestAttackWalkDescriptors: a walk of a directory tree (rbytes and
// rsegments, the root's stats, a publish or pull, a published
// directory's cluster attribute) holds a descriptor for each level it is
// in, up to 256, and charged none of them: uid A asking a chain's rbytes
// from 90 threads made the daemon hold 19570 descriptors of its 20000,
// and uid B's create failed with EMFILE. Each level is now charged to the
// asker in the descriptors row: A is refused past her share, and B's
// segments keep working.
func TestAttackWalkDescriptors(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		for uid, dir := range map[int]string{userA: "a", userB: "b"} {
			if err := os.Mkdir(m.path("shared/"+dir), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(m.path("shared/"+dir), uid, uid); err != nil {
				t.Fatal(err)
			}
		}
		if out, err := runAs(t, userA, "/", systemPython, "-c", walkChainScript, m.path("shared/a"), "2000"); err != nil {
			t.Fatalf("uid %d's chain: %v\n%s", userA, err, out)
		}
		share := descriptorShare(t, m.dir)
		_, limit := daemonFDs(t, m.pid)
		threads := min(limit/250+10, 200)
		const seconds = "2"
		flood := asUser(pyCommand(walkFloodScript, m.path("shared/a"), strconv.Itoa(threads), seconds), userA)
		var floodOut bytes.Buffer
		flood.Stdout, flood.Stderr = &floodOut, &floodOut
		base, _ := daemonFDs(t, m.pid)
		if err := flood.Start(); err != nil {
			t.Fatal(err)
		}
		victim := asUser(pyCommand(walkVictimScript, m.path("shared/b"), seconds), userB)
		var victimOut bytes.Buffer
		victim.Stdout, victim.Stderr = &victimOut, &victimOut
		if err := victim.Start(); err != nil {
			t.Fatal(err)
		}
		var floodErr error
		done := make(chan struct{})
		go func() { floodErr = flood.Wait(); close(done) }()
		peak := fdPeakUntil(t, m.pid, base, done)
		if floodErr != nil {
			t.Fatalf("uid %d's walks: %v\n%s", userA, floodErr, floodOut.String())
		}
		if err := victim.Wait(); err != nil {
			t.Fatalf("uid %d: %v\n%s", userB, err, victimOut.String())
		}
		t.Logf("uid %d's %d threads asking rbytes (answered, refused: %s): the daemon held %d descriptors at most, %d before (share %d, limit %d)",
			userA, threads, strings.TrimSpace(floodOut.String()), peak, base, share, limit)
		if peak-base > share+threads+64 {
			t.Errorf("uid %d's walks made the daemon hold %d more descriptors, past her share of %d", userA, peak-base, share)
		}
		if failed := strings.TrimSpace(victimOut.String()); failed != "" {
			t.Errorf("uid %d's segments failed meanwhile, errno %s", userB, failed)
		}
	})
}

// descriptorShare returns one user's share of the descriptors row of the
// mount at dir.
func descriptorShare(t *testing.T, dir string) int {
	t.Helper()
	return int(ledgerRowOf(t, dir, "descriptors").PerUID)
}

// TestAttackWalkMemory: a walk read each directory's names whole before
// it looked at them, and held them while it walked below, so rbytes of a
// directory of 60000 long names, asked from 40 threads, made the daemon
// hold 1.1 GB; nothing bounds how many requests ask at once. A walk now
// reads a directory's names a batch at a time, and each level it holds is
// one of the asker's descriptors: the daemon's memory stays put. Its
// daemon collects at its own GC target (daemonOwnGC).
func TestAttackWalkMemory(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMountEnv(t, mode, true, daemonOwnGC)
		// Made in the backing directly, as fast as the kernel goes: the
		// daemon counts what it finds there when it walks.
		wide := filepath.Join(backingOf(t, m), "shared", "wide")
		if err := os.Mkdir(wide, 0o755); err != nil {
			t.Fatal(err)
		}
		long := strings.Repeat("x", 245)
		for i := range 20000 {
			if err := unix.Mkfifo(filepath.Join(wide, fmt.Sprintf("%05d%s", i, long)), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		before := dtDaemonHWM(t, m.pid)
		out, err := runAs(t, userA, "/", systemPython, "-c", walkFloodScript, m.path("shared/wide"), "32", "1")
		if err != nil {
			t.Fatalf("uid %d's walks: %v\n%s", userA, err, out)
		}
		after := dtDaemonHWM(t, m.pid)
		t.Logf("uid %d's 32 threads asking rbytes of 20000 long names (answered, refused: %s): the daemon's peak memory went from %d to %d MiB",
			userA, strings.TrimSpace(out), before>>20, after>>20)
		if after-before > 128<<20 { // a race-built daemon's shadow memory included
			t.Errorf("uid %d's walks of one wide directory grew the daemon's peak memory by %d MiB", userA, (after-before)>>20)
		}
	})
}
