package integration

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"tensorfs/alloc"
)

// The cluster never takes what it did not publish (issue 24, K3 and K4),
// on the test bed, as unprivileged users: alice (userA) publishes on
// node1; bob (userB) keeps his own objects on node2.

// mapperScript maps the first page of the file argv[1] read-write and
// shared with libc (Python's mmap keeps a descriptor of its own), closes
// its descriptor and says "mapped"; then a line unmaps it ("unmapped").
const mapperScript = `
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
fd = os.open(sys.argv[1], os.O_RDWR)
addr = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
os.close(fd)
if addr == ctypes.c_void_p(-1).value:
    sys.exit("mmap: " + os.strerror(ctypes.get_errno()))
print("mapped")
for line in sys.stdin:
    libc.munmap(addr, mmap.PAGESIZE)
    print("unmapped")
`

// asUserOK runs a shell command as uid and fails the test if it fails.
func asUserOK(t *testing.T, uid int, script string) {
	t.Helper()
	if out, err := runAs(t, uid, "/", "sh", "-c", script); err != nil {
		t.Fatalf("as uid %d: %s: %v\n%s", uid, script, err, out)
	}
}

// objectState is what a test checks stays as it was: owner, mode, user.mine,
// and the names in a directory or the bytes of a file.
func objectState(t *testing.T, p string) string {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	mine, _ := getxattr(p, "user.mine")
	s := fmt.Sprintf("uid %d mode %v user.mine %q", fi.Sys().(*syscall.Stat_t).Uid, fi.Mode(), mine)
	if fi.IsDir() {
		ents, _ := os.ReadDir(p)
		for _, e := range ents {
			s += " " + e.Name()
		}
	} else {
		b, _ := os.ReadFile(p)
		s += fmt.Sprintf(" %q", b)
	}
	return s
}

// TestClusterOwnership reproduces K3 and K4 on a three-node test bed.
//
// K3: where bob keeps a private directory on node2 (the published
// directory itself, an intermediate directory of its path) or a segment
// (in a published directory node2 made, 0777), alice's publish changes
// nothing of his: node2 leaves it alone, logs it, and lists it in
// user.tensorfs.cluster's conflicts; her published directories are made
// where their names are free.
//
// K4: alice maps bob's 0666 segment writable and closes the descriptor
// (passthrough releases the FUSE handle): bob's publish is EBUSY naming
// her process; unmapped, it publishes and she may write it no more. Its
// bytes changed afterwards by root through node1's backing are found by
// their hashes: node1 serves none of them, and node3 pulls the published
// bytes from node2.
func TestClusterOwnership(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 3)
	n1, n2, n3 := tb.node(1), tb.node(2), tb.node(3)
	for _, n := range []string{n1, n2, n3} {
		if err := os.Mkdir(filepath.Join(n, "scratch"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(filepath.Join(n, "scratch"), 0o777|os.ModeSticky); err != nil {
			t.Fatal(err)
		}
	}
	publish := func(uid int, dir string) string {
		t.Helper()
		out, err := tb.tensorfs(uid, "publish", dir)
		if err != nil {
			t.Fatalf("uid %d: tensorfs publish %s: %v\n%s", uid, dir, err, out)
		}
		return versionOf(t, out)
	}
	leftAlone := func(k int, path string) {
		t.Helper()
		eventually(t, fmt.Sprintf("node%d leaves %s alone", k, path), func() (bool, string) {
			l := lastLine(tb.log(k), "a published name is left alone")
			return strings.Contains(l, "why=\""+path+":"), tail(tb.log(k))
		})
	}

	t.Run("K3", func(t *testing.T) {
		// bob's, on node2: scratch/work (the directory alice publishes)
		// and scratch/bobpriv (on the path of one she publishes).
		asUserOK(t, userB, fmt.Sprintf("mkdir -m 0700 %[1]s/scratch/work %[1]s/scratch/bobpriv && printf bob-weights > %[1]s/scratch/work/w && setfattr -n user.mine -v bob %[1]s/scratch/work", n2))
		work, priv := filepath.Join(n2, "scratch/work"), filepath.Join(n2, "scratch/bobpriv")
		before := map[string]string{work: objectState(t, work), work + "/w": objectState(t, work+"/w"), priv: objectState(t, priv)}

		asUserOK(t, userA, fmt.Sprintf("mkdir -m 0777 %[1]s/scratch/work %[1]s/scratch/bobpriv && mkdir -m 0777 %[1]s/scratch/bobpriv/x && printf alice > %[1]s/scratch/work/w && printf alice > %[1]s/scratch/bobpriv/x/w", n1))
		publish(userA, filepath.Join(n1, "scratch/work"))
		leftAlone(2, "scratch/work")
		publish(userA, filepath.Join(n1, "scratch/bobpriv/x"))
		leftAlone(2, "scratch/bobpriv")
		// node3 had none of bob's: both are made there, alice's.
		for _, dir := range []string{"scratch/work", "scratch/bobpriv/x"} {
			eventually(t, "node3 makes "+dir, func() (bool, string) {
				fi, err := os.Stat(filepath.Join(n3, dir))
				return err == nil && fi.Sys().(*syscall.Stat_t).Uid == userA && fi.Mode().Perm() == 0o777, fmt.Sprint(fi, err)
			})
		}

		// A directory node2 makes, 0777: bob's segment there keeps its
		// name when alice's next version has one of her own at it.
		asUserOK(t, userA, fmt.Sprintf("mkdir -m 0777 %[1]s/scratch/shared && printf v1 > %[1]s/scratch/shared/f", n1))
		v1 := publish(userA, filepath.Join(n1, "scratch/shared"))
		waitVersion(t, filepath.Join(n2, "scratch/shared"), v1)
		asUserOK(t, userB, fmt.Sprintf("printf bob > %s/scratch/shared/w", n2))
		shared := filepath.Join(n2, "scratch/shared/w")
		before[shared] = objectState(t, shared)
		asUserOK(t, userA, fmt.Sprintf("printf alice > %s/scratch/shared/w", n1))
		v2 := publish(userA, filepath.Join(n1, "scratch/shared"))
		eventually(t, "node2 lists bob's segment as a conflict", func() (bool, string) {
			raw, err := getxattr(filepath.Join(n2, "scratch/shared"), alloc.AttrCluster)
			return err == nil && strings.Contains(string(raw), v2) && strings.Contains(string(raw), `"conflicts":["scratch/shared/w"]`), string(raw)
		})

		for p, was := range before {
			if now := objectState(t, p); now != was {
				t.Errorf("%s on node2 changed: %s, was %s", p, now, was)
			}
		}
		if out, err := runAs(t, userB, "/", "cat", work+"/w"); err != nil || out != "bob-weights" {
			t.Errorf("bob reads his own segment on node2: %q %v", out, err)
		}
		if out, err := runAs(t, userA, "/", "ls", work); err == nil {
			t.Errorf("alice lists bob's private directory on node2: %q", out)
		}
	})

	t.Run("K4", func(t *testing.T) {
		dir := filepath.Join(n1, "scratch/k4")
		seg := filepath.Join(dir, "w")
		asUserOK(t, userB, fmt.Sprintf("mkdir -m 0755 %s && head -c 1048576 /dev/urandom > %s && chmod 0666 %s", dir, seg, seg))
		want, err := os.ReadFile(seg)
		if err != nil {
			t.Fatal(err)
		}
		m := startPythonAs(t, userA, "mapper", mapperScript, seg)
		m.expect(t, "mapped")
		// The kernel releases the closed descriptor's FUSE handle
		// (passthrough) after close returns: until then the handle names
		// her process, from then on her mapping.
		eventually(t, "bob's publish is EBUSY, naming alice's mapping", func() (bool, string) {
			out, err := tb.tensorfs(userB, "publish", dir)
			if err == nil {
				t.Fatalf("bob publishes a segment alice maps writable: %q", out)
			}
			return strings.Contains(out, "busy") && strings.Contains(out, fmt.Sprintf("pid %d (python3) maps it writable", m.cmd.Process.Pid)), out
		})
		if got := m.do(t, "unmap"); got != "unmapped" {
			t.Fatalf("mapper: %q", got)
		}
		v := publish(userB, dir)
		if out, err := runAs(t, userA, "/", "sh", "-c", "printf MALLORY > "+seg); err == nil {
			t.Errorf("alice writes bob's published segment: %q", out)
		}
		m.wait(t)

		// node2 pulls it and leaves; node1's copy goes bad behind its
		// daemon's back; node3 pulls while node1 alone holds it, then
		// node2 comes back with its copy.
		waitVersion(t, filepath.Join(n2, "scratch/k4"), v)
		tb.must("pull", filepath.Join(n2, "scratch/k4"))
		tb.must("unmount", n2)
		h, err := getxattr(seg, alloc.AttrHandle)
		if err != nil {
			t.Fatal(err)
		}
		f, err := os.OpenFile(string(h), os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt([]byte("MALLORY-WAS-HERE"), 100); err != nil {
			t.Fatal(err)
		}
		f.Close()
		waitVersion(t, filepath.Join(n3, "scratch/k4"), v)
		done := make(chan error, 1)
		go func() {
			out, err := tb.tensorfs(0, "pull", filepath.Join(n3, "scratch/k4"))
			if err != nil {
				err = fmt.Errorf("%w: %s", err, out)
			}
			done <- err
		}()
		eventually(t, "node1 serves no piece that fails verification", func() (bool, string) {
			return strings.Contains(tb.log(1), "a piece held here fails verification; it is not served"), tail(tb.log(1))
		})
		tb.mount(2)
		if err := <-done; err != nil {
			t.Fatalf("node3's pull: %v\n%s", err, tail(tb.log(3)))
		}
		sameFiles(t, filepath.Join(n3, "scratch/k4"), map[string][]byte{"w": want})
		if strings.Contains(tb.log(3), "piece failed verification") {
			t.Errorf("node3 received bytes that fail verification:\n%s", tail(tb.log(3)))
		}
		if got, _ := os.ReadFile(filepath.Join(n3, "scratch/k4/w")); bytes.Contains(got, []byte("MALLORY")) || !slices.Equal(got, want) {
			t.Error("node3's segment does not hold the published bytes")
		}
	})
}
