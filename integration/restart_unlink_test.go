package integration

import (
	"os"
	"testing"
)

// unlinkHolderScript makes argv[1], an UNLINK segment holding "held",
// and keeps a descriptor of it open, mapping nothing; "check" reads it
// through that descriptor, "close" closes it.
const unlinkHolderScript = `
import os, sys
p = sys.argv[1]
fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
os.setxattr(p, "user.tensorfs.flags", b"UNLINK")
os.write(fd, b"held")
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "close":
        os.close(fd)
        print("closed", flush=True)
        continue
    try:
        print(os.pread(fd, 4, 0).decode(), flush=True)
    except OSError as e:
        print("errno", e.errno, flush=True)
`

// TestRestartKeepsUnlinkOpen: uid userA holds an UNLINK segment open and
// maps it nowhere; across a restart, a crash and a restart again it keeps
// its name and its descriptor reads it. Its last close removes it, as it
// would have without a new daemon.
func TestRestartKeepsUnlinkOpen(t *testing.T) {
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		reachable(t, m.dir)
		err := os.Mkdir(m.path("shared"), 0o777)
		if err == nil {
			err = os.Chmod(m.path("shared"), 0o1777)
		}
		if err != nil {
			t.Fatal(err)
		}
		p := m.path("shared/held")
		c := startPythonAs(t, userA, "holder", unlinkHolderScript, p)
		c.expect(t, "ready")
		for _, takeover := range []string{"restart", "crash", "restart"} {
			if takeover == "restart" {
				m.restart(t, "")
			} else {
				m.crash(t)
			}
			if _, err := os.Lstat(p); err != nil {
				t.Errorf("after a %s, an UNLINK segment held open lost its name: %v", takeover, err)
			}
			if got := c.do(t, "check"); got != "held" {
				t.Errorf("after a %s, the holder reads %q, want \"held\"", takeover, got)
			}
		}
		if got := c.do(t, "close"); got != "closed" {
			t.Fatalf("close: %s", got)
		}
		eventually(t, "the UNLINK segment goes at its last close", func() (bool, string) {
			_, err := os.Lstat(p)
			return err != nil, "shared/held is still there"
		})
	}, "--allow-other")
}
