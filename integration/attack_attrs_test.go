package integration

// Attacks on a segment's flags and tensor attributes. A user who may
// write another's segment may not set its flags (A10). The control
// socket's export and load hand a peer a descriptor of the backing file
// itself, on which the kernel lets every writer set user.* attributes
// directly (A11). The daemon's own state (flags, device) is out of their
// reach, and the tensor attributes a writer may forge there are checked
// whenever the daemon reads them: a restart on the same backing keeps the
// owner's segment, its flags and device, and serves no value the mount
// would refuse.

import (
	"encoding/json"
	"errors"
	"os"
	"regexp"
	"strings"
	"syscall"
	"testing"
)

// forgeScript connects to the socket argv[1], sends the request argv[2]
// (JSON) and sets, on the first descriptor it gets back, each attribute of
// argv[3] (a JSON list of [name, value]) with fsetxattr. It prints the
// reply and the errno of each fsetxattr as one JSON object.
const forgeScript = `
import array, json, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.send(sys.argv[2].encode())
data, anc, _, _ = s.recvmsg(1 << 20, socket.CMSG_SPACE(253 * 4), socket.MSG_CMSG_CLOEXEC)
fds = [fd for level, typ, d in anc if (level, typ) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
       for fd in array.array("i", d[:len(d) - len(d) % 4])]
out = {"reply": json.loads(data), "set": {}}
for name, value in json.loads(sys.argv[3]):
    try:
        os.setxattr(fds[0], name, value.encode())
        out["set"][name] = 0
    except (OSError, IndexError) as e:
        out["set"][name] = getattr(e, "errno", -1) or -1
print(json.dumps(out))
`

// forgeResult is what forgeScript prints.
type forgeResult struct {
	Reply struct {
		OK       bool `json:"ok"`
		Errno    int  `json:"errno"`
		Segments []struct {
			Name   string `json:"name"`
			Flags  string `json:"flags"`
			Dtype  string `json:"dtype"`
			Shape  string `json:"shape"`
			Stride string `json:"stride"`
			Offset string `json:"offset"`
		} `json:"segments"`
	} `json:"reply"`
	Set map[string]int `json:"set"`
}

// forge runs forgeScript as uid: request req, then the attributes attrs
// set on the first descriptor received.
func forge(t *testing.T, uid int, sock string, req map[string]any, attrs [][2]string) forgeResult {
	t.Helper()
	rb, _ := json.Marshal(req)
	ab, _ := json.Marshal(attrs)
	out := pythonAs(t, uid, "/", forgeScript, sock, string(rb), string(ab))
	var got forgeResult
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("uid %d printed %q: %v", uid, out, err)
	}
	if !got.Reply.OK {
		t.Fatalf("uid %d request %s: errno %d", uid, rb, got.Reply.Errno)
	}
	return got
}

// teamKeepFD makes, as userB, a KEEPFD directory shared/team that everyone
// may write (a team's exchange directory), and in it the segment w (0666,
// with bytes data) and the empty segment e (0666).
func teamKeepFD(t *testing.T, m *mount, data string) {
	t.Helper()
	team := m.path("shared/team")
	script := "mkdir " + team + " && chmod 777 " + team + " && setfattr -n user.tensorfs.flags -v KEEPFD " + team +
		" && printf %s '" + data + "' > " + team + "/w && touch " + team + "/e && chmod 666 " + team + "/w " + team + "/e"
	if out, err := runAs(t, userB, "/", "sh", "-c", script); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
}

// TestAttackForgedFlags (A11): a writer who is not the owner exports the
// owner's segments for writing and sets user.tensorfs.flags (UNLINK) and
// user.tensorfs.device on the backing files through the descriptors. At
// the next mount on the same backing, recovery keeps the segment with
// its bytes and flags, and the empty one is still a CPU segment its
// owner can write.
func TestAttackForgedFlags(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		sock := controlSocket(t, m)
		const data = "the owner bytes"
		teamKeepFD(t, m, data)
		w, e := m.path("shared/team/w"), m.path("shared/team/e")
		flags, err := getxattr(w, "user.tensorfs.flags")
		if err != nil {
			t.Fatal(err)
		}
		attrs := [][2]string{{"user.tensorfs.flags", "KEEPFD|UNLINK"}, {"user.tensorfs.device", "cuda:7"}}
		for _, name := range []string{"shared/team/w", "shared/team/e"} {
			got := forge(t, userA, sock, map[string]any{"v": 1, "op": "export", "path": name, "write": true}, attrs)
			t.Logf("uid %d fsetxattr on %s's descriptor: %v", userA, name, got.Set)
		}
		m.unmount(t, false)
		m = m.remount(t)

		if b, err := os.ReadFile(m.path("shared/team/w")); err != nil || string(b) != data {
			t.Fatalf("uid %d's segment after recovery: %q, %v; want %q", userB, b, err, data)
		}
		if v, err := getxattr(w, "user.tensorfs.flags"); err != nil || string(v) != string(flags) {
			t.Errorf("flags after recovery: %q, %v; want %q", v, err, flags)
		}
		for _, p := range []string{w, e} {
			if v, err := getxattr(p, "user.tensorfs.device"); err != nil || string(v) != "cpu" {
				t.Errorf("%s: device after recovery: %q, %v; want cpu", p, v, err)
			}
		}
		if out, err := runAs(t, userB, "/", "sh", "-c", "printf mine > "+e+" && cat "+e); err != nil || out != "mine" {
			t.Errorf("uid %d writes its empty segment after recovery: %q, %v", userB, out, err)
		}
		// The forged names are no state of the daemon's, nor served.
		if v, err := getxattr(w, "user.tensorfs.flags"); err == nil && strings.Contains(string(v), "UNLINK") {
			t.Errorf("flags served: %q", v)
		}
	})
}

// forgedDtypeLogged is the daemon's log line about a stored dtype it refused.
var forgedDtypeLogged = regexp.MustCompile(`fail validation.*user\.tensor\.dtype`)

// TestAttackForgedDtype (A11): a writer who is not the owner loads the
// owner's directory for writing and stores, through the descriptor,
// tensor attributes the mount refuses (EINVAL). After a restart on the
// same backing, none of them is served, through the mount or the
// socket's load, and the segment keeps its bytes; the daemon logs why.
func TestAttackForgedDtype(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		sock := controlSocket(t, m)
		const data = "0123456789abcdef"
		teamKeepFD(t, m, data)
		w := m.path("shared/team/w")
		if out, err := runAs(t, userB, "/", "sh", "-c", "setfattr -n user.tensor.dtype -v float32 "+w+" && setfattr -n user.tensor.shape -v '[4]' "+w); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		bad := [][2]string{
			{"user.tensor.dtype", "bogus"},
			{"user.tensor.shape", "[[4"},
			{"user.tensor.stride", "[-1]"},
			{"user.tensor.storage_offset", "-5"},
		}
		for _, a := range bad {
			if out, err := runAs(t, userA, "/", "setfattr", "-n", a[0], "-v", a[1], w); err == nil {
				t.Fatalf("the mount took %s=%q:\n%s", a[0], a[1], out)
			}
		}
		// load hands out the directory's segments in byte order: without
		// e, w's descriptor is the first.
		if err := os.Remove(m.path("shared/team/e")); err != nil {
			t.Fatal(err)
		}
		got := forge(t, userA, sock, map[string]any{"v": 1, "op": "load", "path": "shared/team", "write": true}, bad)
		for _, a := range bad {
			if got.Set[a[0]] != 0 {
				t.Logf("uid %d fsetxattr %s: errno %d", userA, a[0], got.Set[a[0]])
			}
		}
		m.unmount(t, false)
		m = m.remount(t)

		if b, err := os.ReadFile(w); err != nil || string(b) != data {
			t.Fatalf("uid %d's segment after recovery: %q, %v; want %q", userB, b, err, data)
		}
		for _, a := range bad {
			v, err := getxattr(w, a[0])
			if !errors.Is(err, syscall.ENODATA) {
				t.Errorf("%s after recovery: %q, %v; want no value (ENODATA)", a[0], v, err)
			}
		}
		if names, err := ccListxattr(w); err == nil {
			for _, n := range names {
				for _, a := range bad {
					if n == a[0] {
						t.Errorf("listxattr lists the forged %s", n)
					}
				}
			}
		}
		owner := forge(t, userB, sock, map[string]any{"v": 1, "op": "load", "path": "shared/team"}, [][2]string{})
		for _, s := range owner.Reply.Segments {
			if s.Dtype != "" || s.Shape != "" || s.Stride != "" || s.Offset != "" {
				t.Errorf("load serves %s with dtype %q shape %q stride %q offset %q; want none", s.Name, s.Dtype, s.Shape, s.Stride, s.Offset)
			}
		}
		m.logMatch(t, "a line about the forged dtype", forgedDtypeLogged)
	})
}

// TestAttackFlagsByWriter (A10): a user who may write another user's 0666
// segment in the sticky shared directory may not set or remove its flags:
// UNLINK would have the daemon remove, as root, a name the user may not.
func TestAttackFlagsByWriter(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		victim := m.path("shared/vict")
		if out, err := runAs(t, userB, "/", "sh", "-c", "touch "+victim+" && chmod 666 "+victim); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		script := "setfattr -n user.tensorfs.flags -v UNLINK " + victim + "; echo $?; " +
			"setfattr -x user.tensorfs.flags " + victim + "; echo $?; " +
			"cat " + victim + "; rm -f " + victim + "; echo $?"
		out, _ := runAs(t, userA, "/", "sh", "-c", script)
		if codes := strings.Fields(out); len(codes) < 3 || codes[0] == "0" || codes[1] == "0" {
			t.Errorf("uid %d set or removed the flags of uid %d's segment: %q (want both refused)", userA, userB, out)
		}
		fi, err := os.Stat(victim)
		if err != nil {
			t.Fatalf("the victim's segment is gone: %v", err)
		}
		if st := fi.Sys().(*syscall.Stat_t); st.Uid != userB {
			t.Errorf("%s is uid %d's now, want uid %d's", victim, st.Uid, userB)
		}
		if v, _ := getxattr(victim, "user.tensorfs.flags"); strings.Contains(string(v), "UNLINK") {
			t.Errorf("the victim's flags: %q", v)
		}
		// Its owner still may.
		if out, err := runAs(t, userB, "/", "setfattr", "-n", "user.tensorfs.flags", "-v", "UNLINK", victim); err != nil {
			t.Errorf("the owner sets UNLINK on its own segment: %v\n%s", err, out)
		}
	})
}
