package gpu

import (
	"bytes"
	"errors"
	"log/slog"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

func TestTimeouts(t *testing.T) {
	copyOf := func(op uint8, n int64) *message { return &message{op: op, args: []int64{1, 1, 0, 0, n}} }
	d := defaultTimeouts
	for _, tc := range []struct {
		m    *message
		want time.Duration
	}{
		{&message{op: opAlloc, args: []int64{1 << 40}}, 10 * time.Second},
		{&message{op: opStats}, 10 * time.Second},
		{&message{op: opFree, args: []int64{1, 1 << 40}}, 10 * time.Second},
		{copyOf(opCopyIn, stagingSlot), 10*time.Second + 250*time.Millisecond},
		{copyOf(opCopyFromFile, 1<<30), 74 * time.Second},
		{copyOf(opCopyToFile, 0), 10 * time.Second},
		{copyOf(opCopyOut, -5), 10 * time.Second},
		{copyOf(opCopyToFile, 1<<62), 10*time.Second + maxTimeout},
	} {
		if got := d.of(tc.m); got != tc.want {
			t.Errorf("deadline of %s %v = %v, want %v", opNames[tc.m.op], tc.m.args, got, tc.want)
		}
	}
}

// startStalling starts a sim helper that stalls as stall says (SimStallEnv),
// with deadlines tm, logging to the returned buffer; closed at cleanup.
func startStalling(t *testing.T, stall string, tm timeouts) (*remote, *syncBuffer) {
	t.Helper()
	t.Setenv(SimStallEnv, stall)
	var logs syncBuffer
	d, err := Start(testExe(t), "sim", 0, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	r := d.(*remote)
	r.timeouts = tm
	return r, &logs
}

// wantHelperGone checks that the helper and its process group are gone.
func wantHelperGone(t *testing.T, r *remote) {
	t.Helper()
	select {
	case <-r.exited:
	case <-time.After(5 * time.Second):
		t.Fatalf("helper %d still running 5 s after it was given up on", r.proc.Pid)
	}
	if r.state.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Errorf("helper exit: %v, want killed", r.state)
	}
	if err := syscall.Kill(-r.proc.Pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("the helper's process group %d: %v, want ESRCH", r.proc.Pid, err)
	}
}

// wantFailsFast checks that calls on a given-up device return err at once.
func wantFailsFast(t *testing.T, d Device, b Block, want error) {
	t.Helper()
	start := time.Now()
	_, err1 := d.Alloc(10)
	err2 := d.CopyIn(b, 0, []byte{1})
	err3 := d.Free(b)
	st := d.Stats()
	if took := time.Since(start); took > time.Second {
		t.Errorf("four calls on a given-up helper took %v", took)
	}
	for _, err := range []error{err1, err2, err3} {
		if err == nil || err.Error() != want.Error() {
			t.Errorf("later call = %v, want %v", err, want)
		}
	}
	if st != (Stats{}) {
		t.Errorf("Stats of a given-up helper = %+v", st)
	}
}

// TestStalledCopy: a copy the helper never answers fails with
// ErrUnavailable at its deadline; the helper is killed, one error line is
// logged, and every later call fails at once with the same error.
func TestStalledCopy(t *testing.T) {
	tm := timeouts{control: 5 * time.Second, copyFloor: 300 * time.Millisecond, copyRate: 8 << 20}
	r, logs := startStalling(t, "copy", tm)
	b := alloc(t, r, 4<<20)
	start := time.Now()
	err := r.CopyIn(b, 0, make([]byte, 4<<20)) // a deadline of 300 ms + 0.5 s
	took := time.Since(start)
	deadline := 800 * time.Millisecond
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "CopyIn") || !strings.Contains(err.Error(), "GPU segments are off") {
		t.Fatalf("stalled CopyIn = %v; want ErrUnavailable naming the call", err)
	}
	if took < deadline || took > deadline+2*time.Second {
		t.Errorf("stalled CopyIn returned after %v; its deadline is %v", took, deadline)
	}
	t.Log(err)
	wantHelperGone(t, r)
	wantFailsFast(t, r, b, err)

	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	if len(lines) != 1 || !strings.Contains(lines[0], "level=ERROR") || !strings.Contains(lines[0], "call=CopyIn") ||
		!strings.Contains(lines[0], "waited=800ms") || !strings.Contains(lines[0], "GPU segments are off") {
		t.Errorf("log: %q; want one error line naming the call and its wait", lines)
	}
}

// TestStalledCallsInFlight: when one call passes its deadline, every call
// in flight returns with the same error, those waiting for a copy slot
// included, and the helper is gone.
func TestStalledCallsInFlight(t *testing.T) {
	tm := timeouts{control: 400 * time.Millisecond, copyFloor: 30 * time.Second, copyRate: 1 << 20}
	r, _ := startStalling(t, "copy,ipc,stats", tm)
	b := alloc(t, r, 100)
	src, err := os.CreateTemp(t.TempDir(), "src")
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if _, err := src.Write(make([]byte, 100)); err != nil {
		t.Fatal(err)
	}

	errs := make(chan error, 16)
	var wg sync.WaitGroup
	for range stagingSlots + 2 { // more copies than slots: some wait for one
		wg.Go(func() { errs <- r.CopyOut(b, 0, make([]byte, 100)) })
	}
	wg.Go(func() { errs <- r.CopyFromFile(b, 0, int(src.Fd()), 0, 100) })
	wg.Go(func() { _, err := r.IPC(b); errs <- err })
	wg.Go(func() {
		if st := r.Stats(); st != (Stats{}) {
			t.Errorf("Stats in flight = %+v, want zero", st)
		}
	})
	start := time.Now()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("calls in flight still waiting 10 s after the first deadline")
	}
	t.Logf("all calls returned after %v", time.Since(start))
	close(errs)
	var first error
	for err := range errs {
		if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "within 400ms") {
			t.Errorf("call in flight = %v; want ErrUnavailable from the 400 ms deadline", err)
		}
		first = err
	}
	wantHelperGone(t, r)
	if first != nil {
		wantFailsFast(t, r, b, first)
	}
}

// TestSlowCallsWithinDeadline: a helper that answers late but within the
// deadline is kept; a copy's deadline grows with its bytes. (Each late
// answer has 600 ms to spare: with 100 ms, a loaded machine's race-built
// copy of 4 MiB took them.)
func TestSlowCallsWithinDeadline(t *testing.T) {
	tm := timeouts{control: 2 * time.Second, copyFloor: 100 * time.Millisecond, copyRate: 4 << 20}
	r, logs := startStalling(t, "copy=500ms,alloc=300ms", tm)
	const n = 8 << 20 // a deadline of 100 ms + 2 s
	b := alloc(t, r, n)
	data := pattern(1, n)
	src, err := os.CreateTemp(t.TempDir(), "src")
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if _, err := src.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := r.CopyFromFile(b, 0, int(src.Fd()), 0, n); err != nil {
		t.Fatalf("CopyFromFile of 8 MiB, 500 ms late within 2.1 s: %v", err)
	}
	got := make([]byte, n)
	if err := r.CopyOut(b, 0, got); err != nil { // two 4 MiB round trips, 1.1 s each
		t.Fatalf("CopyOut: %v", err)
	}
	if !bytes.Equal(got, data) {
		t.Error("bytes changed on the way")
	}
	free(t, r, b)
	if st := r.Stats(); st != (Stats{}) {
		t.Errorf("Stats = %+v, want an empty device", st)
	}

	// 1 KiB has 100 ms: 500 ms late is too late.
	b = alloc(t, r, 1024)
	if err := r.CopyIn(b, 0, make([]byte, 1024)); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("CopyIn of 1 KiB 500 ms late = %v, want ErrUnavailable", err)
	}
	wantHelperGone(t, r)
	if !strings.Contains(logs.String(), "call=CopyIn") {
		t.Errorf("log: %s", logs.String())
	}
}

func TestBadStallEnv(t *testing.T) {
	for _, v := range []string{"copy=soon", "gpu", "copy,", "free=-1s"} {
		t.Setenv(SimStallEnv, v)
		var stderr bytes.Buffer
		if code := HelperMain([]string{"--backend", "sim"}, &stderr, nil); code != 2 || strings.Count(stderr.String(), "\n") != 1 || !strings.Contains(stderr.String(), SimStallEnv) {
			t.Errorf("HelperMain with %s=%q = %d, %q; want 2 and one line naming it", SimStallEnv, v, code, stderr.String())
		}
	}
}
