package integration

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
)

// loadCursorScript (argv: socket, a directory in the mount, its path
// relative to the mount root, segments per directory): on one connection,
// each case loads a directory of its own, changes it between the first
// request and the next, and goes on; it prints each case's names per
// reply and the errno that ended it, if one did.
const loadCursorScript = `
import errno, json, os, shutil, socket, sys
sock, top, rel, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.settimeout(20)
s.connect(sock)

def fill(path, prefix):
    os.makedirs(path)
    for i in range(n):
        with open(os.path.join(path, "%s%03d" % (prefix, i)), "wb") as f:
            f.write(b"x")

def request(path, after):
    r = {"v": 1, "op": "load", "path": path}
    if after:
        r["after"] = after
    s.send(json.dumps(r).encode())
    msg, anc, _, _ = s.recvmsg(1 << 17, socket.CMSG_SPACE(253 * 4))
    for _, _, blob in anc:
        for fd in memoryview(blob).cast("i"):
            os.close(fd)
    return json.loads(msg)

def load(case, change):
    d, path = os.path.join(top, case), rel + "/" + case
    got = {"replies": [], "errno": ""}
    after = None
    while True:
        r = request(path, after)
        if not r.get("ok"):
            got["errno"] = errno.errorcode.get(r.get("errno"), str(r.get("errno")))
            got["error"] = r.get("error", "")
            return got
        names = [x["name"] for x in r.get("segments", [])]
        got["replies"].append(names)
        if not r.get("more"):
            return got
        after = names[-1]
        if len(got["replies"]) == 1:
            change(d)

def changed(d):
    os.unlink(os.path.join(d, "old%03d" % (n - 2)))
    for name in ("a-new", "zzz-new"):
        open(os.path.join(d, name), "wb").close()

def renamed(d):
    os.rename(d, d + ".moved")

def replaced(d):
    os.rename(d, d + ".old")
    fill(d, "new")

def sub_replaced(d):
    shutil.rmtree(os.path.join(d, "m"))
    fill(os.path.join(d, "m"), "new")

out = {}
for case, change in (("changed", changed), ("renamed", renamed), ("replaced", replaced)):
    fill(os.path.join(top, case), "old")
    out[case] = load(case, change)
fill(os.path.join(top, "sub", "m"), "old")
out["sub_replaced"] = load("sub", sub_replaced)
out["again"] = load("replaced", lambda d: None)
print(json.dumps(out))
`

// TestLoadCursorDirectoryChanged: a load's requests after the first take
// the directories' names from the cursor the last one left on the
// connection, and a directory changed between them never makes a load
// list two directories as one. As an unprivileged uid, on one connection:
// entries removed and added meanwhile (the rest of the listing is the
// directory as first read, less what went), the directory renamed away
// (ENOENT), replaced by another (ESTALE), a subdirectory the load is in
// replaced (ESTALE), and then a new load of the replacement, which lists
// it whole.
func TestLoadCursorDirectoryChanged(t *testing.T) {
	t.Parallel()
	m := attackMount(t, "passthrough", true) // the socket does not depend on the mode
	const n = 300                            // two requests: a reply carries at most 253
	out := pythonAs(t, userA, "/", loadCursorScript, controlSocket(t, m), m.path("shared/cursor"), "shared/cursor", fmt.Sprint(n))
	var got map[string]struct {
		Replies [][]string
		Errno   string
		Error   string
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("%v: %q", err, out)
	}
	names := func(prefix string, skip ...int) []string {
		var s []string
		for i := range n {
			if !slices.Contains(skip, i) {
				s = append(s, fmt.Sprintf("%s%03d", prefix, i))
			}
		}
		return s
	}
	c := got["changed"]
	if want := names("old", n-2); c.Errno != "" || !slices.Equal(slices.Concat(c.Replies...), want) {
		t.Errorf("a load whose directory lost old%03d and gained a-new and zzz-new after its first reply: %v %s; want the directory as first read less old%03d, %v", n-2, c.Replies, c.Error, n-2, want)
	}
	for _, k := range []struct{ name, errno, prefix string }{
		{"renamed", "ENOENT", "old"},
		{"replaced", "ESTALE", "old"},
		{"sub_replaced", "ESTALE", "m/old"},
	} {
		c := got[k.name]
		if c.Errno != k.errno || len(c.Replies) != 1 {
			t.Errorf("%s between a load's requests: %d replies, then %q (%s); want one reply, then %s", k.name, len(c.Replies), c.Errno, c.Error, k.errno)
			continue
		}
		if first := c.Replies[0]; len(first) == 0 || !slices.Equal(first, names(k.prefix)[:len(first)]) {
			t.Errorf("%s: the first reply lists %v, want the first of %s000..", k.name, first, k.prefix)
		}
		if k.errno == "ESTALE" && !strings.Contains(c.Error, "load again") {
			t.Errorf("%s: the refusal says %q, want what to do", k.name, c.Error)
		}
	}
	if a := got["again"]; a.Errno != "" || !slices.Equal(slices.Concat(a.Replies...), names("new")) {
		t.Errorf("a new load of the replacement on the same connection: %d replies, %q %s; want every new name", len(a.Replies), a.Errno, a.Error)
	}
}
