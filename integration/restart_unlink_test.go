package integration

import (
	"os"
	"testing"
	"time"
)

// unlinkHolderScript makes argv[1], an UNLINK segment holding "held",
// and keeps a descriptor of it open, and a mapping of it if argv[2] is
// "map"; "check" reads it through that descriptor, "unmap" lets the
// mapping go, "close" closes the descriptor.
const unlinkHolderScript = `
import mmap, os, sys
p = sys.argv[1]
fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
os.setxattr(p, "user.tensorfs.flags", b"UNLINK")
os.write(fd, b"held")
m = mmap.mmap(fd, 4) if sys.argv[2] == "map" else None
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() in ("close", "unmap"):
        if line.strip() == "close":
            os.close(fd)
        else:
            m.close()
        print("ok", flush=True)
        continue
    try:
        print(os.pread(fd, 4, 0).decode(), flush=True)
    except OSError as e:
        print("errno", e.errno, flush=True)
`

// TestRestartKeepsUnlinkOpen: uid userA holds two UNLINK segments open,
// one mapped nowhere, one mapped too; across a restart, a crash and a
// restart again each keeps its name and its descriptor reads it. The
// mapped one's last unmapping leaves it, still open, in place; the last
// close of each removes it, as it would have without a new daemon.
func TestRestartKeepsUnlinkOpen(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		reachable(t, m.dir)
		err := os.Mkdir(m.path("shared"), 0o777)
		if err == nil {
			err = os.Chmod(m.path("shared"), 0o1777)
		}
		if err != nil {
			t.Fatal(err)
		}
		holders := map[string]*pyChild{}
		for _, how := range []string{"open", "map"} {
			holders[how] = startPythonAs(t, userA, how, unlinkHolderScript, m.path("shared/"+how), how)
			holders[how].expect(t, "ready")
		}
		for _, takeover := range []string{"restart", "crash", "restart"} {
			if takeover == "restart" {
				m.restart(t, "")
			} else {
				m.crash(t)
			}
			for how, c := range holders {
				if _, err := os.Lstat(m.path("shared/" + how)); err != nil {
					t.Errorf("after a %s, an UNLINK segment held %s lost its name: %v", takeover, how, err)
				}
				if got := c.do(t, "check"); got != "held" {
					t.Errorf("after a %s, its holder (%s) reads %q, want \"held\"", takeover, how, got)
				}
			}
		}
		if got := holders["map"].do(t, "unmap"); got != "ok" {
			t.Fatalf("unmap: %s", got)
		}
		time.Sleep(1500 * time.Millisecond) // past a watch of the mappings' next look (1 s at most)
		if _, err := os.Lstat(m.path("shared/map")); err != nil {
			t.Errorf("an UNLINK segment still open lost its name at its last unmapping: %v", err)
		}
		for how, c := range holders {
			if got := c.do(t, "close"); got != "ok" {
				t.Fatalf("close: %s", got)
			}
			eventually(t, "an UNLINK segment goes at its last close", func() (bool, string) {
				_, err := os.Lstat(m.path("shared/" + how))
				return err != nil, "shared/" + how + " is still there"
			})
		}
	}, "--allow-other")
}
