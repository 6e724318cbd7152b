package integration

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestGPUCudaHelperRefused: --gpu cuda with a tensorfs-gpu on PATH that
// uid 65534 owns (she could change what runs as root) mounts without GPU
// segments; the log line says why, and the helper never ran.
func TestGPUCudaHelperRefused(t *testing.T) {
	t.Parallel()
	if _, err := os.Stat(filepath.Join(filepath.Dir(tensorfs), "tensorfs-gpu")); err == nil {
		t.Skipf("a tensorfs-gpu lies beside %s (TENSORFS_BIN); this test needs the one on PATH", tensorfs)
	}
	bin := t.TempDir()
	ran := filepath.Join(bin, "ran")
	helper := filepath.Join(bin, "tensorfs-gpu")
	err := writeExecutable(helper, []byte("#!/bin/sh\ntouch "+ran+"\nexit 1\n"))
	if err == nil {
		err = os.Chown(helper, 65534, 65534)
	}
	if err != nil {
		t.Fatal(err)
	}
	path := "PATH=" + bin + string(filepath.ListSeparator) + gtPathWithout()
	m := mountFSEnv(t, "passthrough", []string{path}, "--gpu", "cuda")
	gtWantNoGPU(t, m)
	if lines := gtOffLines(m); len(lines) != 1 || !strings.Contains(lines[0], "tensorfs-gpu belongs to uid 65534") {
		t.Errorf("log lines with \"GPU segments off\": %q, want one saying the helper belongs to uid 65534\nlog:\n%s", lines, m.stderr.String())
	}
	if _, err := os.Stat(ran); err == nil {
		t.Error("the refused helper ran")
	}
}
