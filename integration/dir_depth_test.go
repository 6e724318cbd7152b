package integration

import (
	"encoding/json"
	"os"
	"strconv"
	"testing"
)

// chainDepth is how deep the test's chain of directories goes: deep
// enough that reopening it is thousands of descriptors, cheap enough to
// build in a few seconds.
const chainDepth = 2000

// deepChainScript, run as a user with a top directory, a directory for
// other names, and a depth, builds a chain of that many directories "d"
// below top (mkdirat, then openat of each from its parent's descriptor),
// makes the segment "w" at the bottom, pushes the chain out of the
// daemon's directory descriptor cache (1024 idle) by looking up a name in
// 2000 other directories, then opens and reads "w" through the descriptor
// of the bottom directory it kept. It prints what it found, as JSON.
const deepChainScript = `
import json, os, sys, time
top, others, depth = sys.argv[1], sys.argv[2], int(sys.argv[3])
fd = os.open(top, os.O_PATH | os.O_DIRECTORY)
for i in range(depth):
    os.mkdir("d", dir_fd=fd)
    sub = os.open("d", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
    os.close(fd)
    fd = sub
w = os.open("w", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd)
os.write(w, b"deep")
os.close(w)
made = os.stat("w", dir_fd=fd, follow_symlinks=False).st_ino
ofd = os.open(others, os.O_PATH | os.O_DIRECTORY)
for i in range(2000):
    os.mkdir(str(i), dir_fd=ofd)
os.close(ofd)
for i in range(2000):
    try:
        os.stat(others + "/" + str(i) + "/absent")
    except FileNotFoundError:
        pass
start = time.monotonic()
r = os.open("w", os.O_RDONLY, dir_fd=fd)
took = time.monotonic() - start
data = os.read(r, 16)
ino = os.fstat(r).st_ino
os.close(r)
try:
    os.stat("absent", dir_fd=fd)
    absent = "found"
except FileNotFoundError:
    absent = "ENOENT"
print(json.dumps({"made": made, "ino": ino, "data": data.decode(), "absent": absent, "open_seconds": took}))
`

// TestDeepChainAfterEviction (issue 24, K1): an unprivileged user's chain
// of directories thousands deep, pushed out of the daemon's directory
// descriptor cache, is reopened level by level without recursion: a
// segment at its bottom opens and reads what was written, a name absent
// there is ENOENT, and the daemon goes on serving another user and root.
func TestDeepChainAfterEviction(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		for _, dir := range []string{"shared/chain", "shared/others"} {
			if _, err := runAs(t, userA, "/", "mkdir", m.path(dir)); err != nil {
				t.Fatal(err)
			}
		}
		out := pythonAs(t, userA, "/", deepChainScript, m.path("shared/chain"), m.path("shared/others"), strconv.Itoa(chainDepth))
		var got struct {
			Made, Ino    uint64
			Data, Absent string
			OpenSeconds  float64 `json:"open_seconds"`
		}
		if err := json.Unmarshal([]byte(out), &got); err != nil {
			t.Fatalf("the chain's script printed %q: %v", out, err)
		}
		t.Logf("open at the bottom of a %d-deep chain after eviction: %.3fs", chainDepth, got.OpenSeconds)
		if got.Data != "deep" || got.Ino != got.Made || got.Absent != "ENOENT" {
			t.Errorf("at the bottom of the chain: read %q from inode %d (made %d), absent name %s; want \"deep\", the same inode, ENOENT",
				got.Data, got.Ino, got.Made, got.Absent)
		}

		if _, err := runAs(t, userB, "/", systemPython, "-c",
			"import sys; open(sys.argv[1], 'w').write('b'); assert open(sys.argv[1]).read() == 'b'", m.path("shared/b")); err != nil {
			t.Errorf("another user after the chain: %v", err)
		}
		if err := os.WriteFile(m.path("root"), []byte("root"), 0o600); err != nil {
			t.Errorf("root after the chain: %v", err)
		}
		if b, err := os.ReadFile(m.path("root")); err != nil || string(b) != "root" {
			t.Errorf("root reads %q, %v after the chain", b, err)
		}
		fds, _ := m.stats(t)["dir_fds"].(map[string]any)
		if open, max := fds["open"].(float64), fds["max"].(float64); max == 0 || open > max+16 {
			t.Errorf("root's stats after the chain: directory descriptors %v, want at most the cache's bound and a few in use", fds)
		}
	})
}
