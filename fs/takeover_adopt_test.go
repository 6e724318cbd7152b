package fs

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// bedUser is the user whose handles a successor takes over.
const bedUser = 1000

// TestHandoverInheritedHandles: a successor, after a restart and after a
// crash, serves the handles its predecessor gave out as the predecessor
// did: a segment's (its reads, writes, truncate, attributes, sync), a
// directory's (its listing), an unlinked open segment's (an orphan,
// from its backing file handed over or journaled), and a removed
// directory's (a stale node: ESTALE to everything, its handle still
// charged). Each inherited handle is charged to its opener, as before,
// until the kernel releases it; a handle of an earlier daemon that the
// successor has not is EBADF to the requests that use it.
func TestHandoverInheritedHandles(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the handles are a user's: the test needs root")
	}
	for _, crashed := range []bool{false, true} {
		t.Run(map[bool]string{true: "crash", false: "restart"}[crashed], func(t *testing.T) {
			b := newHandoverBed(t)
			d := b.usersDaemon()
			root := uint64(fuse.FUSE_ROOT_ID)
			seg, segFh := d.create(t, root, "seg", bedUser, false)
			d.write(t, seg, segFh, "hello")
			orph, orphFh := d.create(t, root, "orph", bedUser, false)
			d.write(t, orph, orphFh, "orphan bytes")
			if st := d.gate.Unlink(nil, ptr(bedHeader(root, bedUser)), "orph"); !st.Ok() {
				t.Fatalf("unlink orph: %v", st)
			}
			dir := d.mkdir(t, root, "dir", bedUser)
			dirFh := d.opendir(t, dir, bedUser)
			gone := d.mkdir(t, root, "gone", bedUser)
			goneFh := d.opendir(t, gone, bedUser)
			if st := d.gate.Rmdir(nil, ptr(bedHeader(root, bedUser)), "gone"); !st.Ok() {
				t.Fatalf("rmdir gone: %v", st)
			}
			charged := d.fsys.handles.Held(bedUser)
			if charged < 4 {
				t.Fatalf("uid %d is charged %d handles before the handover, want at least 4", bedUser, charged)
			}

			var next *bedDaemon
			var lost State
			if crashed {
				next, lost = b.crash(1)
			} else {
				next, lost = b.restart(d, 1)
			}
			if len(lost.Nodes)+len(lost.Handles) > 0 {
				t.Fatalf("the successor lost %+v", lost)
			}
			if got := next.fsys.handles.Held(bedUser); got != charged {
				t.Errorf("the successor charges uid %d %d handles, want the %d it inherited", bedUser, got, charged)
			}

			// The segment's handle: reads and writes reach its bytes.
			if got := next.read(t, seg, segFh, 5); got != "hello" {
				t.Errorf("read of the inherited handle: %q, want hello", got)
			}
			next.write(t, seg, segFh, "HELLO")
			if n, st := next.gate.Writev(nil, &fuse.WriteIn{InHeader: bedHeader(seg, bedUser), Fh: segFh, Offset: 5}, [][]byte{[]byte(" wor"), []byte("ld")}); !st.Ok() || n != 6 {
				t.Errorf("writev of the inherited handle: %d %v", n, st)
			}
			if got, _ := os.ReadFile(filepath.Join(b.store.Dir, "seg")); string(got) != "HELLO world" {
				t.Errorf("the backing holds %q after writes through the inherited handle, want %q", got, "HELLO world")
			}
			in := fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{InHeader: bedHeader(seg, bedUser), Valid: fuse.FATTR_SIZE | fuse.FATTR_FH, Fh: segFh, Size: 5}}
			var attr fuse.AttrOut
			if st := next.gate.SetAttr(nil, &in, &attr); !st.Ok() || attr.Size != 5 {
				t.Errorf("ftruncate through the inherited handle: %v, size %d, want 5", st, attr.Size)
			}
			if st := next.gate.GetAttr(nil, &fuse.GetAttrIn{InHeader: bedHeader(seg, bedUser), Flags_: fuse.FUSE_GETATTR_FH, Fh_: segFh}, &attr); !st.Ok() || attr.Size != 5 {
				t.Errorf("fstat of the inherited handle: %v, size %d, want 5", st, attr.Size)
			}
			var sx fuse.StatxOut
			if st := next.gate.Statx(nil, &fuse.StatxIn{InHeader: bedHeader(seg, bedUser), GetattrFlags: fuse.FUSE_GETATTR_FH, Fh: segFh, SxMask: unix.STATX_SIZE}, &sx); st.Ok() && sx.Size != 5 {
				t.Errorf("statx of the inherited handle: size %d, want 5", sx.Size)
			}
			var seek fuse.LseekOut
			if st := next.gate.Lseek(nil, &fuse.LseekIn{InHeader: bedHeader(seg, bedUser), Fh: segFh, Whence: unix.SEEK_DATA}, &seek); !st.Ok() && st != fuse.ENOSYS {
				t.Errorf("lseek of the inherited handle: %v", st)
			}
			if st := next.gate.Flush(nil, &fuse.FlushIn{InHeader: bedHeader(seg, bedUser), Fh: segFh}); !st.Ok() {
				t.Errorf("flush of the inherited handle: %v", st)
			}
			if st := next.gate.Fsync(nil, &fuse.FsyncIn{InHeader: bedHeader(seg, bedUser), Fh: segFh}); !st.Ok() && st != fuse.ENOSYS {
				t.Errorf("fsync of the inherited handle: %v", st)
			}

			// The directory's handle lists it.
			if st := next.gate.ReadDir(nil, &fuse.ReadIn{InHeader: bedHeader(dir, bedUser), Fh: dirFh, Size: 4096}, fuse.NewDirEntryList(make([]byte, 4096), 0)); !st.Ok() {
				t.Errorf("readdir of the inherited directory handle: %v", st)
			}
			if st := next.gate.FsyncDir(nil, &fuse.FsyncIn{InHeader: bedHeader(dir, bedUser), Fh: dirFh}); !st.Ok() && st != fuse.ENOSYS {
				t.Errorf("fsyncdir of the inherited directory handle: %v", st)
			}

			// The orphan is itself again, from its backing file.
			if got := next.read(t, orph, orphFh, 12); got != "orphan bytes" {
				t.Errorf("read of the inherited orphan's handle: %q, want %q", got, "orphan bytes")
			}

			// The removed directory is stale, its handle charged still.
			list := fuse.NewDirEntryList(make([]byte, 4096), 0)
			if st := next.gate.ReadDirPlus(nil, &fuse.ReadIn{InHeader: bedHeader(gone, bedUser), Fh: goneFh, Size: 4096}, list); st != fuse.Status(syscall.ESTALE) {
				t.Errorf("readdir of the removed directory's handle: %v, want ESTALE", st)
			}
			stale := map[string]fuse.Status{
				"getattr":     next.getattr(gone),
				"setxattr":    next.gate.SetXAttr(nil, &fuse.SetXAttrIn{InHeader: bedHeader(gone, 0), Size: 1}, "user.x", []byte("1")),
				"removexattr": next.gate.RemoveXAttr(nil, ptr(bedHeader(gone, 0)), "user.x"),
				"statfs":      next.gate.StatFs(nil, ptr(bedHeader(gone, 0)), &fuse.StatfsOut{}),
				"open":        next.gate.OpenDir(nil, &fuse.OpenIn{InHeader: bedHeader(gone, 0)}, &fuse.OpenOut{}),
				"setattr":     next.gate.SetAttr(nil, &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{InHeader: bedHeader(gone, 0), Valid: fuse.FATTR_MODE, Mode: 0o700}}, &attr),
			}
			_, stale["getxattr"] = next.gate.GetXAttr(nil, ptr(bedHeader(gone, 0)), "user.x", make([]byte, 16))
			_, stale["listxattr"] = next.gate.ListXAttr(nil, ptr(bedHeader(gone, 0)), make([]byte, 16))
			for op, st := range stale {
				if st != fuse.Status(syscall.ESTALE) {
					t.Errorf("%s of the removed directory in the successor: %v, want ESTALE", op, st)
				}
			}

			// A handle of an earlier daemon that the successor has not.
			unknown := uint64(0)<<32 | 77
			if _, st := next.gate.Read(nil, &fuse.ReadIn{InHeader: bedHeader(seg, 0), Fh: unknown, Size: 1}, make([]byte, 1)); st != fuse.Status(syscall.EBADF) {
				t.Errorf("read of an unknown earlier handle: %v, want EBADF", st)
			}
			if _, st := next.gate.Write(nil, &fuse.WriteIn{InHeader: bedHeader(seg, 0), Fh: unknown}, []byte("x")); st != fuse.Status(syscall.EBADF) {
				t.Errorf("write of an unknown earlier handle: %v, want EBADF", st)
			}
			if st := next.gate.Fallocate(nil, &fuse.FallocateIn{InHeader: bedHeader(seg, 0), Fh: unknown, Length: 1}); st != fuse.Status(syscall.EBADF) {
				t.Errorf("fallocate of an unknown earlier handle: %v, want EBADF", st)
			}
			if _, st := next.gate.CopyFileRange(nil, &fuse.CopyFileRangeIn{InHeader: bedHeader(seg, 0), FhIn: segFh, FhOut: unknown, Len: 1}); st != fuse.Status(syscall.EBADF) {
				t.Errorf("copy_file_range to an unknown earlier handle: %v, want EBADF", st)
			}
			if st := next.gate.Ioctl(nil, &fuse.IoctlIn{InHeader: bedHeader(seg, 0), Fh: unknown}, nil, &fuse.IoctlOut{}, nil); st != fuse.Status(syscall.ENOTTY) {
				t.Errorf("ioctl of an unknown earlier handle: %v, want ENOTTY", st)
			}
			if st := next.gate.Fsync(nil, &fuse.FsyncIn{InHeader: bedHeader(seg, 0), Fh: unknown}); !st.Ok() {
				t.Errorf("fsync of an unknown earlier handle: %v, want OK (its bytes are in the backing)", st)
			}

			// Each release gives its opener's charge back, and the journal
			// forgets it.
			next.gate.Release(nil, &fuse.ReleaseIn{InHeader: bedHeader(seg, bedUser), Fh: segFh})
			next.gate.Release(nil, &fuse.ReleaseIn{InHeader: bedHeader(orph, bedUser), Fh: orphFh})
			next.gate.ReleaseDir(&fuse.ReleaseIn{InHeader: bedHeader(dir, bedUser), Fh: dirFh})
			next.gate.ReleaseDir(&fuse.ReleaseIn{InHeader: bedHeader(gone, bedUser), Fh: goneFh})
			if got := next.fsys.handles.Held(bedUser); got != 0 {
				t.Errorf("uid %d is charged %d handles after every inherited one was released, want 0", bedUser, got)
			}
			if len(b.handles) != 0 || len(b.orphans) != 0 {
				t.Errorf("the journal holds handles %v and orphans %v after every release", b.handles, b.orphans)
			}
			if _, err := os.Lstat(filepath.Join(b.store.Dir, "orph")); err == nil {
				t.Errorf("the orphan has a name again")
			}
		})
	}
}

// write writes s at offset 0 of node's handle fh through d.
func (d *bedDaemon) write(t *testing.T, node, fh uint64, s string) {
	t.Helper()
	if n, st := d.gate.Write(nil, &fuse.WriteIn{InHeader: bedHeader(node, bedUser), Fh: fh}, []byte(s)); !st.Ok() || int(n) != len(s) {
		t.Fatalf("write of %q: %d %v", s, n, st)
	}
}

// read reads n bytes at offset 0 of node's handle fh through d.
func (d *bedDaemon) read(t *testing.T, node, fh uint64, n int) string {
	t.Helper()
	buf := make([]byte, n)
	res, st := d.gate.Read(nil, &fuse.ReadIn{InHeader: bedHeader(node, bedUser), Fh: fh, Size: uint32(n)}, buf)
	if !st.Ok() {
		t.Fatalf("read: %v", st)
	}
	got, st := res.Bytes(buf)
	if !st.Ok() {
		t.Fatalf("read: %v", st)
	}
	return string(got)
}

// mkdir makes the directory name in parent through d as uid.
func (d *bedDaemon) mkdir(t *testing.T, parent uint64, name string, uid uint32) uint64 {
	t.Helper()
	var out fuse.EntryOut
	if st := d.gate.Mkdir(nil, &fuse.MkdirIn{InHeader: bedHeader(parent, uid), Mode: 0o755}, name, &out); !st.Ok() {
		t.Fatalf("mkdir %s: %v", name, st)
	}
	return out.NodeId
}

// opendir opens the directory node through d as uid.
func (d *bedDaemon) opendir(t *testing.T, node uint64, uid uint32) uint64 {
	t.Helper()
	var out fuse.OpenOut
	if st := d.gate.OpenDir(nil, &fuse.OpenIn{InHeader: bedHeader(node, uid), Flags: unix.O_RDONLY}, &out); !st.Ok() {
		t.Fatalf("opendir: %v", st)
	}
	return out.Fh
}
