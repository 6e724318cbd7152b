package integration

// Replies carry what stat shows at that moment (pjdfstest open/00.t,
// chmod/00.t, chown/05.t, open/06.t). The kernel caches the attributes of
// every CREATE, MKDIR, MKNOD, SYMLINK, LINK and TMPFILE reply for the
// attribute timeout, so what a user makes must be reported as theirs at
// once: an lstat right after, and the kernel's own owner checks (a rename
// in a sticky directory, chmod, chown), see the reply. The daemon runs as
// root and gives each new object to its caller after making it; a reply
// filled before that showed root's.

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"golang.org/x/sys/unix"
)

// attrReplyScript does, as the user who runs it, each operation in
// sys.argv[2] (comma-separated) in the directory sys.argv[1], and prints
// as JSON what an lstat right after each shows (owner, group, mode, size,
// links), or what an owner's request right after a create answers.
const attrReplyScript = `
import ctypes, errno, json, os, stat, subprocess, sys
d, ops = sys.argv[1], sys.argv[2].split(",")
libc = ctypes.CDLL(None, use_errno=True)
os.umask(0o022)
def look(p):
    s = os.lstat(p)
    return [s.st_uid, s.st_gid, oct(s.st_mode), s.st_size, s.st_nlink]
def answer(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
def create(p, mode=0o640):
    os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode))
def tmpfile(p, mode):
    fd = os.open(d, os.O_TMPFILE | os.O_RDWR, mode)
    if mode & 0o6000:
        # Set-id bits go at the first write on tmpfs, at the open for
        # writing on tensorfs (passthrough writes never reach the daemon:
        # DESIGN.md section 9): compare them once written.
        os.write(fd, b"x")
    s = os.fstat(fd)
    seen = [s.st_uid, s.st_gid, oct(s.st_mode), s.st_size, s.st_nlink]
    # linkat(AT_SYMLINK_FOLLOW) of the descriptor's /proc link names it
    if libc.linkat(-100, b"/proc/self/fd/%d" % fd, -100, p.encode(), 0x400) != 0:
        raise OSError(ctypes.get_errno(), "linkat", p)
    os.close(fd)
    return [seen, look(p)]
out = {}
for op in ops:
    p = os.path.join(d, op)
    if op == "create":
        fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)
        out[op] = look(p)
        os.write(fd, b"hi\n")
        os.close(fd)
        out[op + " written"] = look(p)
    elif op == "create-setuid":
        # Not for writing: tmpfs and tensorfs both keep the set-id bit.
        os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDONLY, 0o4750))
        out[op] = look(p)
    elif op == "mkdir":
        os.mkdir(p, 0o750)
        out[op] = look(p)
    elif op == "mknod":
        os.mknod(p, stat.S_IFREG | 0o640)
        out[op] = look(p)
    elif op == "mkfifo":
        os.mkfifo(p, 0o640)
        out[op] = look(p)
    elif op == "symlink":
        os.symlink("target", p)
        out[op] = look(p)
    elif op == "link":
        create(p + ".src")
        os.link(p + ".src", p)
        out[op] = look(p)
    elif op == "tmpfile":
        out[op] = tmpfile(p, 0o640)
    elif op == "tmpfile-setuid":
        out[op] = tmpfile(p, 0o4750)
    elif op == "rename":
        create(p)
        out[op] = answer(lambda: os.rename(p, p + ".moved"))
    elif op == "shell-mv":
        sh = 'echo hi > "$1" && mv "$1" "$1.moved"'
        out[op] = subprocess.run(["sh", "-c", sh, "sh", p], stderr=subprocess.DEVNULL).returncode
    elif op == "chmod":
        create(p)
        out[op] = [answer(lambda: os.chmod(p, 0o600)), look(p)]
    elif op == "chown":
        create(p)
        out[op] = [answer(lambda: os.chown(p, os.getuid(), os.getgid())), look(p)]
print(json.dumps(out, sort_keys=True))
`

// attrReplyOps are the operations of attrReplyScript, in any directory;
// segmentOps are those that make or act on a regular file by create,
// which SHARED and cuda:0 directories make segments of their kind (link,
// mknod and O_TMPFILE of those are their own matter: EXDEV, EOPNOTSUPP).
const (
	attrReplyOps = "create,create-setuid,mkdir,mknod,mkfifo,symlink,link,tmpfile,tmpfile-setuid,rename,shell-mv,chmod,chown"
	segmentOps   = "create,create-setuid,mkdir,mkfifo,symlink,rename,shell-mv,chmod,chown"
)

// attrReplies runs attrReplyScript as userA in dir and decodes its answer.
func attrReplies(t *testing.T, dir, ops string) map[string]any {
	t.Helper()
	var got map[string]any
	out := pythonAs(t, userA, "/", attrReplyScript, dir, ops)
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	return got
}

// attrDirs makes in top a sticky 1777 directory of root's and one userA
// owns, and returns them by name.
func attrDirs(t *testing.T, top string) map[string]string {
	t.Helper()
	dirs := map[string]string{"sticky": filepath.Join(top, "sticky"), "own": filepath.Join(top, "own")}
	for name, d := range dirs {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		var err error
		if name == "sticky" {
			err = os.Chmod(d, 0o777|os.ModeSticky)
		} else {
			err = os.Chown(d, userA, userA)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	return dirs
}

// TestAttrRepliesAsOnTmpfs: as a user, in a sticky 1777 directory and in
// one of their own, and in a SHARED and a cuda:0 directory of theirs,
// whatever is made is seen at once with the owner, group, mode, size and
// links tmpfs shows, and its owner may rename, chmod and chown it at once.
func TestAttrRepliesAsOnTmpfs(t *testing.T) {
	t.Parallel()
	ref, err := os.MkdirTemp("/dev/shm", "tensorfs-attr-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(ref) })
	if err := os.Chmod(ref, 0o755); err != nil {
		t.Fatal(err)
	}
	want := map[string]map[string]any{}
	for name, d := range attrDirs(t, ref) {
		want[name] = attrReplies(t, d, attrReplyOps)
	}
	if c, _ := want["sticky"]["create"].([]any); len(c) == 0 || c[0] != float64(userA) {
		t.Fatalf("on tmpfs a create by uid %d shows %v: the test is wrong", userA, want["sticky"]["create"])
	}
	wantSegments := attrReplies(t, attrDirs(t, filepath.Join(ref, "own"))["own"], segmentOps)
	forEachModeOnce(t, func(t *testing.T, mode string) {
		disk := filepath.Join(t.TempDir(), "disk")
		if err := os.Mkdir(disk, 0o700); err != nil {
			t.Fatal(err)
		}
		m := mountFS(t, mode, "--allow-other", "--disk", disk, "--gpu", "sim")
		reachable(t, m.dir)
		for name, d := range attrDirs(t, m.dir) {
			compareReplies(t, name, attrReplies(t, d, attrReplyOps), want[name])
		}
		for kind, attr := range map[string][2]string{"shared": {"user.tensorfs.flags", "SHARED"}, "cuda": {"user.tensorfs.device", "cuda:0"}} {
			top := m.path(kind)
			if err := os.Mkdir(top, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := unix.Setxattr(top, attr[0], []byte(attr[1]), 0); err != nil {
				t.Fatal(err)
			}
			d := attrDirs(t, top)["own"] // inherits the flag or device
			compareReplies(t, kind, attrReplies(t, d, segmentOps), wantSegments)
		}
	})
}

// compareReplies fails the test for each operation whose answer in the
// directory named where differs from tmpfs's.
func compareReplies(t *testing.T, where string, got, want map[string]any) {
	t.Helper()
	for op, w := range want {
		if !reflect.DeepEqual(got[op], w) {
			t.Errorf("%s: %s shows %v, tmpfs %v", where, op, got[op], w)
		}
	}
}
