package gpu

import (
	"bytes"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

func testExe(t *testing.T) string {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return exe
}

func TestHelperKilled(t *testing.T) {
	d := startSim(t)
	b := alloc(t, d, 100)
	syscall.Kill(d.(*remote).proc.Pid, syscall.SIGKILL)
	_, err := d.Alloc(10)
	for i := 0; err == nil && i < 100; i++ { // a call may still win the race
		time.Sleep(10 * time.Millisecond)
		_, err = d.Alloc(10)
	}
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "signal: killed") {
		t.Fatalf("Alloc after the helper was killed = %v; want ErrUnavailable saying it was killed", err)
	}
	if err := d.CopyIn(b, 0, []byte{1}); !errors.Is(err, ErrUnavailable) {
		t.Errorf("CopyIn = %v, want ErrUnavailable", err)
	}
	if _, err := d.Export(b); !errors.Is(err, ErrUnavailable) {
		t.Errorf("Export = %v, want ErrUnavailable", err)
	}
	if st := d.Stats(); st != (Stats{}) {
		t.Errorf("Stats of a dead helper = %+v", st)
	}
}

// syncBuffer is a log destination safe for the helper's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestHelperCrashReason(t *testing.T) {
	t.Setenv(helperEnv, "crash-on-alloc")
	var logs syncBuffer
	d, err := Start(testExe(t), "sim", 0, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	_, err = d.Alloc(10) // in flight when the helper dies
	if !errors.Is(err, ErrUnavailable) || !strings.HasSuffix(err.Error(), crashLine) || !strings.Contains(err.Error(), "exit status 3") {
		t.Fatalf("Alloc = %v; want ErrUnavailable with the exit status and the helper's last line", err)
	}
	if _, err2 := d.Alloc(10); err2 == nil || err2.Error() != err.Error() {
		t.Errorf("next call = %v; want the same error", err2)
	}
	if !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), crashLine) {
		t.Errorf("no warning logged; logs:\n%s", logs.String())
	}
}

func TestStartFails(t *testing.T) {
	// The default build has no cuda backend: the helper says so and exits,
	// as one whose cuInit fails does.
	_, err := Start(testExe(t), "cuda", 0, nil)
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "gpu-helper: ") {
		t.Fatalf("Start cuda = %v; want ErrUnavailable with the helper's reason", err)
	}
	t.Log(err)
	if _, uerr := Unavailable(err).Alloc(1); uerr == nil || uerr.Error() != err.Error() || !errors.Is(uerr, ErrUnavailable) {
		t.Errorf("Unavailable(err).Alloc = %v; want the same error", uerr)
	}

	if _, err := Start("/nonexistent/tensorfs", "sim", 0, nil); !errors.Is(err, ErrUnavailable) {
		t.Errorf("Start of a missing executable = %v, want ErrUnavailable", err)
	}
	// A program that exits at once without a word.
	if _, err := Start("/bin/true", "sim", 0, nil); !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "exit status 0") {
		t.Errorf("Start of /bin/true = %v, want ErrUnavailable saying it exited", err)
	}
}

func TestBadBackend(t *testing.T) {
	if _, err := Start(testExe(t), "opencl", 0, nil); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "want cuda, sim or none") {
		t.Errorf("Start opencl = %v; want ErrInvalid naming the backends", err)
	}
	if _, err := Start(testExe(t), "sim", -1, nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("Start device -1 = %v; want ErrInvalid", err)
	}

	// A helper given a bad --backend exits with status 2 and says why.
	_, err := start(testExe(t), []string{"gpu-helper", "--backend", "opencl"}, slog.New(slog.DiscardHandler))
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "exit status 2") || !strings.Contains(err.Error(), "want --backend sim or --backend cuda") {
		t.Errorf("helper with --backend opencl: %v", err)
	}

	for _, args := range [][]string{{"--backend", "opencl"}, {"--bogus"}, {"--backend", "sim", "extra"}, {}} {
		var stderr bytes.Buffer
		if code := HelperMain(args, &stderr, nil); code != 2 || strings.Count(stderr.String(), "\n") != 1 || !strings.HasPrefix(stderr.String(), "gpu-helper: ") {
			t.Errorf("HelperMain(%q) = %d, %q; want 2 and one line", args, code, stderr.String())
		}
	}
}

func TestHelperMainNoSocket(t *testing.T) {
	// A helper run by hand, without the socket pair as fd 3.
	cmd := exec.Command(testExe(t), "gpu-helper", "--backend", "sim")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 || !strings.Contains(stderr.String(), "fd 3") {
		t.Errorf("helper without a socket: %v, %q; want exit status 1 and a word on fd 3", err, stderr.String())
	}
}

func TestHelperClose(t *testing.T) {
	exe := testExe(t)
	d, err := Start(exe, "sim", 2, nil)
	if err != nil {
		t.Fatal(err)
	}
	if d.Name() != "cuda:2" {
		t.Errorf("Name = %q, want cuda:2", d.Name())
	}
	alloc(t, d, 10) // freed by the helper as it exits
	r := d.(*remote)
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if !r.state.Success() {
		t.Errorf("helper exit: %v", r.state)
	}
	if _, err := d.Alloc(10); !errors.Is(err, ErrUnavailable) {
		t.Errorf("Alloc after Close = %v, want ErrUnavailable", err)
	}
	if err := d.CopyOut(Block{1, 1}, 0, make([]byte, 1)); !errors.Is(err, ErrUnavailable) {
		t.Errorf("CopyOut after Close = %v, want ErrUnavailable", err)
	}
	if err := d.Close(); err != nil {
		t.Errorf("second Close = %v", err)
	}
}
