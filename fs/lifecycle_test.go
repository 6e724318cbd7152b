package fs

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// TestLastNameReleasesKind: removing the last name of a segment frees
// what its kind holds (a disk file, an import's descriptor, device
// memory and its backing file, at the last close of a segment open), and renaming a SHARED segment records its new path on its disk
// file.
func TestLastNameReleasesKind(t *testing.T) {
	x := newOpsFS(t)
	store := x.fsys.store
	diskFiles := func() int {
		ents, _ := os.ReadDir(store.Disk)
		return len(ents)
	}
	if diskFiles() != 1 {
		t.Fatalf("the disk holds %d files, want the SHARED segment's", diskFiles())
	}
	sdir := x.parents["shared"]
	if st := x.raw.Rename(nil, &fuse.RenameIn{InHeader: hdr(sdir), Newdir: sdir}, "shared", "moved"); st != fuse.OK {
		t.Fatalf("rename of the SHARED segment: %v", st)
	}
	ents, _ := os.ReadDir(store.Disk)
	if v, _, err := alloc.GetXattr(filepath.Join(store.Disk, ents[0].Name()), "trusted.tensorfs.path"); err != nil || string(v) != "sdir/moved" {
		t.Errorf("the disk file records %q (%v), want sdir/moved", v, err)
	}
	// A directory's rename records the new path of every SHARED segment
	// below it.
	if st := x.raw.Rename(nil, &fuse.RenameIn{InHeader: hdr(1), Newdir: 1}, "sdir", "sdir2"); st != fuse.OK {
		t.Fatalf("rename of the SHARED segment's directory: %v", st)
	}
	if v, _, err := alloc.GetXattr(filepath.Join(store.Disk, ents[0].Name()), "trusted.tensorfs.path"); err != nil || string(v) != "sdir2/moved" {
		t.Errorf("after its directory's rename the disk file records %q (%v), want sdir2/moved", v, err)
	}
	if st := x.raw.Unlink(nil, ptr(hdr(sdir)), "moved"); st != fuse.OK {
		t.Fatal(st)
	}
	if diskFiles() != 0 {
		t.Errorf("after the SHARED segment's last name went the disk holds %d files", diskFiles())
	}

	if _, ok := x.fsys.imports.m[x.importID(t)]; !ok {
		t.Fatal("the import is not held")
	}
	id := x.importID(t)
	held := x.fsys.handles.Held(0) // the import's, and the device segment's backing file
	if st := x.raw.Unlink(nil, ptr(hdr(1)), "imported"); st != fuse.OK {
		t.Fatal(st)
	}
	if _, ok := x.fsys.imports.get(id); ok || x.fsys.handles.Held(0) != held-1 {
		t.Errorf("after the import's last name went the daemon still holds it (%d descriptors for uid 0, %d before)", x.fsys.handles.Held(0), held)
	}

	gdir := x.parents["device"]
	var o fuse.OpenOut // released below, not at cleanup (x.open)
	if st := x.raw.Open(nil, &fuse.OpenIn{InHeader: hdr(x.ids["device"]), Flags: unix.O_RDONLY}, &o); st != fuse.OK {
		t.Fatal(st)
	}
	fh := o.Fh
	held = x.fsys.handles.Held(0) // the open handle's, and the backing file's
	if st := x.raw.Unlink(nil, ptr(hdr(gdir)), "device"); st != fuse.OK {
		t.Fatal(st)
	}
	if x.fsys.handles.Held(0) != held {
		t.Errorf("after a device segment's last name went, open, the daemon holds %d descriptors for uid 0, want %d: its backing file's stays for its handle (a successor claims its block through it)", x.fsys.handles.Held(0), held)
	}
	if blocks, _ := x.fsys.gpu.limbo.Stats(); blocks != 1 {
		t.Errorf("a device segment removed while open: limbo holds %d blocks, want 1", blocks)
	}
	// Still readable through its handle, from limbo.
	buf := make([]byte, 8)
	if r, st := x.raw.Read(nil, &fuse.ReadIn{InHeader: hdr(x.ids["device"]), Fh: fh, Size: 8}, buf); st != fuse.OK {
		t.Errorf("read of a removed device segment: %v", st)
	} else if b, _ := r.Bytes(buf); string(b) != "8 bytes!" {
		t.Errorf("a removed device segment reads %q", b)
	}
	// At its last close, its backing file and its memory go.
	x.raw.Release(nil, &fuse.ReleaseIn{InHeader: hdr(x.ids["device"]), Fh: fh})
	if x.fsys.handles.Held(0) != held-2 {
		t.Errorf("after a removed device segment's last close the daemon holds %d descriptors for uid 0, want %d", x.fsys.handles.Held(0), held-2)
	}
	if blocks, _ := x.fsys.gpu.limbo.Stats(); blocks != 0 {
		t.Errorf("a removed device segment's last close: limbo holds %d blocks, want 0", blocks)
	}
}

// importID returns the id of the "imported" segment's import.
func (x *opsFS) importID(t *testing.T) string {
	t.Helper()
	for id := range x.fsys.imports.m {
		return id
	}
	t.Fatal("no import")
	return ""
}

// TestSegmentChangesDevice: an empty segment moves to the device and
// back with its device attribute, only while nobody has it open.
func TestSegmentChangesDevice(t *testing.T) {
	x := newOpsFS(t)
	var out fuse.CreateOut
	if st := x.raw.Create(nil, &fuse.CreateIn{InHeader: hdr(1), Flags: unix.O_RDWR, Mode: 0o644}, "mover", &out); st != fuse.OK {
		t.Fatal(st)
	}
	id := out.NodeId
	set := func(v string) fuse.Status {
		return x.raw.SetXAttr(nil, &fuse.SetXAttrIn{InHeader: hdr(id), Size: uint32(len(v))}, alloc.AttrDevice, []byte(v))
	}
	if st := set("cuda:0"); st != fuse.EBUSY {
		t.Errorf("device change while open: %v, want EBUSY", st)
	}
	x.raw.Release(nil, &fuse.ReleaseIn{InHeader: hdr(id), Fh: out.Fh})
	if st := set("cuda:0"); st != fuse.OK {
		t.Fatalf("device change of a closed empty segment: %v", st)
	}
	seg := x.node(id).(*segmentNode)
	if seg.storage().kind() != alloc.Device {
		t.Fatalf("after the change the segment's kind is %v", seg.storage().kind())
	}
	var o fuse.OpenOut
	x.raw.Open(nil, &fuse.OpenIn{InHeader: hdr(id), Flags: unix.O_RDWR}, &o)
	x.raw.Write(nil, &fuse.WriteIn{InHeader: hdr(id), Fh: o.Fh}, []byte("on the device"))
	var a fuse.AttrOut
	if x.raw.GetAttr(nil, &fuse.GetAttrIn{InHeader: hdr(id)}, &a); a.Size != 13 {
		t.Errorf("size on the device %d, want 13", a.Size)
	}
	x.raw.Release(nil, &fuse.ReleaseIn{InHeader: hdr(id), Fh: o.Fh})
	if st := set("cpu"); st != fuse.EBUSY {
		t.Errorf("device change of a segment with bytes: %v, want EBUSY", st)
	}
	in := &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{InHeader: hdr(id), Valid: fuse.FATTR_SIZE}}
	x.raw.SetAttr(nil, in, &a)
	if st := set("cpu"); st != fuse.OK {
		t.Fatalf("back to the CPU once empty: %v", st)
	}
	if seg.storage().kind() != alloc.Host {
		t.Errorf("after the change back the segment's kind is %v", seg.storage().kind())
	}
	if st := x.raw.SetXAttr(nil, &fuse.SetXAttrIn{InHeader: hdr(x.ids["imported"]), Size: 6}, alloc.AttrDevice, []byte("cuda:0")); st != fuse.EINVAL {
		t.Errorf("device change of an imported segment: %v, want EINVAL", st)
	}
}

// node returns the node of id, through a lookup of its parent's child.
func (x *opsFS) node(id uint64) any {
	for _, c := range x.fsys.root.Children() {
		if c.StableAttr().Ino != 0 {
			var a fuse.AttrOut
			x.raw.GetAttr(nil, &fuse.GetAttrIn{InHeader: hdr(id)}, &a)
			if c.StableAttr().Ino == a.Ino {
				return c.Operations()
			}
		}
	}
	x.t.Fatalf("no node %d in the root", id)
	return nil
}

// TestWritersDropSetid: a user other than root who opens a set-id
// segment for writing, or truncates it, clears its set-id bits, as a
// write on tmpfs would; root keeps them.
func TestWritersDropSetid(t *testing.T) {
	x := newOpsFS(t)
	id := x.ids["host"]
	var a fuse.AttrOut
	chmod := func(mode uint32) {
		in := &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{InHeader: hdr(id), Valid: fuse.FATTR_MODE, Mode: mode}}
		if st := x.raw.SetAttr(nil, in, &a); st != fuse.OK {
			t.Fatal(st)
		}
	}
	mode := func() uint32 {
		x.raw.GetAttr(nil, &fuse.GetAttrIn{InHeader: hdr(id)}, &a)
		return a.Mode & 07777
	}
	chmod(0o6777)
	var o fuse.OpenOut
	x.raw.Open(nil, &fuse.OpenIn{InHeader: hdr(id), Flags: unix.O_RDWR}, &o) // root
	x.raw.Release(nil, &fuse.ReleaseIn{InHeader: hdr(id), Fh: o.Fh})
	if m := mode(); m != 0o6777 {
		t.Errorf("root's open for writing left mode %#o, want 06777", m)
	}
	user := hdr(id)
	user.Caller.Uid, user.Caller.Gid = 4321, 4321
	if st := x.raw.Open(nil, &fuse.OpenIn{InHeader: user, Flags: unix.O_WRONLY}, &o); st != fuse.OK {
		t.Fatal(st)
	}
	x.raw.Release(nil, &fuse.ReleaseIn{InHeader: user, Fh: o.Fh})
	if m := mode(); m != 0o777 {
		t.Errorf("another user's open for writing left mode %#o, want 0777", m)
	}
	chmod(0o6777)
	in := &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{InHeader: user, Valid: fuse.FATTR_SIZE | fuse.FATTR_KILL_SUIDGID, Size: 2}}
	if st := x.raw.SetAttr(nil, in, &a); st != fuse.OK {
		t.Fatal(st)
	}
	if m := mode(); m != 0o777 {
		t.Errorf("a truncate with FATTR_KILL_SUIDGID left mode %#o, want 0777", m)
	}
}

// TestUnlinkedSegmentThroughHandle: a segment unlinked while open is
// reached through its handle: stat, truncate, attributes.
func TestUnlinkedSegmentThroughHandle(t *testing.T) {
	x := newOpsFS(t)
	id := x.ids["host"]
	fh, _ := x.open("host")
	if st := x.raw.Unlink(nil, ptr(hdr(1)), "host"); st != fuse.OK {
		t.Fatal(st)
	}
	var a fuse.AttrOut
	in := &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{InHeader: hdr(id), Valid: fuse.FATTR_SIZE | fuse.FATTR_FH, Fh: fh, Size: 3}}
	if st := x.raw.SetAttr(nil, in, &a); st != fuse.OK || a.Size != 3 {
		t.Errorf("ftruncate of an unlinked segment: %v, size %d", st, a.Size)
	}
	if v, st := x.getxattr("host", alloc.AttrFlags); st != fuse.OK || v != "SHAREDMEM" {
		t.Errorf("flags of an unlinked segment through its handle: %q, %v", v, st)
	}
	if st := x.raw.SetXAttr(nil, &fuse.SetXAttrIn{InHeader: hdr(id), Size: 1}, "user.after", []byte("x")); st != fuse.OK {
		t.Errorf("setxattr of an unlinked segment: %v", st)
	}
}

// TestHoldersNameOpeners: a segment's holders name the process that holds
// it open, with its command name, and refcount counts its handles.
func TestHoldersNameOpeners(t *testing.T) {
	x := newOpsFS(t)
	x.open("host")
	x.open("host")
	h, _ := x.getxattr("host", alloc.AttrHolders)
	self, _ := os.ReadFile("/proc/self/comm")
	want := strconv.Itoa(os.Getpid()) + " " + alloc.Escape(strings.TrimSpace(string(self))) + " 2\n"
	if h != want {
		t.Errorf("holders %q, want %q", h, want)
	}
	if r, _ := x.getxattr("host", alloc.AttrRefcount); r != "2" {
		t.Errorf("refcount %q, want 2", r)
	}
	if comm(1<<30) != "?" {
		t.Error("the command name of no process is not ?")
	}
}

// TestDeviceCopiesAndExport: copies between device segments, and a
// read-only export of device memory that takes no write.
func TestDeviceCopiesAndExport(t *testing.T) {
	x := newOpsFS(t)
	gdir := x.parents["device"]
	other := x.segment(gdir, "other")
	var src, dst fuse.OpenOut
	x.raw.Open(nil, &fuse.OpenIn{InHeader: hdr(x.ids["device"]), Flags: unix.O_RDONLY}, &src)
	x.raw.Open(nil, &fuse.OpenIn{InHeader: hdr(other), Flags: unix.O_RDWR}, &dst)
	n, st := x.raw.CopyFileRange(nil, &fuse.CopyFileRangeIn{InHeader: hdr(x.ids["device"]), FhIn: src.Fh, NodeIdOut: other, FhOut: dst.Fh, OffOut: 8, Len: 8})
	if st != fuse.OK || n != 8 {
		t.Fatalf("device to device copy: %d bytes, %v", n, st)
	}
	buf := make([]byte, 16)
	r, _ := x.raw.Read(nil, &fuse.ReadIn{InHeader: hdr(other), Fh: dst.Fh, Size: 16}, buf)
	if b, _ := r.Bytes(buf); string(b) != "8 bytes!8 bytes!" {
		t.Errorf("after the copy the device segment reads %q", b)
	}
	x.raw.Release(nil, &fuse.ReleaseIn{InHeader: hdr(x.ids["device"]), Fh: src.Fh})
	x.raw.Release(nil, &fuse.ReleaseIn{InHeader: hdr(other), Fh: dst.Fh})

	x.setxattr(gdir, alloc.AttrFlags, "KEEPFD")
	keep := x.segment(gdir, "keep")
	_ = keep
	b := controlBackend{x.fsys}
	ro, err := b.Export(rootPeer, "gdir/keep", false)
	if err != nil {
		t.Fatalf("read-only export of device memory: %v", err)
	}
	defer ro.Close()
	got := make([]byte, 8)
	if _, err := ro.ReadAt(got, 0); err != nil || !bytes.Equal(got, []byte("8 bytes!")) {
		t.Errorf("the export reads %q (%v)", got, err)
	}
	if _, err := ro.WriteAt([]byte("no"), 0); err == nil {
		t.Error("a write through a read-only export of device memory worked")
	}
	rw, err := b.Export(rootPeer, "gdir/keep", true)
	if err != nil {
		t.Fatalf("read-write export: %v", err)
	}
	defer rw.Close()
	if _, err := rw.WriteAt([]byte("EX"), 0); err != nil {
		t.Errorf("a write through the read-write export: %v", err)
	}
	if _, err := b.Export(rootPeer, "host", false); !errors.Is(err, alloc.ErrReadOnly) {
		t.Errorf("export of a segment without KEEPFD: %v, want ErrReadOnly", err)
	}
}

// TestDirectoryDescriptorsBounded: the directory descriptor cache keeps
// at most its bound idle, closing the least recently used, and reopens a
// closed one when it is used again.
func TestDirectoryDescriptorsBounded(t *testing.T) {
	fsys := testFS(t)
	fsys.dirs = newDirFds(4)
	fsys.dirs.pin(&fsys.root.dirNode, fsys.root.fd) // the root's stays
	root := &fsys.root.dirNode
	var dirs []*dirNode
	for i := 0; i < 10; i++ {
		d := mkdir(t, root, "d"+strconv.Itoa(i))
		mkseg(t, d, "s") // uses d's descriptor
		dirs = append(dirs, d)
	}
	if st := fsys.dirs.stats(); st["open"] > 4 {
		t.Errorf("the cache holds %v", st)
	}
	// The first directory's descriptor was closed; it is opened again.
	var out fuse.EntryOut
	if _, errno := dirs[0].Lookup(callerCtx(0), "s", &out); errno != 0 {
		t.Errorf("lookup in a directory whose descriptor was closed: %v", errno)
	}
	dirs[0].OnForget()
	if dirs[0].fd != -1 {
		t.Error("a forgotten idle directory kept its descriptor")
	}
	if st := fsys.dirs.stats(); st["open"] > 4 {
		t.Errorf("the cache holds %v after a reopen", st)
	}
}

// TestCreateInDeviceDirectoryWithoutGPU: a segment cannot be made in a
// cuda:0 directory on a mount without a GPU, and nothing is left behind.
func TestCreateInDeviceDirectoryWithoutGPU(t *testing.T) {
	fsys := testFS(t)
	d := mkdir(t, &fsys.root.dirNode, "g")
	if err := unix.Setxattr(filepath.Join(fsys.store.Dir, "g"), alloc.StoredName(alloc.AttrDevice), []byte("cuda:0"), 0); err != nil {
		t.Fatal(err)
	}
	var out fuse.EntryOut
	if _, _, _, errno := d.Create(callerCtx(0), "w", unix.O_RDWR, 0o644, &out); errno != syscall.EOPNOTSUPP {
		t.Errorf("create in a cuda:0 directory without a GPU: %v, want EOPNOTSUPP", errno)
	}
	if _, err := os.Lstat(filepath.Join(fsys.store.Dir, "g", "w")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the refused create left its file: %v", err)
	}
}

// TestDeviceThroughHandles: a host segment copies into a device segment
// in the device process; a device segment truncates through its handle,
// and once unlinked, its handle still open, its attributes stay.
func TestDeviceThroughHandles(t *testing.T) {
	x := newOpsFS(t)
	src, _ := x.open("host")
	dev := x.ids["device"]
	var d fuse.OpenOut
	x.raw.Open(nil, &fuse.OpenIn{InHeader: hdr(dev), Flags: unix.O_RDWR}, &d)
	defer x.raw.Release(nil, &fuse.ReleaseIn{InHeader: hdr(dev), Fh: d.Fh})
	n, st := x.raw.CopyFileRange(nil, &fuse.CopyFileRangeIn{InHeader: hdr(x.ids["host"]), FhIn: src, NodeIdOut: dev, FhOut: d.Fh, OffOut: 1 << 20, Len: 8})
	if st != fuse.OK || n != 8 {
		t.Fatalf("host to device copy: %d, %v", n, st)
	}
	var a fuse.AttrOut
	if x.raw.GetAttr(nil, &fuse.GetAttrIn{InHeader: hdr(dev)}, &a); a.Size != 1<<20+8 {
		t.Errorf("the device segment grew to %d, want %d", a.Size, 1<<20+8)
	}
	in := &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{InHeader: hdr(dev), Valid: fuse.FATTR_SIZE | fuse.FATTR_FH, Fh: d.Fh, Size: 5}}
	if st := x.raw.SetAttr(nil, in, &a); st != fuse.OK || a.Size != 5 {
		t.Errorf("ftruncate of a device segment: %v, size %d", st, a.Size)
	}
	if st := x.raw.Unlink(nil, ptr(hdr(x.parents["device"])), "device"); st != fuse.OK {
		t.Fatal(st)
	}
	// Its backing file stays while the handle holds it, as a host
	// segment's does: it records the block for a successor.
	if v, st := x.getxattr("device", alloc.AttrDevice); st != fuse.OK || v != "cuda:0" {
		t.Errorf("the device of an unlinked device segment still open: %q %v, want cuda:0", v, st)
	}
}

// TestUnlinkSegmentWaitsForMappings: an UNLINK segment that a process
// still maps after its last handle went stays until the mapping goes.
func TestUnlinkSegmentWaitsForMappings(t *testing.T) {
	fsys := testFS(t)
	d := mkdir(t, &fsys.root.dirNode, "tmp")
	if errno := d.Setxattr(callerCtx(0), alloc.AttrFlags, []byte("UNLINK"), 0); errno != 0 {
		t.Fatal(errno)
	}
	var out fuse.EntryOut
	ch, fh, _, errno := d.Create(callerCtx(0), "t", unix.O_RDWR, 0o600, &out)
	if errno != 0 {
		t.Fatal(errno)
	}
	d.AddChild("t", ch, false)
	p := filepath.Join(fsys.store.Dir, "tmp", "t")
	if err := os.Truncate(p, 4096); err != nil {
		t.Fatal(err)
	}
	m := startMapper(t, p) // maps the backing file, as through the handle path
	fh.(*fileHandle).Release(callerCtx(0))
	fsys.reclaims.Wait()
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("an UNLINK segment still mapped went: %v", err)
	}
	m.unmap(t)
	eventually(t, "the UNLINK segment goes with its last mapping", func() bool {
		_, err := os.Stat(p)
		return errors.Is(err, os.ErrNotExist)
	})
}

// TestRecoverKeepsWhatIsMapped: recovery keeps an UNLINK segment a live
// process maps and removes the others; the mount then watches the kept
// one and removes it when its mapping goes.
func TestRecoverKeepsWhatIsMapped(t *testing.T) {
	fsys := testFS(t)
	dir := fsys.store.Dir
	for _, name := range []string{"mapped", "free"} {
		p := filepath.Join(dir, name)
		os.WriteFile(p, make([]byte, 4096), 0o644)
		if err := unix.Setxattr(p, alloc.StoredName(alloc.AttrFlags), []byte("UNLINK"), 0); err != nil {
			t.Fatal(err)
		}
	}
	// An earlier mount's device, recorded as the daemon does.
	if err := unix.Setxattr(dir, devsAttr, []byte(" 12345"), 0); err != nil {
		t.Fatal(err)
	}
	m := startMapper(t, filepath.Join(dir, "mapped"))
	segs, _, rec, err := Recover(fsys.store, 0)
	if err != nil {
		t.Fatal(err)
	}
	if segs != 1 || len(rec.kept) != 1 {
		t.Errorf("recovery kept %d segments, %d watched; want the mapped one", segs, len(rec.kept))
	}
	if _, err := os.Stat(filepath.Join(dir, "free")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("an UNLINK segment nobody maps survived recovery: %v", err)
	}
	fsys.afterMount(t.TempDir(), rec)
	m.unmap(t)
	eventually(t, "the kept UNLINK segment goes with its last mapping", func() bool {
		_, err := os.Stat(filepath.Join(dir, "mapped"))
		return errors.Is(err, os.ErrNotExist)
	})
}

// eventually polls cond for up to ten seconds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 10 s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestImportedStatIsTheMarkers: stat of an imported segment, with or
// without an open handle, shows its marker's owner and mode (read-only)
// and the size of the sender's file, never the sender's file's mode.
func TestImportedStatIsTheMarkers(t *testing.T) {
	x := newOpsFS(t)
	id := x.ids["imported"]
	var a fuse.AttrOut
	if st := x.raw.GetAttr(nil, &fuse.GetAttrIn{InHeader: hdr(id)}, &a); st != fuse.OK || a.Mode&07777 != 0o444 || a.Size != 14 {
		t.Errorf("stat of an import: %v, mode %#o, %d bytes; want 0444, 14", st, a.Mode&07777, a.Size)
	}
	fh, _ := x.open("imported")
	in := &fuse.GetAttrIn{InHeader: hdr(id), Flags_: fuse.FUSE_GETATTR_FH, Fh_: fh}
	if st := x.raw.GetAttr(nil, in, &a); st != fuse.OK || a.Mode&07777 != 0o444 {
		t.Errorf("fstat of an open import: %v, mode %#o; want 0444 (the marker's, not the memfd's)", st, a.Mode&07777)
	}
}
