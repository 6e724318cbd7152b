package integration

import (
	"io"
	"strconv"
	"strings"
	"testing"
)

// closerThreads is a user's share of the daemon's threads that may block
// in the kernel (fs.newThreadBudget: 2048, a sixteenth each).
const closerThreads = 128

// TestAttackCloserThreads (ledger row "threads that may block in the
// kernel"): user A sends a file of a FUSE filesystem she serves, whose
// FLUSH never answers, with an all_gather on each of more connections
// than her share of threads; the daemon refuses each (not memory to map)
// and closes it, and each close blocks. Her closes take her share of the
// threads row and no more (the rest wait in her queue); user B's and
// root's collectives and their files on the mount are served meanwhile,
// and once A answers, every thread is given back.
func TestAttackCloserThreads(t *testing.T) {
	t.Parallel()
	m := mountFS(t, "passthrough", "--allow-other")
	userDirs(t, m)
	sock := controlSocket(t, m)
	a := startBlockFlush(t, sock, "all_gather", closerThreads+12)
	if line := a.next(t, "mounting"); line != "mounted" {
		t.Fatalf("the attacker: %q\n%s", line, a.out.String())
	}
	a.until(t, "sent", "sending", func(string) {})
	go func() {
		for range a.lines { // a.out keeps them
		}
	}()
	const row = "threads that may block in the kernel"
	eventually(t, "uid "+strconv.Itoa(userA)+"'s closes take her share of threads", func() (bool, string) {
		held := ledgerHeld(t, m, row, userA)
		return held == closerThreads, strconv.FormatInt(held, 10) + " held"
	})
	if n := strings.Count(a.out.String(), "flush "); n > closerThreads {
		t.Errorf("%d of uid %d's closes wait on her FLUSH at once, past her share of %d threads", n, userA, closerThreads)
	}
	solo := map[string]any{"op": "all_gather", "group": "solo", "rank": 0, "world": 1}
	for _, uid := range []int{userB, 0} {
		c := startCtlAgent(t, uid, sock)
		c.send(t, "s", solo, "mine")
		c.wantGot(t, "s", "all_gather of one while uid 1000's closes block", "mine")
	}
	othersServed(t, m)
	io.WriteString(a.stdin, "release\n")
	eventually(t, "the threads given back", func() (bool, string) {
		held := ledgerHeld(t, m, row, userA)
		return held == 0, strconv.FormatInt(held, 10) + " held"
	})
}
