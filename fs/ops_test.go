package fs

import (
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
	"tensorfs/gpu"
)

// The operation matrix: every request go-fuse can route to a
// filesystem (every method of fuse.RawFileSystem), on every kind of node
// (the root, a directory, a segment of each storage kind, a symbolic
// link, a FIFO), through go-fuse's own bridge as the kernel would drive
// it, without a mount. Each cell says what tensorfs answers; a method
// that is not in the table fails the test, so that a request go-fuse
// learns to route is classified before it is served.

// opKinds are the matrix's columns.
var opKinds = []string{"root", "dir", "host", "shared", "imported", "device", "pulled", "symlink", "fifo"}

// segmentKinds are the columns that are segments.
var segmentKinds = map[string]bool{"host": true, "shared": true, "imported": true, "device": true, "pulled": true}

// readOnlyKinds are the segment kinds opened read-only.
var readOnlyKinds = map[string]bool{"imported": true, "pulled": true}

// opsFS is a filesystem with one node of every kind, driven through the
// bridge.
type opsFS struct {
	t    *testing.T
	fsys *filesystem
	raw  fuse.RawFileSystem
	// ids are the node ids of the kinds; parents and names say where
	// each is.
	ids     map[string]uint64
	parents map[string]uint64
	next    int
}

// na marks a cell the kernel cannot ask: the request needs an open
// handle, and a node of that kind is never opened.
const na = fuse.Status(-1)

// void marks a request without a reply (FORGET, RELEASE).
const void = fuse.Status(-2)

func hdr(node uint64) fuse.InHeader {
	return fuse.InHeader{NodeId: node, Caller: fuse.Caller{Owner: fuse.Owner{Uid: 0, Gid: 0}, Pid: uint32(os.Getpid())}}
}

// newOpsFS makes the filesystem: a --disk directory for SHARED segments,
// a simulated device, and in the root one node of each kind.
func newOpsFS(t *testing.T) *opsFS {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("the operation matrix sets owners and trusted attributes: it needs root")
	}
	top := t.TempDir()
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
	x := &opsFS{t: t, fsys: fsys, ids: map[string]uint64{"root": fuse.FUSE_ROOT_ID}, parents: map[string]uint64{}}
	// As Mount does: requests are counted on their way to the bridge.
	x.raw = &countingFS{RawFileSystem: fusefs.NewNodeFS(fsys.root, &fusefs.Options{}), c: &fsys.requests}

	x.ids["dir"] = x.mkdir(1, "dir")
	x.ids["host"] = x.segment(1, "host")
	sdir := x.mkdir(1, "sdir")
	x.setxattr(sdir, alloc.AttrFlags, "SHARED")
	x.ids["shared"] = x.segment(sdir, "shared")
	x.parents["shared"] = sdir
	gdir := x.mkdir(1, "gdir")
	x.setxattr(gdir, alloc.AttrDevice, "cuda:0")
	x.ids["device"] = x.segment(gdir, "device")
	x.parents["device"] = gdir
	f := memfd(t, "imported bytes")
	if err := (controlBackend{fsys}).Import(rootPeer, "imported", f, "uint8", ""); err != nil {
		t.Fatal(err)
	}
	x.ids["imported"] = x.lookup(1, "imported")
	x.ids["pulled"] = x.lookup(1, pulledSegment(t, fsys, "pulled"))
	var out fuse.EntryOut
	if st := x.raw.Symlink(nil, ptr(hdr(1)), "host", "symlink", &out); st != fuse.OK {
		t.Fatalf("symlink: %v", st)
	}
	x.ids["symlink"] = out.NodeId
	if st := x.raw.Mknod(nil, &fuse.MknodIn{InHeader: hdr(1), Mode: syscall.S_IFIFO | 0o644}, "fifo", &out); st != fuse.OK {
		t.Fatalf("mknod fifo: %v", st)
	}
	x.ids["fifo"] = out.NodeId
	return x
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
	if st := x.raw.Mkdir(nil, &fuse.MkdirIn{InHeader: hdr(parent), Mode: 0o755}, name, &out); st != fuse.OK {
		x.t.Fatalf("mkdir %s: %v", name, st)
	}
	return out.NodeId
}

// segment makes a segment of 8 bytes.
func (x *opsFS) segment(parent uint64, name string) uint64 {
	var out fuse.CreateOut
	if st := x.raw.Create(nil, &fuse.CreateIn{InHeader: hdr(parent), Flags: unix.O_RDWR, Mode: 0o644}, name, &out); st != fuse.OK {
		x.t.Fatalf("create %s: %v", name, st)
	}
	if _, st := x.raw.Write(nil, &fuse.WriteIn{InHeader: hdr(out.NodeId), Fh: out.Fh}, []byte("8 bytes!")); st != fuse.OK {
		x.t.Fatalf("write %s: %v", name, st)
	}
	x.raw.Release(nil, &fuse.ReleaseIn{InHeader: hdr(out.NodeId), Fh: out.Fh})
	return out.NodeId
}

func (x *opsFS) lookup(parent uint64, name string) uint64 {
	var out fuse.EntryOut
	if st := x.raw.Lookup(nil, ptr(hdr(parent)), name, &out); st != fuse.OK {
		x.t.Fatalf("lookup %s: %v", name, st)
	}
	return out.NodeId
}

func (x *opsFS) setxattr(node uint64, attr, v string) {
	if st := x.raw.SetXAttr(nil, &fuse.SetXAttrIn{InHeader: hdr(node), Size: uint32(len(v))}, attr, []byte(v)); st != fuse.OK {
		x.t.Fatalf("setxattr %s: %v", attr, st)
	}
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
	case segmentKinds[k]:
		flags := uint32(unix.O_RDWR)
		if readOnlyKinds[k] {
			flags = unix.O_RDONLY
		}
		var out fuse.OpenOut
		if st := x.raw.Open(nil, &fuse.OpenIn{InHeader: hdr(id), Flags: flags}, &out); st != fuse.OK {
			x.t.Fatalf("open %s: %v", k, st)
		}
		x.t.Cleanup(func() { x.raw.Release(nil, &fuse.ReleaseIn{InHeader: hdr(id), Fh: out.Fh}) })
		return out.Fh, true
	case k == "root" || k == "dir":
		var out fuse.OpenOut
		if st := x.raw.OpenDir(nil, &fuse.OpenIn{InHeader: hdr(id)}, &out); st != fuse.OK {
			x.t.Fatalf("opendir %s: %v", k, st)
		}
		x.t.Cleanup(func() { x.raw.ReleaseDir(&fuse.ReleaseIn{InHeader: hdr(id), Fh: out.Fh}) })
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
var notDir = map[string]fuse.Status{"host": fuse.ENOTSUP, "shared": fuse.ENOTSUP, "imported": fuse.ENOTSUP, "device": fuse.ENOTSUP, "pulled": fuse.ENOTSUP, "symlink": fuse.ENOTSUP, "fifo": fuse.ENOTSUP}

// neverOpened marks the handle requests of kinds that are never opened.
var neverOpened = map[string]fuse.Status{"symlink": na, "fifo": na}

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
		return x.raw.Lookup(nil, ptr(hdr(x.ids[k])), "absent", &out)
	}, merge(map[string]fuse.Status{"root": fuse.ENOENT, "dir": fuse.ENOENT}, map[string]fuse.Status{"host": fuse.ENOENT, "shared": fuse.ENOENT, "imported": fuse.ENOENT, "device": fuse.ENOENT, "pulled": fuse.ENOENT, "symlink": fuse.ENOENT, "fifo": fuse.ENOENT})},
	"Forget": {func(x *opsFS, k string) fuse.Status {
		if k != "root" {
			parent, ok := x.parents[k]
			if !ok {
				parent = 1
			}
			var out fuse.EntryOut // one more lookup, then forget it
			if st := x.raw.Lookup(nil, ptr(hdr(parent)), k, &out); st != fuse.OK || out.NodeId != x.ids[k] {
				return fuse.EIO
			}
			x.raw.Forget(x.ids[k], 1)
		}
		return void
	}, merge(allOf(void))},
	"GetAttr": {func(x *opsFS, k string) fuse.Status {
		var out fuse.AttrOut
		return x.raw.GetAttr(nil, &fuse.GetAttrIn{InHeader: hdr(x.ids[k])}, &out)
	}, nil},
	"SetAttr": {func(x *opsFS, k string) fuse.Status {
		var out fuse.AttrOut
		in := &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{InHeader: hdr(x.ids[k]), Valid: fuse.FATTR_MODE, Mode: 0o640}}
		if st := x.raw.SetAttr(nil, in, &out); st != fuse.OK {
			return st
		}
		in = &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{InHeader: hdr(x.ids[k]), Valid: fuse.FATTR_SIZE, Size: 4}}
		return x.raw.SetAttr(nil, in, &out)
	}, map[string]fuse.Status{"root": fuse.EISDIR, "dir": fuse.EISDIR, "imported": fuse.EPERM, "pulled": fuse.EPERM, "symlink": fuse.Status(syscall.EOPNOTSUPP), "fifo": fuse.EISDIR}},
	"Mknod": {func(x *opsFS, k string) fuse.Status {
		var out fuse.EntryOut
		return x.raw.Mknod(nil, &fuse.MknodIn{InHeader: hdr(x.ids[k]), Mode: syscall.S_IFIFO | 0o600}, x.fresh(), &out)
	}, notDir},
	"Mkdir": {func(x *opsFS, k string) fuse.Status {
		var out fuse.EntryOut
		return x.raw.Mkdir(nil, &fuse.MkdirIn{InHeader: hdr(x.ids[k]), Mode: 0o700}, x.fresh(), &out)
	}, notDir},
	"Unlink": {func(x *opsFS, k string) fuse.Status {
		return x.raw.Unlink(nil, ptr(hdr(x.ids[k])), "absent")
	}, merge(allOf(fuse.ENOTDIR), map[string]fuse.Status{"root": fuse.ENOENT, "dir": fuse.ENOENT})},
	"Rmdir": {func(x *opsFS, k string) fuse.Status {
		return x.raw.Rmdir(nil, ptr(hdr(x.ids[k])), "absent")
	}, merge(allOf(fuse.ENOTDIR), map[string]fuse.Status{"root": fuse.ENOENT, "dir": fuse.ENOENT})},
	"Rename": {func(x *opsFS, k string) fuse.Status {
		return x.raw.Rename(nil, &fuse.RenameIn{InHeader: hdr(x.ids[k]), Newdir: x.ids[k]}, "absent", x.fresh())
	}, merge(notDir, map[string]fuse.Status{"root": fuse.ENOENT, "dir": fuse.ENOENT})},
	"Link": {func(x *opsFS, k string) fuse.Status {
		var out fuse.EntryOut
		return x.raw.Link(nil, &fuse.LinkIn{InHeader: hdr(1), Oldnodeid: x.ids[k]}, x.fresh(), &out)
	}, map[string]fuse.Status{"root": fuse.EPERM, "dir": fuse.EPERM, "shared": fuse.Status(syscall.EXDEV), "imported": fuse.Status(syscall.EXDEV), "device": fuse.Status(syscall.EXDEV), "pulled": fuse.Status(syscall.EXDEV)}},
	"Symlink": {func(x *opsFS, k string) fuse.Status {
		var out fuse.EntryOut
		return x.raw.Symlink(nil, ptr(hdr(x.ids[k])), "target", x.fresh(), &out)
	}, notDir},
	"Readlink": {func(x *opsFS, k string) fuse.Status {
		_, st := x.raw.Readlink(nil, ptr(hdr(x.ids[k])))
		return st
	}, map[string]fuse.Status{"root": fuse.ENOTSUP, "dir": fuse.ENOTSUP, "host": fuse.ENOTSUP, "shared": fuse.ENOTSUP, "imported": fuse.ENOTSUP, "device": fuse.ENOTSUP, "pulled": fuse.ENOTSUP, "fifo": fuse.ENOTSUP}},
	"Access": {func(x *opsFS, k string) fuse.Status {
		return x.raw.Access(nil, &fuse.AccessIn{InHeader: hdr(x.ids[k]), Mask: unix.R_OK})
	}, nil},
	"GetXAttr": {func(x *opsFS, k string) fuse.Status {
		if _, st := x.raw.GetXAttr(nil, ptr(hdr(x.ids[k])), "trusted.tensorfs.import", make([]byte, 64)); st != fuse.ENOATTR {
			return st // internal state is never served
		}
		_, st := x.raw.GetXAttr(nil, ptr(hdr(x.ids[k])), alloc.AttrFlags, make([]byte, 64))
		return st
	}, map[string]fuse.Status{"symlink": fuse.ENOATTR, "fifo": fuse.ENOATTR}},
	"ListXAttr": {func(x *opsFS, k string) fuse.Status {
		_, st := x.raw.ListXAttr(nil, ptr(hdr(x.ids[k])), make([]byte, 4096))
		return st
	}, nil},
	"SetXAttr": {func(x *opsFS, k string) fuse.Status {
		if st := x.raw.SetXAttr(nil, &fuse.SetXAttrIn{InHeader: hdr(x.ids[k]), Size: 1}, "security.x", []byte("x")); st == fuse.OK {
			return fuse.EIO // another namespace would be set with the daemon's rights
		}
		return x.raw.SetXAttr(nil, &fuse.SetXAttrIn{InHeader: hdr(x.ids[k]), Size: 1}, "user.note", []byte("x"))
	}, map[string]fuse.Status{"pulled": fuse.EPERM, "symlink": fuse.EPERM, "fifo": fuse.EPERM}},
	"RemoveXAttr": {func(x *opsFS, k string) fuse.Status {
		x.raw.SetXAttr(nil, &fuse.SetXAttrIn{InHeader: hdr(x.ids[k]), Size: 1}, "user.gone", []byte("x"))
		return x.raw.RemoveXAttr(nil, ptr(hdr(x.ids[k])), "user.gone")
	}, map[string]fuse.Status{"pulled": fuse.EPERM, "symlink": fuse.ENOATTR, "fifo": fuse.ENOATTR}},
	"Create": {func(x *opsFS, k string) fuse.Status {
		var out fuse.CreateOut
		st := x.raw.Create(nil, &fuse.CreateIn{InHeader: hdr(x.ids[k]), Flags: unix.O_RDWR, Mode: 0o600}, x.fresh(), &out)
		if st == fuse.OK {
			x.raw.Release(nil, &fuse.ReleaseIn{InHeader: hdr(out.NodeId), Fh: out.Fh})
		}
		return st
	}, merge(allOf(fuse.EROFS), map[string]fuse.Status{"root": fuse.OK, "dir": fuse.OK})}, // go-fuse's answer where no node creates
	"Tmpfile": {func(x *opsFS, k string) fuse.Status {
		var out fuse.CreateOut
		st := x.raw.Tmpfile(nil, &fuse.CreateIn{InHeader: hdr(x.ids[k]), Flags: unix.O_RDWR, Mode: 0o600}, &out)
		if st == fuse.OK {
			x.raw.Release(nil, &fuse.ReleaseIn{InHeader: hdr(out.NodeId), Fh: out.Fh})
		}
		return st
	}, notDir},
	"Open": {func(x *opsFS, k string) fuse.Status {
		var out fuse.OpenOut
		st := x.raw.Open(nil, &fuse.OpenIn{InHeader: hdr(x.ids[k]), Flags: unix.O_WRONLY}, &out)
		if st == fuse.OK {
			x.raw.Release(nil, &fuse.ReleaseIn{InHeader: hdr(x.ids[k]), Fh: out.Fh})
		}
		return st
	}, map[string]fuse.Status{"root": fuse.ENOTSUP, "dir": fuse.ENOTSUP, "imported": fuse.EPERM, "pulled": fuse.EPERM, "symlink": fuse.ENOTSUP, "fifo": fuse.ENOTSUP}},
	"Read": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			buf := make([]byte, 8)
			r, st := x.raw.Read(nil, &fuse.ReadIn{InHeader: hdr(x.ids[k]), Fh: fh, Size: 8}, buf)
			if st != fuse.OK {
				return st
			}
			defer r.Done()
			if b, st := r.Bytes(buf); st != fuse.OK || len(b) == 0 {
				return fuse.EIO
			}
			return fuse.OK
		})
	}, merge(neverOpened, map[string]fuse.Status{"root": fuse.ENOTSUP, "dir": fuse.ENOTSUP})},
	"Lseek": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			var out fuse.LseekOut
			if st := x.raw.Lseek(nil, &fuse.LseekIn{InHeader: hdr(x.ids[k]), Fh: fh, Whence: unix.SEEK_HOLE}, &out); st != fuse.OK {
				return st
			}
			var attr fuse.AttrOut
			x.raw.GetAttr(nil, &fuse.GetAttrIn{InHeader: hdr(x.ids[k])}, &attr)
			if out.Offset != attr.Size { // no holes: the hole is at the end
				return fuse.EIO
			}
			return x.raw.Lseek(nil, &fuse.LseekIn{InHeader: hdr(x.ids[k]), Fh: fh, Offset: 1 << 40, Whence: unix.SEEK_DATA}, &out)
		})
	}, merge(allOf(fuse.Status(syscall.ENXIO)), neverOpened)},
	"GetLk": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			return x.raw.GetLk(nil, &fuse.LkIn{InHeader: hdr(x.ids[k]), Fh: fh}, &fuse.LkOut{})
		})
	}, merge(allOf(fuse.ENOTSUP), neverOpened)},
	"SetLk": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			return x.raw.SetLk(nil, &fuse.LkIn{InHeader: hdr(x.ids[k]), Fh: fh})
		})
	}, merge(allOf(fuse.ENOTSUP), neverOpened)},
	"SetLkw": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			return x.raw.SetLkw(nil, &fuse.LkIn{InHeader: hdr(x.ids[k]), Fh: fh})
		})
	}, merge(allOf(fuse.ENOTSUP), neverOpened)},
	"Release": {func(x *opsFS, k string) fuse.Status {
		if !segmentKinds[k] {
			return na
		}
		var out fuse.OpenOut
		x.raw.Open(nil, &fuse.OpenIn{InHeader: hdr(x.ids[k]), Flags: unix.O_RDONLY}, &out)
		x.raw.Release(nil, &fuse.ReleaseIn{InHeader: hdr(x.ids[k]), Fh: out.Fh})
		return void
	}, merge(allOf(void), map[string]fuse.Status{"root": na, "dir": na, "symlink": na, "fifo": na})},
	"Write": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			_, st := x.raw.Write(nil, &fuse.WriteIn{InHeader: hdr(x.ids[k]), Fh: fh}, []byte("w"))
			return st
		})
	}, merge(neverOpened, map[string]fuse.Status{"root": fuse.ENOTSUP, "dir": fuse.ENOTSUP, "imported": fuse.EBADF, "pulled": fuse.EBADF})},
	"Writev": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			_, st := x.raw.Writev(nil, &fuse.WriteIn{InHeader: hdr(x.ids[k]), Fh: fh}, [][]byte{[]byte("w"), []byte("v")})
			return st
		})
	}, merge(neverOpened, map[string]fuse.Status{"root": fuse.ENOSYS, "dir": fuse.ENOSYS, "imported": fuse.EBADF, "pulled": fuse.EBADF, "device": fuse.ENOSYS})},
	"CopyFileRange": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			to := x.segment(1, x.fresh())
			var out fuse.OpenOut
			x.raw.Open(nil, &fuse.OpenIn{InHeader: hdr(to), Flags: unix.O_RDWR}, &out)
			defer x.raw.Release(nil, &fuse.ReleaseIn{InHeader: hdr(to), Fh: out.Fh})
			_, st := x.raw.CopyFileRange(nil, &fuse.CopyFileRangeIn{InHeader: hdr(x.ids[k]), FhIn: fh, NodeIdOut: to, FhOut: out.Fh, Len: 4})
			return st
		})
		// An imported segment's bytes are another filesystem's (a memfd):
		// copy_file_range across filesystems is EXDEV, and the kernel
		// copies through read and write instead.
	}, merge(neverOpened, map[string]fuse.Status{"root": fuse.ENOTSUP, "dir": fuse.ENOTSUP, "imported": fuse.Status(syscall.EXDEV)})},
	"Ioctl": {func(x *opsFS, k string) fuse.Status {
		fh, _ := x.open(k)
		in := &fuse.IoctlIn{InHeader: hdr(x.ids[k]), Fh: fh, Cmd: 0xc0185879} // FITRIM
		return x.raw.Ioctl(nil, in, make([]byte, 24), &fuse.IoctlOut{}, make([]byte, 24))
	}, allOf(fuse.Status(syscall.ENOTTY))},
	"Flush": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			return x.raw.Flush(nil, &fuse.FlushIn{InHeader: hdr(x.ids[k]), Fh: fh})
		})
	}, neverOpened},
	"Fsync": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			return x.raw.Fsync(nil, &fuse.FsyncIn{InHeader: hdr(x.ids[k]), Fh: fh})
		})
	}, merge(neverOpened, map[string]fuse.Status{"root": fuse.ENOTSUP, "dir": fuse.ENOTSUP})},
	"Fallocate": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			collapse := &fuse.FallocateIn{InHeader: hdr(x.ids[k]), Fh: fh, Length: 4096, Mode: unix.FALLOC_FL_COLLAPSE_RANGE}
			if st := x.raw.Fallocate(nil, collapse); st != fuse.Status(syscall.EOPNOTSUPP) && st != fuse.ENOTSUP {
				return fuse.EIO // a mode tensorfs does not serve
			}
			return x.raw.Fallocate(nil, &fuse.FallocateIn{InHeader: hdr(x.ids[k]), Fh: fh, Length: 64})
		})
	}, merge(neverOpened, map[string]fuse.Status{"root": fuse.ENOTSUP, "dir": fuse.ENOTSUP, "imported": fuse.EBADF, "pulled": fuse.EBADF})},
	"OpenDir": {func(x *opsFS, k string) fuse.Status {
		var out fuse.OpenOut
		st := x.raw.OpenDir(nil, &fuse.OpenIn{InHeader: hdr(x.ids[k])}, &out)
		if st == fuse.OK {
			x.raw.ReleaseDir(&fuse.ReleaseIn{InHeader: hdr(x.ids[k]), Fh: out.Fh})
		}
		return st
	}, nil},
	"ReadDir": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			return x.raw.ReadDir(nil, &fuse.ReadIn{InHeader: hdr(x.ids[k]), Fh: fh, Size: 4096}, fuse.NewDirEntryList(make([]byte, 4096), 0))
		})
	}, neverOpened}, // a segment's handle lists nothing (go-fuse); the kernel never asks
	"ReadDirPlus": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			return x.raw.ReadDirPlus(nil, &fuse.ReadIn{InHeader: hdr(x.ids[k]), Fh: fh, Size: 4096}, fuse.NewDirEntryList(make([]byte, 4096), 0))
		})
	}, neverOpened},
	"ReleaseDir": {func(x *opsFS, k string) fuse.Status {
		var out fuse.OpenOut
		if x.raw.OpenDir(nil, &fuse.OpenIn{InHeader: hdr(x.ids[k])}, &out) == fuse.OK {
			x.raw.ReleaseDir(&fuse.ReleaseIn{InHeader: hdr(x.ids[k]), Fh: out.Fh})
		}
		return void
	}, allOf(void)},
	"FsyncDir": {func(x *opsFS, k string) fuse.Status {
		return x.withFh(k, func(fh uint64) fuse.Status {
			return x.raw.FsyncDir(nil, &fuse.FsyncIn{InHeader: hdr(x.ids[k]), Fh: fh})
		})
	}, merge(neverOpened, map[string]fuse.Status{"host": fuse.ENOTSUP, "shared": fuse.ENOTSUP, "imported": fuse.ENOTSUP, "device": fuse.ENOTSUP, "pulled": fuse.ENOTSUP})},
	"StatFs": {func(x *opsFS, k string) fuse.Status {
		return x.raw.StatFs(nil, ptr(hdr(x.ids[k])), &fuse.StatfsOut{})
	}, nil},
	"Statx": {func(x *opsFS, k string) fuse.Status {
		var sx fuse.StatxOut
		if st := x.raw.Statx(nil, &fuse.StatxIn{InHeader: hdr(x.ids[k])}, &sx); st != fuse.OK {
			return st
		}
		var a fuse.AttrOut
		x.raw.GetAttr(nil, &fuse.GetAttrIn{InHeader: hdr(x.ids[k])}, &a)
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
	for _, op := range ops {
		row := opMatrix[op]
		t.Run(op, func(t *testing.T) {
			x := newOpsFS(t)
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
}
