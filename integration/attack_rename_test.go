package integration

// Attacks by rename: a user who exchanges or renames names in a shared
// directory while it opens or truncates its own reaches only the inode the
// kernel checked, and a NOCREATE directory takes no new name by rename.
// Each runs as an unprivileged user against a real mount, in both modes.

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// team is the group of the shared team directory of the rename races.
const team = 2000

// teamDir makes the team directory: root's, group team, mode 2775 (set-
// group-ID, no sticky bit), as a research group's shared directory is;
// userB keeps a 0600 secret in it, userA a file of its own.
func teamDir(t *testing.T, m *mount) (dir, secret, mine string) {
	t.Helper()
	dir = m.path("team")
	if err := os.Mkdir(dir, 0o775); err != nil {
		t.Fatal(err)
	}
	os.Chown(dir, 0, team)
	unix.Chmod(dir, 0o2775)
	secret, mine = filepath.Join(dir, "secret"), filepath.Join(dir, "mine")
	for _, f := range []struct {
		uid  int
		path string
		data string
		mode string
	}{{userB, secret, "B's secret, not A's", "600"}, {userA, mine, "A's own bytes here!", "644"}} {
		script := fmt.Sprintf("umask 077; printf %%s %q > %s && chmod %s %s", f.data, f.path, f.mode, f.path)
		if out, err := runInGroups(t, f.uid, []uint32{team}, "sh", "-c", script); err != nil {
			t.Fatalf("uid %d writes %s: %v\n%s", f.uid, f.path, err, out)
		}
	}
	return dir, secret, mine
}

// raceExchangeScript (argv: a, b, seconds, what) exchanges a and b with
// renameat2(RENAME_EXCHANGE) in one thread while, in the main thread, it
// opens a read-write and reads it, or truncates a to 4 bytes; it prints
// how many opens or truncates reached a file, and every distinct
// content it read.
const raceExchangeScript = `
import ctypes, json, os, sys, threading, time
a, b, secs, what = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
libc = ctypes.CDLL("libc.so.6", use_errno=True)
stop = time.time() + secs
def flip():
    while time.time() < stop:
        libc.renameat2(-100, a.encode(), -100, b.encode(), 2)  # RENAME_EXCHANGE
threading.Thread(target=flip, daemon=True).start()
n, seen = 0, set()
while time.time() < stop:
    try:
        if what == "open":
            fd = os.open(a, os.O_RDWR)
            seen.add(os.pread(fd, 64, 0).decode(errors="replace"))
            os.pwrite(fd, b"A", 0)
            os.close(fd)
        else:
            os.truncate(a, 4)
        n += 1
    except OSError:
        pass
print(json.dumps({"n": n, "seen": sorted(seen)}))
`

// TestAttackRenameExchangeOpen (F4): in a team directory, a user who
// exchanges its own file with another's 0600 file in a loop, while it
// opens its own read-write, never holds the other's file: every open
// reaches the inode the kernel checked (or is refused ESTALE and looked
// up again), in both modes.
func TestAttackRenameExchangeOpen(t *testing.T) {
	// Serial: the race keeps a CPU busy for its seconds. Its two modes
	// run at once, a second longer each than they ran one after the
	// other (they made a sixth fewer opens a second so): still as many
	// races tried, in 5 s rather than 8.
	forEachModeOnce(t, func(t *testing.T, mode string) {
		t.Parallel()
		m := attackMount(t, mode, true)
		_, secret, mine := teamDir(t, m)
		out, err := runInGroups(t, userA, []uint32{team}, systemPython, "-c", raceExchangeScript, mine, secret, "5", "open")
		if err != nil {
			t.Fatalf("race: %v\n%s", err, out)
		}
		var res struct {
			N    int
			Seen []string
		}
		if err := json.Unmarshal([]byte(out), &res); err != nil {
			t.Fatalf("race said %q: %v", out, err)
		}
		t.Logf("%d opens reached a file; contents seen: %q", res.N, res.Seen)
		if res.N == 0 {
			t.Errorf("no open reached a file: the race tested nothing")
		}
		for _, s := range res.Seen {
			if strings.Contains(s, "B's secret") {
				t.Errorf("uid %d read uid %d's 0600 file through its own name: %q", userA, userB, s)
			}
		}
		for _, p := range []string{secret, mine} { // the names may be swapped; the contents are what count
			b, _ := os.ReadFile(p)
			if strings.HasPrefix(string(b), "A") && strings.Contains(string(b), "secret") {
				t.Errorf("uid %d wrote into uid %d's file: %q", userA, userB, b)
			}
		}
		if got := readBOf(t, secret, mine); got != "B's secret, not A's" {
			t.Errorf("uid %d's secret reads %q after the race", userB, got)
		}
	})
}

// readBOf returns the content of whichever of the two files is userB's.
func readBOf(t *testing.T, paths ...string) string {
	t.Helper()
	for _, p := range paths {
		var st syscall.Stat_t
		if syscall.Stat(p, &st) == nil && st.Uid == userB {
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			return string(b)
		}
	}
	t.Fatalf("neither of %v is uid %d's any more", paths, userB)
	return ""
}

// TestAttackRenameExchangeTruncate (F4, truncate): the same race with
// truncate(2) of its own name never shrinks the other user's file.
func TestAttackRenameExchangeTruncate(t *testing.T) {
	// Serial, as TestAttackRenameExchangeOpen.
	forEachModeOnce(t, func(t *testing.T, mode string) {
		t.Parallel()
		m := attackMount(t, mode, true)
		_, secret, mine := teamDir(t, m)
		out, err := runInGroups(t, userA, []uint32{team}, systemPython, "-c", raceExchangeScript, mine, secret, "4", "truncate")
		if err != nil {
			t.Fatalf("race: %v\n%s", err, out)
		}
		t.Logf("race: %s", strings.TrimSpace(out))
		if got := readBOf(t, secret, mine); got != "B's secret, not A's" {
			t.Errorf("uid %d's secret reads %q after uid %d's truncate race", userB, got, userA)
		}
	})
}

// TestAttackExchangeIntoNoCreate (F7): a NOCREATE directory takes no new
// names from an exchange either: the user's file does not get in, and
// the sealed segment stays.
func TestAttackExchangeIntoNoCreate(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		sealed := m.path("sealed")
		if err := os.Mkdir(sealed, 0o1777); err != nil {
			t.Fatal(err)
		}
		unix.Chmod(sealed, 0o1777)
		if out, err := runAs(t, userA, "/", "sh", "-c", "printf sealed > "+sealed+"/x && printf mine > "+m.path("shared/mine")); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		run(t, "setfattr", "-n", "user.tensorfs.flags", "-v", "NOCREATE", sealed)
		// Either way round: the sealed name as the source or the target.
		for _, pair := range [][2]string{{m.path("shared/mine"), sealed + "/x"}, {sealed + "/x", m.path("shared/mine")}} {
			out, _ := runAs(t, userA, "/", systemPython, "-c", `
import ctypes, os, sys
libc = ctypes.CDLL("libc.so.6", use_errno=True)
r = libc.renameat2(-100, sys.argv[1].encode(), -100, sys.argv[2].encode(), 2)
print(r, ctypes.get_errno())`, pair[0], pair[1])
			if f := strings.Fields(out); len(f) != 2 || f[0] != "-1" || f[1] != strconv.Itoa(int(syscall.EPERM)) {
				t.Errorf("RENAME_EXCHANGE of %s and %s, into a NOCREATE directory: %q, want -1 EPERM", pair[0], pair[1], out)
			}
		}
		if b, _ := os.ReadFile(sealed + "/x"); string(b) != "sealed" {
			t.Errorf("the sealed directory's segment reads %q", b)
		}
	})
}

// TestAttackRenameWithinNoCreate (A12): a NOCREATE directory's names are
// sealed: a rename within it neither makes a new name nor replaces one.
func TestAttackRenameWithinNoCreate(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		nc := m.path("shared/nc")
		if out, err := runAs(t, userA, "/", "sh", "-c", "mkdir "+nc+" && printf x > "+nc+"/x && printf y > "+nc+"/y && setfattr -n user.tensorfs.flags -v NOCREATE "+nc); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		for _, to := range []string{"new-name", "y"} {
			if out, err := runAs(t, userA, "/", "mv", "-T", nc+"/x", nc+"/"+to); err == nil || !strings.Contains(out, "not permitted") {
				t.Errorf("mv x %s within a NOCREATE directory: %v %q, want EPERM", to, err, out)
			}
		}
		for name, want := range map[string]string{"x": "x", "y": "y"} {
			if b, err := os.ReadFile(nc + "/" + name); err != nil || string(b) != want {
				t.Errorf("%s reads %q (%v), want %q", name, b, err, want)
			}
		}
		if _, err := os.Stat(nc + "/new-name"); err == nil {
			t.Errorf("a new name appeared in the NOCREATE directory")
		}
	})
}
