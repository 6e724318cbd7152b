package integration

import (
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestAttackRestartUnlinkedOpen: a file a client holds open after its
// last name went is a node the kernel holds that the tree a daemon hands
// over (KnownNodes) does not list, so its successor does not know it.
// Each fstat of it then panics in go-fuse ("unknown node") and logs a
// stack: any user can flood the daemon's log, one stack per request, by
// keeping such a file across a restart (2.6 KB, 3 panics, per fstat
// here), and the file itself fails (EIO) for its holder. Not fixed yet:
// it runs with TENSORFS_UNFIXED=1.
func TestAttackRestartUnlinkedOpen(t *testing.T) {
	if os.Getenv("TENSORFS_UNFIXED") == "" {
		t.Skip("not fixed yet (the successor does not know nodes the kernel holds that have no name); TENSORFS_UNFIXED=1 runs it")
	}
	forEachMode(t, func(t *testing.T, m *mount) {
		f, err := os.Create(m.path("gone"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.Write([]byte("hello")); err != nil {
			t.Fatal(err)
		}
		if err := os.Remove(m.path("gone")); err != nil {
			t.Fatal(err)
		}
		m.restart(t, "")
		time.Sleep(1100 * time.Millisecond) // the kernel's attributes expire
		before := len(m.stderr.String())
		var failed int
		var last error
		for i := 0; i < 100; i++ {
			var st unix.Stat_t
			if err := unix.Fstat(int(f.Fd()), &st); err != nil {
				failed, last = failed+1, err
			}
		}
		logged := m.stderr.String()[before:]
		t.Logf("%d of 100 fstats failed (%v); the daemon logged %d bytes, %d panics", failed, last, len(logged), strings.Count(logged, "panic"))
		if n := strings.Count(logged, "panic"); n > 2 {
			t.Errorf("100 fstats of a file unlinked before the restart logged %d panics (%d bytes):\n%s", n, len(logged), tail(logged))
		}
	})
}
