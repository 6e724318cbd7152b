package integration

import (
	"errors"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"tensorfs/gpu"
)

// TestGPUStalledHelper: a device helper that stops answering (a sim
// helper told to by gpu.SimStallEnv, as a wedged driver would) cannot
// wedge the mount. A write to a device segment fails with EIO at the
// copy's deadline (10 s for a small copy), the helper is killed, one error
// line says which call and that GPU segments are off; later GPU requests
// fail with EIO at once, and host segments are served as before.
func TestGPUStalledHelper(t *testing.T) {
	t.Parallel()
	m := mountFSEnv(t, "passthrough", []string{gpu.SimStallEnv + "=copy"}, gtSimAlways...)
	helpers := gtHelperPIDs(m)
	if len(helpers) != 1 {
		t.Fatalf("the daemon has %d device helper processes (%v), want 1", len(helpers), helpers)
	}
	seg := gtDeviceSegment(t, m.path("w"))
	other := gtDeviceSegment(t, m.path("other"))
	host := m.path("host")
	if err := os.WriteFile(host, []byte("before"), 0o644); err != nil {
		t.Fatal(err)
	}

	f := gtOpen(t, seg, os.O_WRONLY)
	start := time.Now()
	_, err := f.Write([]byte("stalls"))
	took := time.Since(start)
	f.Close()
	if !errors.Is(err, syscall.EIO) {
		t.Fatalf("write to a device segment of a stalled helper = %v, want EIO", err)
	}
	if took < 10*time.Second || took > 20*time.Second {
		t.Errorf("the write failed after %v; the deadline of a 6-byte copy is 10 s", took)
	}
	gtWantGone(t, "the stalled device helper", helpers)

	start = time.Now()
	if err := os.Truncate(other, 1<<20); !errors.Is(err, syscall.EIO) {
		t.Errorf("truncate of a device segment after the helper was killed = %v, want EIO", err)
	}
	if _, err := os.ReadFile(seg); !errors.Is(err, syscall.EIO) {
		t.Errorf("read of a device segment after the helper was killed = %v, want EIO", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("two requests on GPU segments took %v after the helper was killed; want them to fail at once", took)
	}

	if err := os.WriteFile(host, []byte("after"), 0o644); err != nil {
		t.Errorf("host segment write after the GPU went off: %v", err)
	}
	if b, err := os.ReadFile(host); err != nil || string(b) != "after" {
		t.Errorf("host segment after the GPU went off: %q %v", b, err)
	}
	run(t, "cp", host, m.path("host2"))
	if g, ok := m.stats(t)["gpu"].(map[string]any); !ok || g["backend"] != "sim" {
		t.Errorf("stats after the GPU went off: gpu = %v", m.stats(t)["gpu"])
	}

	var stalled []string
	for _, line := range strings.Split(m.stderr.String(), "\n") {
		if strings.Contains(line, "msg=\"gpu helper") {
			stalled = append(stalled, line)
		}
	}
	if len(stalled) != 1 || !strings.Contains(stalled[0], "level=ERROR") || !strings.Contains(stalled[0], "call=CopyIn") ||
		!strings.Contains(stalled[0], "GPU segments are off") {
		t.Errorf("log lines on the gpu helper: %q; want one error naming the call", stalled)
	}
}
