package integration

// A GPU helper that hangs (alive, not answering a successor's hello) does
// not hold a takeover up for a cold start's minute, nor keep its device
// memory beside a new helper's (issue 27, DESIGN.md §12): the successor
// gives it a control call's deadline, kills it through the pidfd the
// keeper passed on, and starts a new one.

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/gpu"
)

// hungDeadline bounds a takeover whose helper hangs: the hello's deadline
// (a control call's, 10 s) and a few seconds to start the new helper and
// serve.
const hungDeadline = 10*time.Second + 5*time.Second

// ledgerOf returns uid's charges in each of the mount's ledger rows but
// inodes: a takeover counts those again from the backing, with the
// attributes the daemon stores there, which a segment's creation did not
// charge (a matter of its own, whatever the helper).
func ledgerOf(t *testing.T, m *mount, uid int) map[string]int64 {
	t.Helper()
	held := map[string]int64{}
	for _, r := range ledgerRows(t, m.dir) {
		if !strings.HasPrefix(r.Name, "inodes") {
			held[r.Name] = r.ByUID[fmt.Sprint(uid)]
		}
	}
	return held
}

// rhWantReplaced checks, after a takeover, that the successor serves with
// a new helper: the hung one is gone, one log line names it killed, the
// segment seg of size bytes is still there with its device bytes lost
// (zeros), user A's ledger is as before, and the new helper serves seg.
func rhWantReplaced(t *testing.T, m *mount, hung []int, seg string, size int, ledger map[string]int64) {
	t.Helper()
	gtWantGone(t, "the hung GPU helper", hung)
	killed := 0
	for line := range strings.Lines(m.stderr.String()) {
		if strings.Contains(line, "failed this daemon's attach") && strings.Contains(line, fmt.Sprintf("pid=%d ", hung[0])) {
			killed++
		}
	}
	if killed != 1 {
		t.Errorf("the log names the hung helper %d killed %d times, want once:\n%s", hung[0], killed, tail(m.stderr.String()))
	}
	if now := gtHelperPIDs(m); len(now) != 1 || now[0] == hung[0] {
		t.Errorf("the successor's GPU helpers: %v, want one new one (the hung one was %d)", now, hung[0])
	}
	if b, err := os.ReadFile(seg); err != nil || len(b) != size || len(bytes.Trim(b, "\x00")) != 0 {
		t.Errorf("the GPU segment after the takeover: %d bytes, %v; want its %d bytes, zeros (lost with the helper)", len(b), err, size)
	}
	if got := ledgerOf(t, m, userA); fmt.Sprint(got) != fmt.Sprint(ledger) {
		t.Errorf("user A's ledger after the takeover: %v, want %v", got, ledger)
	}
	want := fmt.Sprintf("written after helper %d hung", hung[0])
	if out, err := runAs(t, userA, "/", "sh", "-c", "printf '"+want+"' | dd of="+seg+" conv=notrunc status=none && head -c "+fmt.Sprint(len(want))+" "+seg); err != nil || out != want {
		t.Errorf("user A's write and read of the GPU segment on the new helper: %q, %v", out, err)
	}
}

// TestRestartGPUHelperHung: user A's GPU segment, on a sim helper that
// never answers a successor's hello (gpu.SimStallEnv "attach"): tensorfs
// restart, then a SIGKILL of the daemon, each serve the mount again
// within the hello's deadline and a few seconds, with the hung helper
// killed and a new one serving (which hangs the same way, for the crash).
func TestRestartGPUHelperHung(t *testing.T) {
	t.Parallel()
	eachMode(t, true, func(t *testing.T, m *mount) {
		seg := filepath.Join(usersGPUDir(t, m), "w")
		const size = 1000003
		gtReleasing(t, m, "the release of user A's write", func() {
			if out, err := runAs(t, userA, "/", "sh", "-c", fmt.Sprintf("head -c %d /dev/urandom >%s", size, seg)); err != nil {
				t.Fatalf("user A writes a GPU segment: %v\n%s", err, out)
			}
		})
		ledger := ledgerOf(t, m, userA) // with the write's handle gone

		hung := gtHelperPIDs(m)
		if len(hung) != 1 {
			t.Fatalf("the daemon's GPU helpers: %v, want one", hung)
		}
		start := time.Now()
		m.restart(t, "")
		if took := time.Since(start); took > hungDeadline {
			t.Errorf("tensorfs restart with a hung GPU helper took %v, want under %v", took, hungDeadline)
		}
		rhWantReplaced(t, m, hung, seg, size, ledger)

		hung = gtHelperPIDs(m)
		old := m.daemonPid(t)
		start = time.Now()
		if err := unix.Kill(old, unix.SIGKILL); err != nil {
			t.Fatal(err)
		}
		for m.pid = old; m.pid == old; {
			if _, err := getxattr(m.dir, statsXattr); err == nil {
				m.pid = m.daemonPid(t)
			}
			if took := time.Since(start); took > hungDeadline {
				t.Fatalf("no daemon serves %v after the crash, with a hung GPU helper", took)
			}
			time.Sleep(50 * time.Millisecond)
		}
		rhWantReplaced(t, m, hung, seg, size, ledger)
	}, []string{gpu.SimStallEnv + "=attach"}, []string{"--gpu", "sim", "--allow-other"})
}
