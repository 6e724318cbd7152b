package fs

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"syscall"
	"testing"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ctl"
	"tensorfs/gpu"
	"tensorfs/internal/tmpfstest"
)

// The operation matrix: every request go-fuse can route to a
// filesystem (every method of fuse.RawFileSystem), on every kind of node
// (the root, a directory, a SHARED and a cuda:0 directory, a segment of
// each storage kind and an unavailable one, a symbolic link, a FIFO),
// through go-fuse's own bridge as the kernel would drive it, without a
// mount, as root and as a user who made the nodes. Each cell says what
// tensorfs answers; a method that is not in the table fails the test, so
// that a request go-fuse learns to route is classified before it is
// served. Every reply that carries attributes is checked against a stat
// of the backing made after it (opsFS.checkAttr).

// opKinds are the matrix's columns.
var opKinds = []string{"root", "dir", "sdir", "gdir", "host", "shared", "imported", "device", "pulled", "unavailable", "symlink", "fifo"}

// segmentKinds are the columns that are segments.
var segmentKinds = map[string]bool{"host": true, "shared": true, "imported": true, "device": true, "pulled": true, "unavailable": true}

// dirKinds are the columns that are directories.
var dirKinds = map[string]bool{"root": true, "dir": true, "sdir": true, "gdir": true}

// readOnlyKinds are the segment kinds opened read-only.
var readOnlyKinds = map[string]bool{"imported": true, "pulled": true}

// opsFS is a filesystem with one node of every kind, driven through the
// bridge by who, who made them.
type opsFS struct {
	t    *testing.T
	fsys *filesystem
	raw  fuse.RawFileSystem
	who  fuse.Owner
	// ids are the node ids of the kinds; parents and names say where
	// each is.
	ids     map[string]uint64
	parents map[string]uint64
	// paths are the backing paths of the nodes by id, relative to the
	// backing's root ("." for the root).
	paths map[uint64]string
	// imported is the file whose bytes the imported segment is.
	imported *os.File
	next     int
}

// na marks a cell the kernel cannot ask: the request needs an open
// handle, and a node of that kind is never opened.
const na = fuse.Status(-1)

// void marks a request without a reply (FORGET, RELEASE).
const void = fuse.Status(-2)

// hdr is a request of root's about node.
func hdr(node uint64) fuse.InHeader {
	return fuse.InHeader{NodeId: node, Caller: fuse.Caller{Owner: fuse.Owner{Uid: 0, Gid: 0}, Pid: uint32(os.Getpid())}}
}

// hdr is a request of x.who's about node.
func (x *opsFS) hdr(node uint64) fuse.InHeader {
	h := hdr(node)
	h.Owner = x.who
	return h
}

// newOpsFS makes the filesystem of newOpsFSAs for root.
func newOpsFS(t *testing.T) *opsFS { return newOpsFSAs(t, fuse.Owner{}) }

// newOpsFSAs makes the filesystem: a --disk directory for SHARED
// segments, a simulated device, and one node of each kind, made by who
// (through the bridge, or as the daemon would have made it).
func newOpsFSAs(t *testing.T, who fuse.Owner) *opsFS {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("the operation matrix sets owners and trusted attributes: it needs root")
	}
	top := tmpfstest.Dir(t)
	os.Chmod(top, 0o700)
	backing := filepath.Join(top, "backing")
	os.Mkdir(backing, 0o755)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	store, err := alloc.Open(alloc.Config{Backing: backing, Disk: filepath.Join(top, "disk")}, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	fsys, err := newFilesystem(Options{Store: store, Log: log, Mountpoint: filepath.Join(top, "mnt"), GPU: gpu.NewSim(0, 1<<30)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fsys.close)
	if who.Uid != 0 { // a user's nodes in a shared sticky root, as in /tmp
		fsys.allowOther = true
		if err := os.Chmod(backing, 0o1777); err != nil {
			t.Fatal(err)
		}
	}
	x := &opsFS{t: t, fsys: fsys, who: who, ids: map[string]uint64{"root": fuse.FUSE_ROOT_ID}, parents: map[string]uint64{},
		paths: map[uint64]string{fuse.FUSE_ROOT_ID: "."}}
	// As Mount does: requests are counted on their way to the bridge.
	x.raw = &countingFS{RawFileSystem: fusefs.NewNodeFS(fsys.root, &fusefs.Options{}), c: &fsys.requests}

	x.ids["dir"] = x.mkdir(1, "dir")
	x.ids["host"] = x.segment(1, "host")
	sdir := x.mkdir(1, "sdir")
	x.setxattr(sdir, alloc.AttrFlags, "SHARED")
	x.ids["sdir"] = sdir
	x.ids["shared"] = x.segment(sdir, "shared")
	x.parents["shared"] = sdir
	gdir := x.mkdir(1, "gdir")
	x.setxattr(gdir, alloc.AttrDevice, "cuda:0")
	x.ids["gdir"] = gdir
	x.ids["device"] = x.segment(gdir, "device")
	x.parents["device"] = gdir
	x.imported = memfd(t, "imported bytes")
	peer := ctl.Cred{Pid: int32(os.Getpid()), Uid: who.Uid, Gid: who.Gid}
	if err := (controlBackend{fsys}).Import(peer, "imported", x.imported, "uint8", ""); err != nil {
		t.Fatal(err)
	}
	x.ids["imported"] = x.lookup(1, "imported")
	x.ids["pulled"] = x.lookup(1, x.made(pulledSegment(t, fsys, "pulled")))
	x.ids["unavailable"] = x.lookup(1, x.made(unavailableSegment(t, fsys, "unavailable")))
	var out fuse.EntryOut
	if st := x.raw.Symlink(nil, ptr(x.hdr(1)), "host", "symlink", &out); st != fuse.OK {
		t.Fatalf("symlink: %v", st)
	}
	x.ids["symlink"] = x.entry(1, "symlink", &out)
	if st := x.raw.Mknod(nil, &fuse.MknodIn{InHeader: x.hdr(1), Mode: syscall.S_IFIFO | 0o644}, "fifo", &out); st != fuse.OK {
		t.Fatalf("mknod fifo: %v", st)
	}
	x.ids["fifo"] = x.entry(1, "fifo", &out)
	return x
}

// made gives name, made in the backing's root by the test, to x.who, as
// the daemon gives what it makes to its caller, and returns name.
func (x *opsFS) made(name string) string {
	if err := os.Chown(filepath.Join(x.fsys.store.Dir, name), int(x.who.Uid), int(x.who.Gid)); err != nil {
		x.t.Fatal(err)
	}
	return name
}

// unavailableSegment makes name in the root an empty segment on a device
// the mount does not serve (cuda:1: the simulated device is cuda:0), as
// a mount with another GPU left it, and returns name.
func unavailableSegment(t *testing.T, fsys *filesystem, name string) string {
	t.Helper()
	p := filepath.Join(fsys.store.Dir, name)
	if err := os.WriteFile(p, nil, 0o640); err != nil {
		t.Fatal(err)
	}
	if err := alloc.StoreDevice(p, "cuda:1"); err != nil {
		t.Fatal(err)
	}
	return name
}

// pulledSegment makes name in the root a complete pulled segment of 8
// bytes, as recovery finds one, and returns name.
func pulledSegment(t *testing.T, fsys *filesystem, name string) string {
	t.Helper()
	p := filepath.Join(fsys.store.Dir, name)
	if err := os.WriteFile(p, []byte("8 bytes!"), 0o644); err != nil {
		t.Fatal(err)
	}
	mk := alloc.Marker{Kind: alloc.Pulled, Content: strings.Repeat("ab", 32), Size: 8, Complete: true}
	if err := alloc.MarkPulled(p, mk); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		t.Fatal(err)
	}
	fsys.pulled.add(st.Ino, mk)
	return name
}

func ptr[T any](v T) *T { return &v }

func (x *opsFS) mkdir(parent uint64, name string) uint64 {
	var out fuse.EntryOut
	if st := x.raw.Mkdir(nil, &fuse.MkdirIn{InHeader: x.hdr(parent), Mode: 0o755}, name, &out); st != fuse.OK {
		x.t.Fatalf("mkdir %s: %v", name, st)
	}
	return x.entry(parent, name, &out)
}

// segment makes a segment of 8 bytes.
func (x *opsFS) segment(parent uint64, name string) uint64 {
	var out fuse.CreateOut
	if st := x.raw.Create(nil, &fuse.CreateIn{InHeader: x.hdr(parent), Flags: unix.O_RDWR, Mode: 0o644}, name, &out); st != fuse.OK {
		x.t.Fatalf("create %s: %v", name, st)
	}
	x.entry(parent, name, &out.EntryOut)
	if _, st := x.raw.Write(nil, &fuse.WriteIn{InHeader: x.hdr(out.NodeId), Fh: out.Fh}, []byte("8 bytes!")); st != fuse.OK {
		x.t.Fatalf("write %s: %v", name, st)
	}
	x.raw.Release(nil, &fuse.ReleaseIn{InHeader: x.hdr(out.NodeId), Fh: out.Fh})
	return out.NodeId
}

func (x *opsFS) lookup(parent uint64, name string) uint64 {
	var out fuse.EntryOut
	if st := x.raw.Lookup(nil, ptr(x.hdr(parent)), name, &out); st != fuse.OK {
		x.t.Fatalf("lookup %s: %v", name, st)
	}
	return x.entry(parent, name, &out)
}

// entry records where the node of a reply about name in parent is, checks
// the reply's attributes against the backing, and returns its id.
func (x *opsFS) entry(parent uint64, name string, out *fuse.EntryOut) uint64 {
	x.paths[out.NodeId] = filepath.Join(x.paths[parent], name)
	x.checkAttr("entry of "+name, out.NodeId, &out.Attr)
	return out.NodeId
}

func (x *opsFS) setxattr(node uint64, attr, v string) {
	if st := x.raw.SetXAttr(nil, &fuse.SetXAttrIn{InHeader: x.hdr(node), Size: uint32(len(v))}, attr, []byte(v)); st != fuse.OK {
		x.t.Fatalf("setxattr %s: %v", attr, st)
	}
}

// checkAttr fails the test unless a reply's attributes about node show
// what a stat of its backing shows now: its inode, and the owner, group,
// mode and size of where they live (the disk file of a SHARED segment,
// the sender's file's size for an imported one, the device memory's
// size for a device one).
func (x *opsFS) checkAttr(what string, node uint64, a *fuse.Attr) {
	x.t.Helper()
	want, err := x.backingStat(node, a.Ino)
	if err != nil {
		x.t.Errorf("%s: stat of the backing: %v", what, err)
		return
	}
	if node == fuse.FUSE_ROOT_ID {
		want.Ino = a.Ino // the root's is FUSE's own
	}
	if a.Ino != want.Ino || a.Uid != want.Uid || a.Gid != want.Gid || a.Mode != want.Mode || int64(a.Size) != want.Size || a.Nlink != uint32(want.Nlink) {
		x.t.Errorf("%s: reply shows ino %d, owner %d:%d, mode %#o, size %d, links %d; the backing shows ino %d, owner %d:%d, mode %#o, size %d, links %d",
			what, a.Ino, a.Uid, a.Gid, a.Mode, a.Size, a.Nlink, want.Ino, want.Uid, want.Gid, want.Mode, want.Size, want.Nlink)
	}
}

// backingStat stats the backing object of node, found by its path, or
// for a node in no directory (O_TMPFILE) by its inode ino among the
// daemon's descriptors, then where its kind keeps its attributes or bytes.
func (x *opsFS) backingStat(node, ino uint64) (unix.Stat_t, error) {
	var st unix.Stat_t
	rel, named := x.paths[node]
	p := filepath.Join(x.fsys.store.Dir, rel)
	if !named {
		var err error
		if p, err = fdOfIno(ino); err != nil {
			return st, err
		}
	}
	stat := unix.Lstat
	if !named {
		stat = unix.Stat // the descriptor's /proc link leads to it
	}
	if err := stat(p, &st); err != nil {
		return st, err
	}
	mk, err := alloc.ReadMarker(p, &st)
	if err != nil {
		return st, err
	}
	switch mk.Kind {
	case alloc.Disk:
		ino, nlink := st.Ino, st.Nlink
		if err := unix.Stat(filepath.Join(x.fsys.store.Disk, mk.ID), &st); err != nil {
			return st, err
		}
		st.Ino, st.Nlink = ino, nlink
	case alloc.Imported:
		fi, err := x.imported.Stat()
		if err != nil {
			return st, err
		}
		st.Size = fi.Size()
	case alloc.Device:
		if x.fsys.gpu != nil && mk.Device == x.fsys.gpu.dev.Name() {
			x.fsys.gpu.mu.Lock()
			seg := x.fsys.gpu.segs[st.Ino]
			x.fsys.gpu.mu.Unlock()
			if seg == nil {
				return st, fmt.Errorf("no device memory for inode %d", st.Ino)
			}
			st.Size = seg.Size()
		}
	}
	return st, nil
}

// fdOfIno returns the /proc path of a descriptor of this process that
// is open on inode ino.
func fdOfIno(ino uint64) (string, error) {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return "", err
	}
	for _, e := range ents {
		p := "/proc/self/fd/" + e.Name()
		var st unix.Stat_t
		if unix.Stat(p, &st) == nil && st.Ino == ino && st.Mode&syscall.S_IFMT == syscall.S_IFREG {
			return p, nil
		}
	}
	return "", fmt.Errorf("no descriptor of inode %d", ino)
}

// fresh returns a name not used yet.
func (x *opsFS) fresh() string {
	x.next++
	return "n" + string(rune('a'+x.next%26)) + string(rune('a'+x.next/26))
}

// open opens kind k as the kernel would for the request: a segment with
// O_RDWR (read-only where it must be), a directory with OPENDIR; it
// returns false for kinds that are never opened.
func (x *opsFS) open(k string) (uint64, bool) {
	id := x.ids[k]
	switch {
	case k == "unavailable":
		return 0, false // every open says why not
	case segmentKinds[k]:
		flags := uint32(unix.O_RDWR)
		if readOnlyKinds[k] {
			flags = unix.O_RDONLY
		}
		var out fuse.OpenOut
		if st := x.raw.Open(nil, &fuse.OpenIn{InHeader: x.hdr(id), Flags: flags}, &out); st != fuse.OK {
			x.t.Fatalf("open %s: %v", k, st)
		}
		x.t.Cleanup(func() { x.raw.Release(nil, &fuse.ReleaseIn{InHeader: x.hdr(id), Fh: out.Fh}) })
		return out.Fh, true
	case dirKinds[k]:
		var out fuse.OpenOut
		if st := x.raw.OpenDir(nil, &fuse.OpenIn{InHeader: x.hdr(id)}, &out); st != fuse.OK {
			x.t.Fatalf("opendir %s: %v", k, st)
		}
		x.t.Cleanup(func() { x.raw.ReleaseDir(&fuse.ReleaseIn{InHeader: x.hdr(id), Fh: out.Fh}) })
		return out.Fh, true
	}
	return 0, false
}

// withFh runs op with an open handle of kind k; na where none can exist.
func (x *opsFS) withFh(k string, op func(fh uint64) fuse.Status) fuse.Status {
	fh, ok := x.open(k)
	if !ok {
		return na
	}
	return op(fh)
}

// opRow is one request: how to send it to a node of kind k, and what
// each kind answers (a kind not named answers OK).
type opRow struct {
	run  func(x *opsFS, k string) fuse.Status
	want map[string]fuse.Status
}

// notDir answers a namespace request on a node that is not a directory:
// the node type does not serve it.
var notDir = map[string]fuse.Status{"host": fuse.ENOTSUP, "shared": fuse.ENOTSUP, "imported": fuse.ENOTSUP, "device": fuse.ENOTSUP, "pulled": fuse.ENOTSUP, "unavailable": fuse.ENOTSUP, "symlink": fuse.ENOTSUP, "fifo": fuse.ENOTSUP}

// neverOpened marks the handle requests of kinds that are never opened
// (an unavailable segment cannot be).
var neverOpened = map[string]fuse.Status{"unavailable": na, "symlink": na, "fifo": na}

// dirsAnswer gives every directory column the same answer.
func dirsAnswer(st fuse.Status) map[string]fuse.Status {
	m := map[string]fuse.Status{}
	for k := range dirKinds {
		m[k] = st
	}
	return m
}

// parentOf returns the node id of the directory that holds kind k.
func (x *opsFS) parentOf(k string) uint64 {
	if p, ok := x.parents[k]; ok {
		return p
	}
	return fuse.FUSE_ROOT_ID
}

func merge(ms ...map[string]fuse.Status) map[string]fuse.Status {
	out := map[string]fuse.Status{}
	for _, m := range ms {
		for k, v := range m {
			out[k] = v
		}
	}
	return out
}

var opMatrix = map[string]opRow{
	"Lookup": {func(x *opsFS, k string) fuse.Status {
		var out fuse.EntryOut
		if k != "root" {
			if st := x.raw.Lookup(nil, ptr(x.hdr(x.parentOf(k))), k, &out); st != fuse.OK {
				return st
			}
			x.entry(x.parentOf(k), k, &out)
		}
		return x.raw.Lookup(nil, ptr(x.hdr(x.ids[k])), "absent", &out)
	}, allOf(fuse.ENOENT)},
	"Forget": {func(x *opsFS, k string) fuse.Status {
		if k != "root" {
			var out fuse.EntryOut // one more lookup, then forget it
			if st := x.raw.Lookup(nil, ptr(x.hdr(x.parentOf(k))), k, &out); st != fuse.OK || out.NodeId != x.ids[k] {
				return fuse.EIO
			}
			x.raw.Forget(x.ids[k], 1)
		}
		return void
	}, merge(allOf(void))},
	"GetAttr": {func(x *opsFS, k string) fuse.Status {
		var out fuse.AttrOut
		st := x.raw.GetAttr(nil, &fuse.GetAttrIn{InHeader: x.hdr(x.ids[k])}, &out)
		if st == fuse.OK {
			x.checkAttr("getattr "+k, x.ids[k], &out.Attr)
		}
		return st
	}, nil},
	"SetAttr": {func(x *opsFS, k string) fuse.Status {
		var out fuse.AttrOut
		in := &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{InHeader: x.hdr(x.ids[k]), Valid: fuse.FATTR_MODE, Mode: 0o640}}
		if st := x.raw.SetAttr(nil, in, &out); st != fuse.OK {
			return st
		}
		x.checkAttr("chmod "+k, x.ids[k], &out.Attr)
		in = &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{InHeader: x.hdr(x.ids[k]), Valid: fuse.FATTR_SIZE, Size: 4}}
		st := x.raw.SetAttr(nil, in, &out)
		if st == fuse.OK {
			x.checkAttr("truncate "+k, x.ids[k], &out.Attr)
		}
		return st
	}, merge(dirsAnswer(fuse.EISDIR), map[string]fuse.Status{"imported": fuse.EPERM, "pulled": fuse.EPERM, "unavailable": fuse.ENOTSUP, "symlink": fuse.Status(syscall.EOPNOTSUPP), "fifo": fuse.EISDIR})},
	"Mknod": {func(x *opsFS, k string) fuse.Status {
		var out fuse.EntryOut
		name := x.fresh()
		st := x.raw.Mknod(nil, &fuse.MknodIn{InHeader: x.hdr(x.ids[k]), Mode: syscall.S_IFIFO | 0o600}, name, &out)
		if st == fuse.OK {
			x.entry(x.ids[k], name, &out)
		}
		return st
	}, notDir},
	"Mkdir": {func(x *opsFS, k string) fuse.Status {
		var out fuse.EntryOut
		name := x.fresh()
		st := x.raw.Mkdir(nil, &fuse.MkdirIn{InHeader: x.hdr(x.ids[k]), Mode: 0o700}, name, &out)
		if st == fuse.OK {
			x.entry(x.ids[k], name, &out)
		}
		return st
	}, notDir},
	"Unlink": {func(x *opsFS, k string) fuse.Status {
		return x.raw.Unlink(nil, ptr(x.hdr(x.ids[k])), "absent")
	}, merge(allOf(fuse.ENOTDIR), dirsAnswer(fuse.ENOENT))},
	"Rmdir": {func(x *opsFS, k string) fuse.Status {
		return x.raw.Rmdir(nil, ptr(x.hdr(x.ids[k])), "absent")
	}, merge(allOf(fuse.ENOTDIR), dirsAnswer(fuse.ENOENT))},
	"Rename": {func(x *opsFS, k string) fuse.Status {
		return x.raw.Rename(nil, &fuse.RenameIn{InHeader: x.hdr(x.ids[k]), Newdir: x.ids[k]}, "absent", x.fresh())
	}, merge(notDir, dirsAnswer(fuse.ENOENT))},
	"Link": {func(x *opsFS, k string) fuse.Status {
		var out fuse.EntryOut
		name := x.fresh()
		st := x.raw.Link(nil, &fuse.LinkIn{InHeader: x.hdr(1), Oldnodeid: x.ids[k]}, name, &out)
		if st == fuse.OK {
			x.entry(1, name, &out)
		}
		return st
	}, merge(dirsAnswer(fuse.EPERM), map[string]fuse.Status{"shared": fuse.Status(syscall.EXDEV), "imported": fuse.Status(syscall.EXDEV), "device": fuse.Status(syscall.EXDEV), "pulled": fuse.Status(syscall.EXDEV), "unavailable": fuse.Status(syscall.EXDEV)})},
	"Symlink": {func(x *opsFS, k string) fuse.Status {
		var out fuse.EntryOut
		name := x.fresh()
		st := x.raw.Symlink(nil, ptr(x.hdr(x.ids[k])), "target", name, &out)
		if st == fuse.OK {
			x.entry(x.ids[k], name, &out)
		}
		return st
	}, notDir},
	"Readlink": {func(x *opsFS, k string) fuse.Status {
		_, st := x.raw.Readlink(nil, ptr(x.hdr(x.ids[k])))
		return st
	}, merge(allOf(fuse.ENOTSUP), map[string]fuse.Status{"symlink": fuse.OK})},
	"Access": {func(x *opsFS, k string) fuse.Status {
		return x.raw.Access(nil, &fuse.AccessIn{InHeader: x.hdr(x.ids[k]), Mask: unix.R_OK})
	}, nil},
	"GetXAttr": {func(x *opsFS, k string) fuse.Status {
		if _, st := x.raw.GetXAttr(nil, ptr(x.hdr(x.ids[k])), "trusted.tensorfs.import", make([]byte, 64)); st != fuse.ENOATTR {
			return st // internal state is never served
		}
		_, st := x.raw.GetXAttr(nil, ptr(x.hdr(x.ids[k])), alloc.AttrFlags, make([]byte, 64))
		return st
	}, map[string]fuse.Status{"symlink": fuse.ENOATTR, "fifo": fuse.ENOATTR}},
	"ListXAttr": {func(x *opsFS, k string) fuse.Status {
		_, st := x.raw.ListXAttr(nil, ptr(x.hdr(x.ids[k])), make([]byte, 4096))
		return st
	}, nil},
	"SetXAttr": {func(x *opsFS, k string) fuse.Status {
		if st := x.raw.SetXAttr(nil, &fuse.SetXAttrIn{InHeader: x.hdr(x.ids[k]), Size: 1}, "security.x", []byte("x")); st == fuse.OK {
			return fuse.EIO // another namespace would be set with the daemon's rights
		}
		return x.raw.SetXAttr(nil, &fuse.SetXAttrIn{InHeader: x.hdr(x.ids[k]), Size: 1}, "user.note", []byte("x"))
	}, map[string]fuse.Status{"pulled": fuse.EPERM, "symlink": fuse.EPERM, "fifo": fuse.EPERM}},
	"RemoveXAttr": {func(x *opsFS, k string) fuse.Status {
		x.raw.SetXAttr(nil, &fuse.SetXAttrIn{InHeader: x.hdr(x.ids[k]), Size: 1}, "user.gone", []byte("x"))
		return x.raw.RemoveXAttr(nil, ptr(x.hdr(x.ids[k])), "user.gone")
	}, map[string]fuse.Status{"pulled": fuse.EPERM, "symlink": fuse.ENOATTR, "fifo": fuse.ENOATTR}},
	"Create": {func(x *opsFS, k string) fuse.Status {
		var out fuse.CreateOut
		name := x.fresh()
		st := x.raw.Create(nil, &fuse.CreateIn{InHeader: x.hdr(x.ids[k]), Flags: unix.O_RDWR, Mode: 0o600}, name, &out)
		if st == fuse.OK {
			x.entry(x.ids[k], name, &out.EntryOut)
			x.raw.Release(nil, &fuse.ReleaseIn{InHeader: x.hdr(out.NodeId), Fh: out.Fh})
		}
		return st
	}, merge(allOf(fuse.EROFS), dirsAnswer(fuse.OK))}, // go-fuse's answer where no node creates
	"Tmpfile": {func(x *opsFS, k string) fuse.Status {
		var out fuse.CreateOut
		st := x.raw.Tmpfile(nil, &fuse.CreateIn{InHeader: x.hdr(x.ids[k]), Flags: unix.O_RDWR, Mode: 0o600}, &out)
		if st == fuse.OK {
			x.checkAttr("tmpfile in "+k, out.NodeId, &out.Attr) // in no directory: found by its descriptor
			x.raw.Release(nil, &fuse.ReleaseIn{InHeader: x.hdr(out.NodeId), Fh: out.Fh})
		}
		return st
	}, notDir},
	"Open": {func(x *opsFS, k string) fuse.Status {
		var out fuse.OpenOut
		st := x.raw.Open(nil, &fuse.OpenIn{InHeader: x.hdr(x.ids[k]), Flags: unix.O_WRONLY}, &out)
		if st == fuse.OK {
			x.raw.Release(nil, &fuse.ReleaseIn{InHeader: x.hdr(x.ids[k]), Fh: out.Fh})
		}
		return st
	}, merge(dirsAnswer(fuse.ENOTSUP), map[string]fuse.Status{"imported": fuse.EPERM, "pulled": fuse.EPERM, "unavailable": fuse.ENOTSUP, "symlink": fuse.ENOTSUP, "fifo": fuse.ENOTSUP})},
	"Read": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			buf := make([]byte, 8)
			r, st := x.raw.Read(nil, &fuse.ReadIn{InHeader: x.hdr(x.ids[k]), Fh: fh, Size: 8}, buf)
			if st != fuse.OK {
				return st
			}
			defer r.Done()
			if b, st := r.Bytes(buf); st != fuse.OK || len(b) == 0 {
				return fuse.EIO
			}
			return fuse.OK
		})
	}, merge(neverOpened, dirsAnswer(fuse.ENOTSUP))},
	"Lseek": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			var out fuse.LseekOut
			if st := x.raw.Lseek(nil, &fuse.LseekIn{InHeader: x.hdr(x.ids[k]), Fh: fh, Whence: unix.SEEK_HOLE}, &out); st != fuse.OK {
				return st
			}
			var attr fuse.AttrOut
			x.raw.GetAttr(nil, &fuse.GetAttrIn{InHeader: x.hdr(x.ids[k])}, &attr)
			if out.Offset != attr.Size { // no holes: the hole is at the end
				return fuse.EIO
			}
			return x.raw.Lseek(nil, &fuse.LseekIn{InHeader: x.hdr(x.ids[k]), Fh: fh, Offset: 1 << 40, Whence: unix.SEEK_DATA}, &out)
		})
	}, merge(allOf(fuse.Status(syscall.ENXIO)), neverOpened)},
	"GetLk": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			return x.raw.GetLk(nil, &fuse.LkIn{InHeader: x.hdr(x.ids[k]), Fh: fh}, &fuse.LkOut{})
		})
	}, merge(allOf(fuse.ENOTSUP), neverOpened)},
	"SetLk": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			return x.raw.SetLk(nil, &fuse.LkIn{InHeader: x.hdr(x.ids[k]), Fh: fh})
		})
	}, merge(allOf(fuse.ENOTSUP), neverOpened)},
	"SetLkw": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			return x.raw.SetLkw(nil, &fuse.LkIn{InHeader: x.hdr(x.ids[k]), Fh: fh})
		})
	}, merge(allOf(fuse.ENOTSUP), neverOpened)},
	"Release": {func(x *opsFS, k string) fuse.Status {
		if !segmentKinds[k] || neverOpened[k] == na {
			return na
		}
		var out fuse.OpenOut
		x.raw.Open(nil, &fuse.OpenIn{InHeader: x.hdr(x.ids[k]), Flags: unix.O_RDONLY}, &out)
		x.raw.Release(nil, &fuse.ReleaseIn{InHeader: x.hdr(x.ids[k]), Fh: out.Fh})
		return void
	}, merge(allOf(void), dirsAnswer(na), neverOpened)},
	"Write": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			_, st := x.raw.Write(nil, &fuse.WriteIn{InHeader: x.hdr(x.ids[k]), Fh: fh}, []byte("w"))
			return st
		})
	}, merge(neverOpened, dirsAnswer(fuse.ENOTSUP), map[string]fuse.Status{"imported": fuse.EBADF, "pulled": fuse.EBADF})},
	"Writev": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			_, st := x.raw.Writev(nil, &fuse.WriteIn{InHeader: x.hdr(x.ids[k]), Fh: fh}, [][]byte{[]byte("w"), []byte("v")})
			return st
		})
	}, merge(neverOpened, dirsAnswer(fuse.ENOSYS), map[string]fuse.Status{"imported": fuse.EBADF, "pulled": fuse.EBADF, "device": fuse.ENOSYS})},
	"CopyFileRange": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			to := x.segment(1, x.fresh())
			var out fuse.OpenOut
			x.raw.Open(nil, &fuse.OpenIn{InHeader: x.hdr(to), Flags: unix.O_RDWR}, &out)
			defer x.raw.Release(nil, &fuse.ReleaseIn{InHeader: x.hdr(to), Fh: out.Fh})
			_, st := x.raw.CopyFileRange(nil, &fuse.CopyFileRangeIn{InHeader: x.hdr(x.ids[k]), FhIn: fh, NodeIdOut: to, FhOut: out.Fh, Len: 4})
			return st
		})
		// An imported segment's bytes are another filesystem's (a memfd):
		// copy_file_range across filesystems is EXDEV, and the kernel
		// copies through read and write instead.
	}, merge(neverOpened, dirsAnswer(fuse.ENOTSUP), map[string]fuse.Status{"imported": fuse.Status(syscall.EXDEV)})},
	"Ioctl": {func(x *opsFS, k string) fuse.Status {
		fh, _ := x.open(k)
		in := &fuse.IoctlIn{InHeader: x.hdr(x.ids[k]), Fh: fh, Cmd: 0xc0185879} // FITRIM
		return x.raw.Ioctl(nil, in, make([]byte, 24), &fuse.IoctlOut{}, make([]byte, 24))
	}, allOf(fuse.Status(syscall.ENOTTY))},
	"Flush": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			return x.raw.Flush(nil, &fuse.FlushIn{InHeader: x.hdr(x.ids[k]), Fh: fh})
		})
	}, neverOpened},
	"Fsync": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			return x.raw.Fsync(nil, &fuse.FsyncIn{InHeader: x.hdr(x.ids[k]), Fh: fh})
		})
	}, merge(neverOpened, dirsAnswer(fuse.ENOTSUP))},
	"Fallocate": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			collapse := &fuse.FallocateIn{InHeader: x.hdr(x.ids[k]), Fh: fh, Length: 4096, Mode: unix.FALLOC_FL_COLLAPSE_RANGE}
			if st := x.raw.Fallocate(nil, collapse); st != fuse.Status(syscall.EOPNOTSUPP) && st != fuse.ENOTSUP {
				return fuse.EIO // a mode tensorfs does not serve
			}
			return x.raw.Fallocate(nil, &fuse.FallocateIn{InHeader: x.hdr(x.ids[k]), Fh: fh, Length: 64})
		})
	}, merge(neverOpened, dirsAnswer(fuse.ENOTSUP), map[string]fuse.Status{"imported": fuse.EBADF, "pulled": fuse.EBADF})},
	"OpenDir": {func(x *opsFS, k string) fuse.Status {
		var out fuse.OpenOut
		st := x.raw.OpenDir(nil, &fuse.OpenIn{InHeader: x.hdr(x.ids[k])}, &out)
		if st == fuse.OK {
			x.raw.ReleaseDir(&fuse.ReleaseIn{InHeader: x.hdr(x.ids[k]), Fh: out.Fh})
		}
		return st
	}, nil},
	"ReadDir": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			return x.raw.ReadDir(nil, &fuse.ReadIn{InHeader: x.hdr(x.ids[k]), Fh: fh, Size: 4096}, fuse.NewDirEntryList(make([]byte, 4096), 0))
		})
	}, neverOpened}, // a segment's handle lists nothing (go-fuse); the kernel never asks
	"ReadDirPlus": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			return x.raw.ReadDirPlus(nil, &fuse.ReadIn{InHeader: x.hdr(x.ids[k]), Fh: fh, Size: 4096}, fuse.NewDirEntryList(make([]byte, 4096), 0))
		})
	}, neverOpened},
	"ReleaseDir": {func(x *opsFS, k string) fuse.Status {
		var out fuse.OpenOut
		if x.raw.OpenDir(nil, &fuse.OpenIn{InHeader: x.hdr(x.ids[k])}, &out) == fuse.OK {
			x.raw.ReleaseDir(&fuse.ReleaseIn{InHeader: x.hdr(x.ids[k]), Fh: out.Fh})
		}
		return void
	}, allOf(void)},
	"FsyncDir": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			return x.raw.FsyncDir(nil, &fuse.FsyncIn{InHeader: x.hdr(x.ids[k]), Fh: fh})
		})
	}, merge(notDir, neverOpened)},
	"StatFs": {func(x *opsFS, k string) fuse.Status {
		return x.raw.StatFs(nil, ptr(x.hdr(x.ids[k])), &fuse.StatfsOut{})
	}, nil},
	"Statx": {func(x *opsFS, k string) fuse.Status {
		var sx fuse.StatxOut
		if st := x.raw.Statx(nil, &fuse.StatxIn{InHeader: x.hdr(x.ids[k])}, &sx); st != fuse.OK {
			return st
		}
		var a fuse.AttrOut
		x.raw.GetAttr(nil, &fuse.GetAttrIn{InHeader: x.hdr(x.ids[k])}, &a)
		if sx.Size != a.Size || sx.Ino != a.Ino || uint32(sx.Mode) != a.Mode {
			return fuse.EIO // statx says what stat says
		}
		return fuse.OK
	}, nil},
}

// lifecycle are RawFileSystem's methods that are not requests about a
// node: the mount's start and end, and go-fuse's own bookkeeping.
var lifecycle = map[string]bool{"Init": true, "OnUnmount": true, "String": true, "SetDebug": true}

// allOf gives every kind the same answer.
func allOf(st fuse.Status) map[string]fuse.Status {
	m := map[string]fuse.Status{}
	for _, k := range opKinds {
		m[k] = st
	}
	return m
}

// TestOperationMatrix: every request go-fuse routes, on every kind of
// node, answers as the matrix says.
func TestOperationMatrix(t *testing.T) {
	raw := reflect.TypeOf((*fuse.RawFileSystem)(nil)).Elem()
	var ops []string
	for i := 0; i < raw.NumMethod(); i++ {
		name := raw.Method(i).Name
		if lifecycle[name] {
			continue
		}
		if _, ok := opMatrix[name]; !ok {
			t.Errorf("go-fuse routes %s, which the operation matrix does not classify", name)
			continue
		}
		ops = append(ops, name)
	}
	sort.Strings(ops)
	callers := []struct {
		name string
		who  fuse.Owner
	}{{"root", fuse.Owner{}}, {"user", fuse.Owner{Uid: ownerPeer.Uid, Gid: ownerPeer.Gid}}}
	for _, c := range callers {
		t.Run(c.name, func(t *testing.T) {
			for _, op := range ops {
				row := opMatrix[op]
				t.Run(op, func(t *testing.T) {
					x := newOpsFSAs(t, c.who)
					for _, k := range opKinds {
						want, ok := row.want[k]
						if !ok {
							want = fuse.OK
						}
						if got := row.run(x, k); got != want {
							t.Errorf("%s on %s: got %v, want %v", op, k, got, want)
						}
					}
				})
			}
		})
	}
}
