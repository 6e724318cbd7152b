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

// TestAttackDeepRecount: a mount charges each user the objects it finds in
// the backing (inodes.countBacking), through alloc.Walk, which stops at
// 256 levels: what a user made deeper is charged to no one once the
// daemon starts again (a restart, a crash, an upgrade). uid A makes a
// chain 300 deep and fills its share of inodes below it; after a remount
// the ledger charges it the chain's first 256 levels, and it makes its
// share again, and again at every restart.
//
// Skipped unless TENSORFS_UNFIXED=1: the count needs a walk that reaches
// every level holding one descriptor at a time (as alloc.RemoveTree
// does), which recovery and the takeover's walk would share.
func TestAttackDeepRecount(t *testing.T) {
	if os.Getenv("TENSORFS_UNFIXED") != "1" {
		t.Skip("known, unfixed: set TENSORFS_UNFIXED=1 (see the comment)")
	}
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := mountFS(t, mode, "--allow-other", "--inodes", "16384")
		userDirs(t, m)
		fill := func() string {
			return strings.TrimSpace(pythonAs(t, userA, "/", deepFillScript, m.path("a")))
		}
		first := fill()
		held := ledgerHeld(t, m, "inodes", userA)
		m.unmount(t, false)
		m = m.remount(t)
		if got := ledgerHeld(t, m, "inodes", userA); got != held {
			again := fill()
			t.Errorf("uid %d held %d inodes (made %s below a chain 300 deep); the remounted daemon charges it %d, and it made %s more",
				userA, held, first, got, again)
		}
	})
}
