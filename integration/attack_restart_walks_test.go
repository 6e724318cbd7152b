package integration

import (
	"os"
	"os/exec"
	"testing"
	"time"
)

// walkers is a user's program: threads that each read rbytes of a
// directory again and again until stdin ends (secs seconds at most); it
// says "walking" once the first walk is done (the others queued behind).
const walkers = `
import os, sys, threading, time
d, n, end = sys.argv[1], int(sys.argv[2]), time.time() + float(sys.argv[3])
count, stop = [0], threading.Event()
def walk():
    while time.time() < end and not stop.is_set():
        os.getxattr(d, "user.tensorfs.rbytes")
        count[0] += 1
        if count[0] == 1:
            print("walking", flush=True)
ts = [threading.Thread(target=walk) for _ in range(n)]
for t in ts: t.start()
sys.stdin.read()
stop.set()
for t in ts: t.join()
print(count[0], "walks")
`

// TestAttackRestartWalks: a uid's subtree walks run one at a time, each
// request waiting in the daemon for the ones before it: a user who asks
// rbytes of a large directory from many threads at once keeps requests
// in flight for as long as the queue takes, and a handover waits 5 s at
// most for the requests in flight: uid 1000 asking rbytes of her 10100
// entries from 64 threads made every restart of the mount by root fail
// (and hold every user's requests off for the 5 s), in both modes. A walk
// changes nothing: it now waits and walks outside the handover's gate,
// and the successor gets the request again (NotifyResend).
func TestAttackRestartWalks(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		reachable(t, m.dir)
		if err := os.Mkdir(m.path("walk"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(m.path("walk"), userA, userA); err != nil {
			t.Fatal(err)
		}
		pythonAs(t, userA, "/", "import os, sys\nfor i in range(100):\n  d = os.path.join(sys.argv[1], str(i)); os.mkdir(d)\n  for j in range(100): os.mknod(os.path.join(d, str(j)))", m.path("walk"))
		// They walk until the restart is over: from when the first walk
		// is done (63 queued behind it), then the 5 s a handover waited
		// for them before, at most.
		w := startPythonAs(t, userA, "her walkers", walkers, m.path("walk"), "64", "12")
		w.expect(t, "walking")
		defer func() {
			w.stdin.Close()
			t.Logf("her walkers: %s", w.next(t))
			w.wait(t)
		}()
		start := time.Now()
		out, err := exec.Command(tensorfs, "restart", m.dir).CombinedOutput()
		if err != nil {
			t.Errorf("root's restart while uid %d walks: %v after %v\n%s", userA, err, time.Since(start).Round(time.Millisecond), out)
		} else {
			t.Logf("the restart took %v", time.Since(start).Round(time.Millisecond))
		}
	}, "--allow-other")
}
