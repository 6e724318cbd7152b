package gpu

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// hungDeadlines are short deadlines for a successor's session.
var hungDeadlines = timeouts{control: 300 * time.Millisecond, copyFloor: time.Second, copyRate: 8 << 20}

// doorOf returns the door and pidfd of r's helper (Door), closed at cleanup.
func doorOf(t *testing.T, r *remote) (door, pidfd *os.File) {
	t.Helper()
	door, pidfd, err := Door(r)
	if err != nil || door == nil || pidfd == nil {
		t.Fatalf("Door = %v, %v, %v", door, pidfd, err)
	}
	t.Cleanup(func() { door.Close(); pidfd.Close() })
	return door, pidfd
}

// wantKillLine checks that logs hold one line saying that the helper pid
// was killed after an attach failed, and why.
func wantKillLine(t *testing.T, logs *syncBuffer, pid int, why string) {
	t.Helper()
	var lines []string
	for line := range strings.Lines(logs.String()) {
		if strings.Contains(line, "failed this daemon's attach") {
			lines = append(lines, line)
		}
	}
	if len(lines) != 1 || !strings.Contains(lines[0], fmt.Sprintf("pid=%d ", pid)) || !strings.Contains(lines[0], why) || !strings.Contains(lines[0], "exited=true") {
		t.Errorf("log lines on the killed helper: %q; want one naming pid %d, %q, exited", lines, pid, why)
	}
}

// TestAttachHungHelper: a successor's attach to a helper that does not
// answer its hello (stalled: SimStallEnv "attach") fails at the control
// deadline, not the cold start's. Without the helper's pidfd (a keeper
// from before pidfds) the helper is left running, as before; with it, the
// helper is killed through the pidfd, and gone, before Attach returns,
// with one log line naming its pid.
func TestAttachHungHelper(t *testing.T) {
	r, _ := startStalling(t, "attach", defaultTimeouts)
	door, pidfd := doorOf(t, r)
	for _, withPidfd := range []bool{false, true} {
		var logs syncBuffer
		given := pidfd
		if !withPidfd {
			given = nil
		}
		start := time.Now()
		_, err := attach(door, given, slog.New(slog.NewTextHandler(&logs, nil)), hungDeadlines)
		took := time.Since(start)
		if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "did not answer within 300ms") {
			t.Fatalf("attach to a hung helper (pidfd given: %v) = %v; want ErrUnavailable at the control deadline", withPidfd, err)
		}
		if took < hungDeadlines.control || took > hungDeadlines.control+2*time.Second {
			t.Errorf("attach to a hung helper (pidfd given: %v) returned after %v; its deadline is %v", withPidfd, took, hungDeadlines.control)
		}
		if !withPidfd {
			select {
			case <-r.exited:
				t.Fatalf("attach without the helper's pidfd ended the helper: %v", r.state)
			default:
			}
			if logs.String() != "" {
				t.Errorf("attach without the helper's pidfd logged %q", logs.String())
			}
			continue
		}
		if !exitedWithin(int(pidfd.Fd()), 0) {
			t.Fatal("the hung helper runs on after attach returned")
		}
		wantHelperGone(t, r)
		wantKillLine(t, &logs, r.proc.Pid, "did not answer within 300ms")
	}
}

// TestAttachStalledClaim: a successor whose claim the helper does not
// answer (SimStallEnv "claim") kills the helper, which it did not start,
// through its pidfd at the control deadline, and logs its pid.
func TestAttachStalledClaim(t *testing.T) {
	r, _ := startStalling(t, "claim", defaultTimeouts)
	door, pidfd := doorOf(t, r)
	var logs syncBuffer
	d, err := attach(door, pidfd, slog.New(slog.NewTextHandler(&logs, nil)), hungDeadlines)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	start := time.Now()
	if _, err := d.(Survivor).Claim(); !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "Claim") {
		t.Fatalf("stalled Claim = %v; want ErrUnavailable naming the call", err)
	}
	if took := time.Since(start); took > hungDeadlines.control+2*time.Second {
		t.Errorf("stalled Claim returned after %v; its deadline is %v", took, hungDeadlines.control)
	}
	wantHelperGone(t, r)
	if line := logs.String(); strings.Count(line, "gpu helper stalled") != 1 || !strings.Contains(line, fmt.Sprintf("pid=%d", r.proc.Pid)) {
		t.Errorf("log: %q; want one line on the stalled helper with its pid %d", line, r.proc.Pid)
	}
}

// TestAttachHelloNotHelpers: a hello from another process than the one
// whose pidfd the successor was given fails the attach; the process of
// the pidfd (what the successor was told is the helper) is killed.
func TestAttachHelloNotHelpers(t *testing.T) {
	r, _ := startStalling(t, "", defaultTimeouts)
	door, _ := doorOf(t, r)
	other := exec.Command("sleep", "60")
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	defer other.Process.Kill()
	fd, err := unix.PidfdOpen(other.Process.Pid, 0)
	if err != nil {
		t.Fatal(err)
	}
	wrong := os.NewFile(uintptr(fd), "pidfd")
	defer wrong.Close()
	var logs syncBuffer
	if _, err := attach(door, wrong, slog.New(slog.NewTextHandler(&logs, nil)), hungDeadlines); !errors.Is(err, errProtocol) || !strings.Contains(err.Error(), "not from the helper") {
		t.Fatalf("attach with another process's pidfd = %v; want a protocol error", err)
	}
	if err := other.Wait(); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Errorf("the process of the pidfd given: %v; want it killed", err)
	}
	wantKillLine(t, &logs, other.Process.Pid, "not from the helper")
	if _, err := r.Alloc(10); err != nil {
		t.Errorf("the helper's own daemon after the failed attach: Alloc = %v", err)
	}
}

// TestUnclaimedSuccessorDecidesNothing: a successor that attached but
// never claimed the device, and died (no goodbye) after the helper's
// first daemon closed cleanly, does not keep the helper up for a
// successor of its own: it held nothing. (The helper went by the session
// it saw end last, and stayed when that was the successor's, which the
// order of two goroutines decided: TestAttachHelloNotHelpers failed so.)
func TestUnclaimedSuccessorDecidesNothing(t *testing.T) {
	r, _ := startStalling(t, "", defaultTimeouts)
	door, pidfd := doorOf(t, r)
	b, err := Attach(door, pidfd, nil)
	if err != nil {
		t.Fatal(err)
	}
	closed := make(chan error, 1)
	go func() { closed <- r.Close() }()
	<-r.gone                      // the helper ended the first daemon's session, with its goodbye
	b.(*remote).conn.CloseWrite() // the successor dies: its session ends, no goodbye
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("the first daemon's Close: %v", err)
		}
	case <-time.After(exitTimeout / 2):
		t.Fatal("the helper stayed up for the successor that never claimed the device")
	}
	if !r.state.Success() {
		t.Errorf("the helper's exit: %v, want 0", r.state)
	}
	b.Close()
}
