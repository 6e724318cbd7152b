package integration

import (
	"encoding/json"
	"testing"
)

// loadSwapScript (argv: socket, directory, its path in the mount): a child
// puts a FIFO and a new file at the name s7 in turn, as fast as it can,
// while the parent loads the directory over and over; each reply must
// come (a socket timeout fails it) and hand out regular files only.
const loadSwapScript = `
import errno, json, os, socket, stat, sys, time
sock, d, rel = sys.argv[1:4]
child = os.fork()
if child == 0:
    end = time.time() + 1.5
    while time.time() < end:
        os.mkfifo(os.path.join(d, "x"))
        os.rename(os.path.join(d, "x"), os.path.join(d, "s7"))
        with open(os.path.join(d, "y"), "wb") as f:
            f.write(b"new")
        os.rename(os.path.join(d, "y"), os.path.join(d, "s7"))
    os._exit(0)
got = {"ok": 0, "errnos": {}, "not_regular": 0}
while os.waitpid(child, os.WNOHANG) == (0, 0):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(20)
    s.connect(sock)
    s.send(json.dumps({"v": 1, "op": "load", "path": rel}).encode())
    msg, anc, _, _ = s.recvmsg(1 << 20, socket.CMSG_SPACE(253 * 4))
    s.close()
    r = json.loads(msg)
    fds = [fd for _, _, blob in anc for fd in memoryview(blob).cast("i")]
    for fd in fds:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            got["not_regular"] += 1
        os.close(fd)
    if r.get("ok"):
        got["ok"] += 1
    else:
        e = errno.errorcode.get(r.get("errno"), str(r.get("errno")))
        got["errnos"][e] = got["errnos"].get(e, 0) + 1
        got.setdefault("why", {})[e] = r.get("error", "")
print(json.dumps(got))
`

// TestAttackLoadSwapsFIFO: a load opens each segment again by its name in
// the directory it walks (alloc.Ref.OpenAt). A user who keeps putting a
// FIFO and another file at a segment's name while loading never makes
// the daemon wait on the FIFO or hand out anything but a regular file,
// and a load fails only as it did before OpenAt: the uid's descriptor
// quota (EAGAIN: the loads come as fast as the daemon answers), or ENOENT
// or ESTALE where it read a moved name's attributes through the node the
// kernel knows at that name (a name whose descriptor OpenAt could not
// reopen falls back to /proc/self/fd and serves the segment found).
func TestAttackLoadSwapsFIFO(t *testing.T) {
	t.Parallel()
	m := attackMount(t, "passthrough", true)
	d := m.path("shared/swap")
	pythonAs(t, userA, "/", `
import os, sys
os.mkdir(sys.argv[1])
for i in range(50):
    with open(os.path.join(sys.argv[1], "s%d" % i), "wb") as f:
        f.write(b"x" * 64)
`, d)
	out := pythonAs(t, userA, "/", loadSwapScript, controlSocket(t, m), d, "shared/swap")
	var got struct {
		OK         int
		Errnos     map[string]int
		Why        map[string]string
		NotRegular int `json:"not_regular"`
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("%v: %q", err, out)
	}
	t.Logf("loads while s7 was swapped: %s", out)
	if got.NotRegular != 0 {
		t.Errorf("%d descriptors handed out were not regular files", got.NotRegular)
	}
	for e, n := range got.Errnos {
		if e != "EAGAIN" && e != "ENOENT" && e != "ESTALE" {
			t.Errorf("%d loads failed %s (%s), want success, EAGAIN, ENOENT or ESTALE", n, e, got.Why[e])
		}
	}
	if got.OK == 0 {
		t.Error("no load succeeded")
	}
}
