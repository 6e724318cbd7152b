package integration

import (
	"os"
	"strings"
	"testing"
)

// deepFillScript goes 300 directories down argv[1] (past alloc.MaxDepth)
// and makes segments there until a refusal; it prints how many and the
// errno's name.
const deepFillScript = `
import errno, os, sys
os.chdir(sys.argv[1])
for _ in range(300):
    os.makedirs("d", exist_ok=True)
    os.chdir("d")
made = 0
try:
    while made < 100000:
        os.close(os.open("f%d-%d" % (os.getpid(), made), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        made += 1
    print(made, "none")
except OSError as e:
    print(made, errno.errorcode[e.errno])
`

// TestAttackDeepRecount: a mount charges each user the objects it finds
// in the backing (inodes.countBacking), at any depth (alloc.Tree): what a
// user made below a chain deeper than alloc.MaxDepth is hers after the
// daemon starts again (a restart, a crash, an upgrade). Uid 65534 makes a
// chain 300 deep and fills her share of inodes below it; the remounted
// daemon charges her as much, and she can make nothing more. (Walk, which
// stops at 256 levels, charged her the chain's first 256, and she made her
// share again at every restart.)
func TestAttackDeepRecount(t *testing.T) {
	const nobody = 65534
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := mountFS(t, mode, "--allow-other", "--inodes", "16384")
		reachable(t, m.dir)
		if err := os.Mkdir(m.path("n"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(m.path("n"), nobody, nobody); err != nil {
			t.Fatal(err)
		}
		fill := func() string {
			return strings.TrimSpace(pythonAs(t, nobody, "/", deepFillScript, m.path("n")))
		}
		first := fill()
		if !strings.HasSuffix(first, " EDQUOT") {
			t.Fatalf("uid %d below a chain 300 deep: made %s, want a refusal (EDQUOT) at her share", nobody, first)
		}
		held := ledgerHeld(t, m, "inodes", nobody)
		m.unmount(t, false)
		m = m.remount(t)
		if got := ledgerHeld(t, m, "inodes", nobody); got != held {
			t.Errorf("uid %d held %d inodes (made %s below a chain 300 deep); the remounted daemon charges her %d",
				nobody, held, first, got)
		}
		if again := fill(); again != "0 EDQUOT" {
			t.Errorf("uid %d at her share before the remount made %s after it, want 0 EDQUOT", nobody, again)
		}
	})
}
