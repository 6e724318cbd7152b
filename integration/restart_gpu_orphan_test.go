package integration

// A GPU segment removed while open, which only its open handles hold (no
// consumer counter), across tensorfs restart and a crash of the daemon
// (issue 27, DESIGN.md §12): its handles go on reading and writing the
// same device bytes, and its block leaves limbo at their last close.

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"path/filepath"
	"testing"
)

// rgoOpenerScript holds the GPU segment argv[1] open for reading and
// writing and answers, through that descriptor, "fill N" (writes
// rgoPattern(N)), "read N" (sha256 of its first N bytes) and "write OFF
// HEX".
const rgoOpenerScript = `
import hashlib, os, sys
f = os.open(sys.argv[1], os.O_RDWR)
print("ready")
for line in sys.stdin:
    cmd, *args = line.split()
    try:
        if cmd == "fill":
            os.pwrite(f, bytes((i * 7 + (i >> 9)) & 255 for i in range(int(args[0]))), 0)
            print("ok")
        elif cmd == "read":
            print("sha", hashlib.sha256(os.pread(f, int(args[0]), 0)).hexdigest())
        elif cmd == "write":
            os.pwrite(f, bytes.fromhex(args[1]), int(args[0]))
            print("ok")
    except OSError as e:
        print("error", e.strerror)
`

// TestRestartGPUOrphan: user A's GPU segment, removed while A holds it
// open, keeps its device bytes across tensorfs restart (twice) and a
// SIGKILL of the daemon: A's descriptor reads them and writes into them, limbo and
// its charge to A stay, and at its close the block is freed.
func TestRestartGPUOrphan(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		dir := usersGPUDir(t, m)
		seg := filepath.Join(dir, "orphan")
		const n = gtMiB + 3
		if out, err := runAs(t, userA, "/", "touch", seg); err != nil {
			t.Fatalf("user A makes a GPU segment: %v\n%s", err, out)
		}
		gtWantDevice(t, seg, "cuda:0")
		opener := startPythonAs(t, userA, "user A's opener", rgoOpenerScript, seg)
		opener.expect(t, "ready")
		if got := opener.do(t, fmt.Sprintf("fill %d", n)); got != "ok" {
			t.Fatalf("user A fills the segment: %q", got)
		}
		data := make([]byte, n)
		for i := range data {
			data[i] = byte(i*7 + i>>9)
		}
		if out, err := runAs(t, userA, "/", "rm", seg); err != nil {
			t.Fatalf("rm %s: %v\n%s", seg, err, out)
		}
		eventually(t, "the removed segment's block in limbo", gtLimboIs(t, m, 1, -n))
		_, held := gtLimbo(t, m)
		restart := func() { m.restart(t, "") }
		for i, handover := range []func(){restart, restart, func() { rgCrash(t, m) }} {
			what := []string{"after tensorfs restart", "after a second restart", "after the daemon's SIGKILL"}[i]
			handover()
			want := fmt.Sprintf("sha %x", sha256.Sum256(data))
			if got := opener.do(t, fmt.Sprintf("read %d", n)); got != want {
				t.Fatalf("%s: the open handle reads %q, want %q", what, got, want)
			}
			mark := []byte{0xc0 + byte(i), 0x1d}
			if got := opener.do(t, "write 4096 "+hex.EncodeToString(mark)); got != "ok" {
				t.Fatalf("%s: write through the open handle: %q", what, got)
			}
			copy(data[4096:], mark)
			want = fmt.Sprintf("sha %x", sha256.Sum256(data))
			if got := opener.do(t, fmt.Sprintf("read %d", n)); got != want {
				t.Errorf("%s: after a write the handle reads %q, want %q", what, got, want)
			}
			if b, bytes := gtLimbo(t, m); b != 1 || bytes != held {
				t.Errorf("%s: limbo holds %d blocks, %d bytes; want the removed segment's, 1 and %d", what, b, bytes, held)
			}
			if got := ledgerHeld(t, m, "GPU device memory in limbo", userA); got != 2*gtMiB {
				t.Errorf("%s: the ledger charges user A %d bytes of limbo, want %d", what, got, 2*gtMiB)
			}
		}
		opener.wait(t)
		gtWantLimboEmpty(t, m, "the removed segment's last close")
		if got := ledgerHeld(t, m, "GPU device memory in limbo", userA); got != 0 {
			t.Errorf("the ledger charges user A %d bytes of limbo once it is freed", got)
		}
	}, append([]string{"--allow-other"}, gtSim...)...)
}
