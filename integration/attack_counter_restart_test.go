package integration

import (
	"fmt"
	"strings"
	"testing"
)

// acrFillScript, as user A: makes a GPU segment in argv[1], asks for its
// consumer counter, keeps the counter file open for writing and removes
// the segment (the daemon retires the counter file while she holds it:
// gpu.CounterDir's retired list); and keeps open the counter of a
// segment without device memory (size 0), which a successor adopts not
// (no block names it) and removes. "ready" then; on "fill" (sent after a
// takeover) it reserves the counters' tmpfs through the descriptor it
// kept, 1 MiB then a page at a time, until ENOSPC, and prints "filled N" (MiB).
const acrFillScript = `
import os, sys
p = os.path.join(sys.argv[1], "s")
os.close(os.open(p, os.O_CREAT | os.O_RDWR, 0o600))
v = os.getxattr(p, "user.tensorfs.cuda.ref_counter").decode()
fd = os.open(v.rsplit(":", 1)[0], os.O_RDWR)
os.unlink(p)
q = os.path.join(sys.argv[1], "empty")
os.close(os.open(q, os.O_CREAT | os.O_RDWR, 0o600))
v = os.getxattr(q, "user.tensorfs.cuda.ref_counter").decode()
kept = os.open(v.rsplit(":", 1)[0], os.O_RDWR)
print("ready", flush=True)
for line in sys.stdin:
    off = 8
    for chunk in (1 << 20, 4096):
        try:
            while off < (256 << 20):
                os.posix_fallocate(fd, off, chunk)
                off += chunk
        except OSError:
            pass
    print("filled", off >> 20, flush=True)
`

// TestAttackCounterRestartRetired (ledger row "GPU consumer counters",
// counters' tmpfs): a removed segment's counter file that a consumer
// still holds open is retired by the daemon, which puts back what the
// consumer reserves through it whenever the counters' tmpfs fills (trim).
// A successor does not know its predecessor's retired counter files (they
// are unlinked; only the predecessor held a descriptor): after a
// tensorfs restart (and a crash) user A fills the counters' tmpfs through the counter
// she kept, nobody puts it back, and user B's segment can no longer get a
// consumer counter. Held across restarts, and charged to nobody: so is
// the counter of her segment of no bytes, which the successor removed
// while she held it. Both must stay charged to her until she lets go.
func TestAttackCounterRestartRetired(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		gtSetDevice(t, m.path("a"), "cuda:0")
		a := startPythonAs(t, userA, "user A's retired counter", acrFillScript, m.path("a"))
		a.expect(t, "ready")
		if held := ledgerHeld(t, m, "GPU consumer counters", userA); held != 2 {
			t.Fatalf("uid %d holds %d counters before the restart, want 2", userA, held)
		}
		for i, handover := range []func(){func() { m.restart(t, "") }, func() { rgCrash(t, m) }} {
			handover()
			if held := ledgerHeld(t, m, "GPU consumer counters", userA); held != 2 {
				t.Errorf("uid %d holds %d counters after %s, want the 2 she still holds", userA, held, []string{"tensorfs restart", "the daemon's SIGKILL"}[i])
			}
		}
		got := a.do(t, "fill")
		if !strings.HasPrefix(got, "filled ") {
			t.Fatalf("user A's fill: %q", got)
		}
		t.Logf("%s: user A %s", m.mode, got)
		seg := gtDeviceSegment(t, m.path("b/w"))
		run(t, "chown", "1001:1001", seg)
		if out, err := runAs(t, userB, "/", "getfattr", "--only-values", "-n", gtRefCounter, seg); err != nil || !strings.HasSuffix(out, ":0") {
			t.Errorf("uid %d's counter after uid %d filled the counters' tmpfs through a counter retired before the restart: %q, %v", userB, userA, out, err)
		}
		a.stdin.Close()
		eventually(t, "uid 1000's counters given back", func() (bool, string) {
			held := ledgerHeld(t, m, "GPU consumer counters", userA)
			return held == 0, fmt.Sprint(held, " held")
		})
	}, "--gpu", "sim", "--allow-other")
}
