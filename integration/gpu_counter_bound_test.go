package integration

import (
	"os"
	"strconv"
	"strings"
	"testing"
)

// counterFillScript makes GPU segments in the directory argv[1] (which
// gives them cuda:0), asks each for its consumer counter, keeps the
// counter file open and removes the segment, until the counter is
// refused; it prints "refused ERRNO N" (N counters held) and holds them
// until stdin closes.
const counterFillScript = `
import os, resource, sys
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held = []
while len(held) < 100000:
    p = os.path.join(sys.argv[1], "s%d" % len(held))
    os.close(os.open(p, os.O_CREAT | os.O_RDWR, 0o600))
    try:
        v = os.getxattr(p, "user.tensorfs.cuda.ref_counter").decode()
    except OSError as e:
        print("refused", e.errno, len(held), flush=True)
        break
    held.append(os.open(v.rsplit(":", 1)[0], os.O_RDWR))
    os.unlink(p)
sys.stdin.read()
`

// TestGPUCounterBound (ledger row "GPU consumer counters"): a user who
// keeps the counter file of each of her GPU segments open and removes the
// segment (so that no descriptor of the daemon's stays charged to her)
// stops at her bound of counters, 4096, with EMFILE; another user's
// segment and root's get their counters meanwhile, and hers are given
// back once she lets them go. One mode: counters are attributes and
// files of the daemon's own tmpfs, the same in both.
func TestGPUCounterBound(t *testing.T) {
	t.Parallel()
	m := mountFS(t, "passthrough", append(gtSim, "--allow-other")...)
	userDirs(t, m)
	gtSetDevice(t, m.path("a"), "cuda:0")
	a := startPythonAs(t, userA, "counter filler", counterFillScript, m.path("a"))
	if got := a.expect(t, "refused"); got != "24 4096" {
		t.Fatalf("uid %d's counters: refused %q, want EMFILE (24) after 4096", userA, got)
	}
	if held := ledgerHeld(t, m, "GPU consumer counters", userA); held != 4096 {
		t.Errorf("uid %d holds %d counters in the ledger, want 4096", userA, held)
	}
	seg := gtDeviceSegment(t, m.path("b/w"))
	if err := os.Chown(seg, userB, userB); err != nil {
		t.Fatal(err)
	}
	if out, err := runAs(t, userB, "/", "getfattr", "--only-values", "-n", gtRefCounter, seg); err != nil || !strings.HasSuffix(out, ":0") {
		t.Errorf("uid %d's counter while uid %d holds hers: %q, %v", userB, userA, out, err)
	}
	agCounter(t, gtDeviceSegment(t, m.path("rootgpu")))
	a.stdin.Close()
	eventually(t, "uid "+strconv.Itoa(userA)+"'s counters given back", func() (bool, string) {
		held := ledgerHeld(t, m, "GPU consumer counters", userA)
		return held == 0, strconv.FormatInt(held, 10) + " held"
	})
}
