package integration

// A tensorfs restart whose new daemon fails after it claimed the GPU
// helper (issue 27, DESIGN.md §12) leaves the old daemon as it was: its
// GPU segments' bytes, backing files and consumer counters, and its
// limbo, whose blocks a counter let go during the attempt are freed
// once it serves again.

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/fs"
)

// TestRestartGPUFailedAfterClaim: user A's GPU segment w (with a
// consumer counter) and a removed one whose block waits in limbo for its
// counter; a restart with a binary that fails 2 s after its claim, while
// the removed segment's counter drops to 0: the restart fails, the old
// daemon serves w's bytes, w's backing file stays empty and its counter
// file stays, the removed segment's block is freed (the device holds w's
// alone), and a next restart keeps w's bytes.
func TestRestartGPUFailedAfterClaim(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		dir := usersGPUDir(t, m)
		seg, gone := filepath.Join(dir, "w"), filepath.Join(dir, "gone")
		if out, err := runAs(t, userA, "/", "sh", "-c", "head -c 1000003 /dev/urandom >"+seg+" && truncate -s 1M "+gone); err != nil {
			t.Fatalf("user A writes GPU segments: %v\n%s", err, out)
		}
		counter := strings.TrimSuffix(string(gtGetfattr(t, seg, gtRefCounter)), ":0")
		holder := startPythonAs(t, userA, "consumer of the removed segment", rgConsumerScript, gone, "counter")
		holder.expect(t, "ready")
		if got := holder.do(t, "add 1"); got != "value 1" {
			t.Fatalf("consumer of %s: %q", gone, got)
		}
		holder.wait(t)
		if out, err := runAs(t, userA, "/", "rm", gone); err != nil {
			t.Fatalf("rm %s: %v\n%s", gone, err, out)
		}
		eventually(t, "the removed segment in limbo", gtLimboIs(t, m, 1, -1))
		sha, pid, goneCounter := gtSha256(t, seg), m.daemonPid(t), counterPath(t, m)

		failing := filepath.Join(t.TempDir(), "tensorfs-fails")
		script := "#!/bin/sh\n" + fs.FailAfterClaimEnv + "=2s exec " + tensorfs + " \"$@\"\n"
		if err := writeExecutable(failing, []byte(script)); err != nil {
			t.Fatal(err)
		}
		const claimed = "takeover: device segments claimed their blocks"
		restart := exec.Command(tensorfs, "restart", "--binary", failing, m.dir)
		var out bytes.Buffer
		restart.Stdout, restart.Stderr = &out, &out
		if err := restart.Start(); err != nil {
			t.Fatal(err)
		}
		eventually(t, "the new daemon's claim", func() (bool, string) {
			return strings.Contains(m.stderr.String(), claimed), tail(m.stderr.String())
		})
		// While the new daemon holds the claim (the mount frozen), the
		// removed segment's counter lets go.
		if err := os.WriteFile(goneCounter, make([]byte, 8), 0); err != nil {
			t.Fatal(err)
		}
		if err := restart.Wait(); err == nil {
			t.Fatalf("a restart whose daemon fails after its claim succeeded:\n%s", out.String())
		}
		if m.daemonPid(t) != pid || unix.Kill(pid, 0) != nil {
			t.Fatalf("the daemon %d no longer serves after a failed restart:\n%s", pid, out.String())
		}
		if got := gtSha256(t, seg); got != sha {
			t.Errorf("after the failed restart w reads sha %s, want %s", got, sha)
		}
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(alloc.PrivateBacking(m.dir), "gpu", "w"), &st); err != nil || st.Size != 0 {
			t.Errorf("w's backing file after the failed restart: %d bytes, %v; want it empty, as while mounted", st.Size, err)
		}
		if _, err := os.Stat(counter); err != nil {
			t.Errorf("w's consumer counter after the failed restart: %v", err)
		}
		eventually(t, "the removed segment's block freed, w's alone on the device", func() (bool, string) {
			b, _ := gtLimbo(t, m)
			mem := m.stats(t)["gpu"].(map[string]any)["memory"].(map[string]any)
			return b == 0 && mem["Blocks"] == 1.0, fmt.Sprintf("limbo holds %d blocks, the device %v", b, mem)
		})
		m.restart(t, "")
		if got := gtSha256(t, seg); got != sha {
			t.Errorf("after the next restart w reads sha %s, want %s", got, sha)
		}
	}, "--gpu", "sim", "--allow-other")
}
