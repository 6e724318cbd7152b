package integration

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/lifecycle"
)

// attackLogScript makes a chain of 64 directories named by 250 bytes that
// the log escapes (\x01, four bytes each), a file at its end, and is
// refused a bad dtype on it argv[2] times (or for argv[3] seconds, if
// that comes first); it prints how many times.
const attackLogScript = `
import os, sys, time
os.chdir(sys.argv[1])
for _ in range(64):
    os.mkdir("\x01" * 250)
    os.chdir("\x01" * 250)
open("f", "w").close()
n, end = 0, time.time() + float(sys.argv[3])
while n < int(sys.argv[2]) and time.time() < end:
    try:
        os.setxattr("f", "user.tensor.dtype", b"bogus")
    except OSError:
        n += 1
print(n)
`

// TestAttackLogFlood: every refusal is a line of the daemon's log, naming
// its path's last 64 components escaped (64 KiB for names of control
// bytes), so a user who is refused in a loop wrote the log, on /run, at
// 100 MB a second. The log now takes at most lifecycle.LogRate bytes a
// second (bursts of LogBurst) and says how many lines it dropped.
func TestAttackLogFlood(t *testing.T) {
	t.Parallel()
	if os.Getenv("TENSORFS_DEBUG") == "1" {
		t.Skip("--debug logs every request, unbounded, as asked")
	}
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		dir := m.path("shared/a")
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(dir, userA, userA); err != nil {
			t.Fatal(err)
		}
		// Enough refusals to write twice the bound of the longest run
		// (a loaded machine is refused 10 times a second, an idle one
		// hundreds).
		const seconds = 20
		need := 2*(lifecycle.LogBurst+seconds*lifecycle.LogRate+64<<10)/(64<<10) + 1
		before, start := len(m.stderr.String()), time.Now()
		out, err := runAs(t, userA, "/", systemPython, "-c", attackLogScript, dir, strconv.Itoa(need), strconv.Itoa(seconds))
		if err != nil {
			t.Fatalf("uid %d: %v\n%s", userA, err, out)
		}
		grew := len(m.stderr.String()) - before
		refusals, err := strconv.Atoi(strings.TrimSpace(out))
		if err != nil {
			t.Fatalf("uid %d printed %q", userA, out)
		}
		bound := lifecycle.LogBurst + int(time.Since(start).Seconds()*lifecycle.LogRate) + 64<<10
		t.Logf("uid %d was refused %d times; the log grew by %d bytes (bound %d)", userA, refusals, grew, bound)
		if refusals*(64<<10) < 2*bound {
			t.Fatalf("uid %d was refused %d times only: too few to flood the log", userA, refusals)
		}
		if grew > bound {
			t.Errorf("uid %d's refusals grew the daemon's log by %d bytes in %.1f s, past the bound of %d", userA, grew, time.Since(start).Seconds(), bound)
		}
		// The next line that fits says how many were dropped.
		eventually(t, "a line saying how many lines the log dropped", func() (bool, string) {
			if err := os.WriteFile(m.path("root"), nil, 0o644); err != nil {
				return false, err.Error()
			}
			err := unix.Setxattr(m.path("root"), "user.tensor.dtype", []byte("bogus"), 0)
			return strings.Contains(m.stderr.String(), "log lines dropped"), fmt.Sprintf("root's bad dtype: %v", err)
		})
		wantLog(t, m, "log lines dropped", "lines=")
	})
}
