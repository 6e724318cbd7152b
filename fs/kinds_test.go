package fs

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ctl"
	"tensorfs/fdpass"
	"tensorfs/gpu"
	"tensorfs/internal/tmpfstest"
)

// TestVirtualAttributes: every name listxattr gives, on every kind of
// node, reads back through getxattr, and says what it should of that kind.
func TestVirtualAttributes(t *testing.T) {
	x := newOpsFS(t)
	for _, k := range opKinds {
		names := x.listxattr(k)
		for _, name := range names {
			if _, st := x.getxattr(k, name); st != fuse.OK {
				t.Errorf("%s: listxattr gives %s, whose getxattr is %v", k, name, st)
			}
		}
		v, _ := x.getxattr(k, alloc.AttrFlags)
		switch k {
		case "symlink", "fifo":
			if len(names) != 0 {
				t.Errorf("%s lists attributes %v; tmpfs gives none", k, names)
			}
		case "imported":
			if !strings.Contains(v, "FROMFD") {
				t.Errorf("imported flags %q, want FROMFD", v)
			}
		case "shared":
			if v != "SHARED" {
				t.Errorf("shared flags %q, want SHARED", v)
			}
		case "device":
			if d, _ := x.getxattr(k, alloc.AttrDevice); d != "cuda:0" {
				t.Errorf("device segment's device %q", d)
			}
			for _, name := range []string{alloc.AttrCudaIPCHandle, alloc.AttrCudaEventHandle} {
				if h, st := x.getxattr(k, name); st != fuse.OK || len(h) != 64 {
					t.Errorf("%s: %d bytes, %v; want 64", name, len(h), st)
				}
			}
			if c, _ := x.getxattr(k, alloc.AttrCudaRefCounter); !strings.HasSuffix(c, ":0") {
				t.Errorf("ref_counter %q, want PATH:0", c)
			}
			if _, st := x.getxattr(k, alloc.AttrHandle); st != fuse.ENOATTR {
				t.Errorf("a device segment's handle: %v, want ENODATA (no host file)", st)
			}
		default:
			if !segmentKinds[k] {
				break
			}
			if v != "SHAREDMEM" {
				t.Errorf("%s flags %q, want SHAREDMEM", k, v)
			}
		}
		if k == "unavailable" {
			if _, st := x.getxattr(k, alloc.AttrHandle); st != fuse.ENOTSUP {
				t.Errorf("an unavailable segment's handle: %v, want EOPNOTSUPP (no file holds its bytes)", st)
			}
		}
		if segmentKinds[k] && k != "device" && k != "unavailable" {
			h, st := x.getxattr(k, alloc.AttrHandle)
			if st != fuse.OK {
				t.Errorf("%s handle: %v", k, st)
			} else if f, err := os.Open(h); err != nil {
				t.Errorf("%s handle %q does not open: %v", k, h, err)
			} else {
				f.Close()
			}
		}
	}
	var stats struct {
		Segments int64
		Requests map[string]int64
	}
	v, st := x.getxattr("root", alloc.AttrStats)
	if st != fuse.OK || jsonDecode(v, &stats) != nil || stats.Segments != 6 {
		t.Errorf("stats %s (%v): want 6 segments", v, st)
	}
	if stats.Requests["CREATE"] == 0 || stats.Requests["GETXATTR"] == 0 {
		t.Errorf("stats count no CREATE or GETXATTR: %v", stats.Requests)
	}
	// 8 bytes each for host, shared, device and pulled, 14 for the import.
	if r, _ := x.getxattr("root", alloc.AttrRbytes); r != "46" {
		t.Errorf("rbytes of the root: %s, want 46", r)
	}
}

func (x *opsFS) listxattr(k string) []string {
	buf := make([]byte, 4096)
	n, st := x.raw.ListXAttr(nil, ptr(hdr(x.ids[k])), buf)
	if st != fuse.OK {
		x.t.Fatalf("listxattr %s: %v", k, st)
	}
	var names []string
	for _, s := range strings.Split(string(buf[:n]), "\x00") {
		if s != "" {
			names = append(names, s)
		}
	}
	return names
}

func (x *opsFS) getxattr(k, name string) (string, fuse.Status) {
	buf := make([]byte, 4096)
	n, st := x.raw.GetXAttr(nil, ptr(hdr(x.ids[k])), name, buf)
	return string(buf[:n]), st
}

// TestSubtreeUsageAsCaller: rbytes and rsegments count only what the
// caller may list, as du would.
func TestSubtreeUsageAsCaller(t *testing.T) {
	fsys := testFS(t)
	root := &fsys.root.dirNode
	open := mkdir(t, root, "open")
	secret := mkdir(t, root, "secret")
	for _, d := range []*dirNode{open, secret} {
		s := mkseg(t, d, "w")
		var out fuse.AttrOut
		if errno := s.Setattr(callerCtx(0), nil, &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{Valid: fuse.FATTR_SIZE, Size: 100}}, &out); errno != 0 {
			t.Fatal(errno)
		}
	}
	if err := os.Chmod(filepath.Join(fsys.store.Dir, "secret"), 0o700); err != nil {
		t.Fatal(err)
	}
	get := func(uid uint32, attr string) string {
		buf := make([]byte, 64)
		n, errno := root.Getxattr(callerCtx(uid), attr, buf)
		if errno != 0 {
			t.Fatalf("getxattr %s as %d: %v", attr, uid, errno)
		}
		return string(buf[:n])
	}
	if b, s := get(0, alloc.AttrRbytes), get(0, alloc.AttrRsegments); b != "200" || s != "2" {
		t.Errorf("root sees %s bytes in %s segments, want 200 in 2", b, s)
	}
	if b, s := get(4321, alloc.AttrRbytes), get(4321, alloc.AttrRsegments); b != "100" || s != "1" {
		t.Errorf("another user sees %s bytes in %s segments, want 100 in 1 (not the 0700 directory's)", b, s)
	}
}

// TestControlLoad: load hands out every readable segment under a
// directory, a new read-only description for each (none for a device
// segment), in pages, and refuses write to a FROMFD segment.
func TestControlLoad(t *testing.T) {
	x := newOpsFS(t)
	// A segment this mount cannot serve fails a load with its reason.
	if _, _, _, err := (controlBackend{x.fsys}).Load(rootPeer, ".", false, "", 100, new(any)); !errors.Is(err, alloc.ErrNoDevice) {
		t.Errorf("load of a directory holding an unavailable segment: %v, want ErrNoDevice", err)
	}
	if st := x.raw.Unlink(nil, ptr(hdr(1)), "unavailable"); st != fuse.OK {
		t.Fatal(st)
	}
	b := controlBackend{x.fsys}
	segs, files, more, err := b.Load(rootPeer, ".", false, "", 100, new(any))
	if err != nil || more {
		t.Fatalf("load: %v, more %v", err, more)
	}
	got := map[string]bool{}
	for i, s := range segs {
		got[s.Name] = files[i] >= 0
		if fd := files[i]; fd >= 0 {
			if fl, _ := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0); fl&unix.O_ACCMODE != unix.O_RDONLY {
				t.Errorf("%s: descriptor opened %#o, want read-only", s.Name, fl&unix.O_ACCMODE)
			}
			unix.Close(fd)
		}
	}
	want := map[string]bool{"host": true, "imported": true, "sdir/shared": true, "gdir/device": false}
	for name, fd := range want {
		if has, ok := got[name]; !ok || has != fd {
			t.Errorf("load gives %s: listed %v, descriptor %v; want listed, descriptor %v", name, ok, has, fd)
		}
	}
	cursor := new(any) // one connection's
	first, firstFiles, more, err := b.Load(rootPeer, ".", false, "", 2, cursor)
	fdpass.Close(firstFiles)
	if err != nil || !more || len(first) != 2 {
		t.Fatalf("a page of 2: %d segments, more %v, %v", len(first), more, err)
	}
	rest, restFiles, more, err := b.Load(rootPeer, ".", false, first[1].Name, 100, cursor)
	fdpass.Close(restFiles)
	if err != nil || more || len(rest) != len(segs)-2 {
		t.Errorf("the rest after %s: %d segments, more %v, %v; want %d", first[1].Name, len(rest), more, err, len(segs)-2)
	}
	if _, _, _, err := b.Load(rootPeer, ".", true, "", 100, new(any)); !errors.Is(err, alloc.ErrReadOnly) {
		t.Errorf("load with write of a directory holding a FROMFD segment: %v, want ErrReadOnly", err)
	}
	other := ctl.Cred{Pid: int32(os.Getpid()), Uid: 4321, Gid: 4321}
	if _, _, _, err := b.Load(other, ".", false, "", 100, new(any)); !errors.Is(err, syscall.EACCES) {
		t.Errorf("load by another user of a private mount: %v, want EACCES", err)
	}
}

// TestDeviceSpillRestore: a clean close spills device segments into their
// backing files; the next mount restores them with a GPU, and without one
// shows them unavailable, keeping their bytes, until a mount with a GPU.
func TestDeviceSpillRestore(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("device segments keep their state in trusted attributes: root only")
	}
	top := tmpfstest.Dir(t)
	os.Chmod(top, 0o700)
	backing := filepath.Join(top, "backing")
	os.Mkdir(backing, 0o755)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	store, err := alloc.Open(alloc.Config{Backing: backing}, log)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	mount := func(dev gpu.Device) *filesystem {
		_, _, rec, err := Recover(store, 0)
		if err != nil {
			t.Fatal(err)
		}
		fsys, err := newFilesystem(Options{Store: store, Log: log, Mountpoint: filepath.Join(top, "mnt"), GPU: dev, Recovered: rec})
		if err != nil {
			t.Fatal(err)
		}
		fusefs.NewNodeFS(fsys.root, &fusefs.Options{})
		return fsys
	}
	payload := bytes.Repeat([]byte("device!"), 1000)

	fsys := mount(gpu.NewSim(0, 1<<30))
	g := mkdir(t, &fsys.root.dirNode, "g")
	if errno := g.Setxattr(callerCtx(0), alloc.AttrDevice, []byte("cuda:0"), 0); errno != 0 {
		t.Fatal(errno)
	}
	var out fuse.EntryOut
	_, fh, _, errno := g.Create(callerCtx(0), "w", unix.O_RDWR, 0o644, &out)
	if errno != 0 {
		t.Fatal(errno)
	}
	h := fh.(*deviceHandle)
	if _, errno := h.Write(callerCtx(0), payload, 0); errno != 0 {
		t.Fatal(errno)
	}
	h.Release(callerCtx(0))
	fsys.close() // spills

	if fi, err := os.Stat(filepath.Join(backing, "g", "w")); err != nil || fi.Size() != int64(len(payload)) {
		t.Fatalf("after a clean close the backing file holds %v bytes (%v), want the %d spilled", fi.Size(), err, len(payload))
	}

	// Without a GPU: seen, unavailable, kept.
	fsys = mount(nil)
	g2 := mkdir2(t, &fsys.root.dirNode, "g")
	seg := lookupSeg(t, g2, "w")
	if _, _, errno := seg.Open(callerCtx(0), unix.O_RDONLY); errno != syscall.EOPNOTSUPP {
		t.Errorf("open of a device segment on a mount without a GPU: %v, want EOPNOTSUPP", errno)
	}
	var a fuse.AttrOut
	if errno := seg.Getattr(callerCtx(0), nil, &a); errno != 0 || a.Size != uint64(len(payload)) {
		t.Errorf("stat of an unavailable device segment: %v, %d bytes", errno, a.Size)
	}
	if errno := seg.Setattr(callerCtx(0), nil, &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{Valid: fuse.FATTR_SIZE}}, &a); errno != syscall.EOPNOTSUPP {
		t.Errorf("truncate of an unavailable device segment: %v, want EOPNOTSUPP", errno)
	}
	if _, err := (controlBackend{fsys}).Export(rootPeer, "g/w", false); !errors.Is(err, alloc.ErrReadOnly) && !errors.Is(err, alloc.ErrNoDevice) {
		t.Errorf("export of an unavailable device segment: %v", err)
	}
	fsys.close()

	// With one again: restored.
	fsys = mount(gpu.NewSim(0, 1<<30))
	defer fsys.close()
	g3 := mkdir2(t, &fsys.root.dirNode, "g")
	seg = lookupSeg(t, g3, "w")
	fh2, _, errno := seg.Open(callerCtx(0), unix.O_RDONLY)
	if errno != 0 {
		t.Fatalf("open after restore: %v", errno)
	}
	defer fh2.(*deviceHandle).Release(callerCtx(0))
	buf := make([]byte, len(payload))
	r, errno := fh2.(*deviceHandle).Read(callerCtx(0), buf, 0)
	if errno != 0 {
		t.Fatal(errno)
	}
	if got, _ := r.Bytes(buf); !bytes.Equal(got, payload) {
		t.Errorf("restored device segment reads %d bytes, not what was written", len(got))
	}
	if fi, err := os.Stat(filepath.Join(backing, "g", "w")); err != nil || fi.Size() != 0 {
		t.Errorf("a restored segment's backing file holds %v bytes (%v), want 0", fi.Size(), err)
	}
}

// mkdir2 looks up an existing directory through the handlers.
func mkdir2(t *testing.T, parent *dirNode, name string) *dirNode {
	t.Helper()
	var out fuse.EntryOut
	ch, errno := parent.Lookup(callerCtx(0), name, &out)
	if errno != 0 {
		t.Fatalf("lookup %s: %v", name, errno)
	}
	parent.AddChild(name, ch, false)
	return ch.Operations().(*dirNode)
}

// lookupSeg looks up an existing segment through the handlers.
func lookupSeg(t *testing.T, parent *dirNode, name string) *segmentNode {
	t.Helper()
	var out fuse.EntryOut
	ch, errno := parent.Lookup(callerCtx(0), name, &out)
	if errno != 0 {
		t.Fatalf("lookup %s: %v", name, errno)
	}
	parent.AddChild(name, ch, false)
	return ch.Operations().(*segmentNode)
}

// TestUnlinkSegmentReclaimed: an UNLINK segment goes with its last
// handle, and its backing file with it.
func TestUnlinkSegmentReclaimed(t *testing.T) {
	fsys := testFS(t)
	root := &fsys.root.dirNode
	d := mkdir(t, root, "tmp")
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
	if _, err := os.Stat(p); err != nil {
		t.Fatal(err)
	}
	fh.(*fileHandle).Release(callerCtx(0))
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(p); errors.Is(err, os.ErrNotExist) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the UNLINK segment is still there after its last handle went")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func jsonDecode(s string, v any) error { return json.Unmarshal([]byte(s), v) }

// TestSubtreeUsageCountsTiesOnce: a segment with two names (tied weights)
// counts once in rbytes and rsegments.
func TestSubtreeUsageCountsTiesOnce(t *testing.T) {
	x := newOpsFS(t)
	bytesBefore, _ := x.getxattr("root", alloc.AttrRbytes)
	segsBefore, _ := x.getxattr("root", alloc.AttrRsegments)
	var out fuse.EntryOut
	if st := x.raw.Link(nil, &fuse.LinkIn{InHeader: hdr(x.ids["dir"]), Oldnodeid: x.ids["host"]}, "tied", &out); st != fuse.OK {
		t.Fatal(st)
	}
	if b, _ := x.getxattr("root", alloc.AttrRbytes); b != bytesBefore {
		t.Errorf("rbytes with a tie: %s, want %s as before (the tie counted once)", b, bytesBefore)
	}
	if s, _ := x.getxattr("root", alloc.AttrRsegments); s != segsBefore {
		t.Errorf("rsegments with a tie: %s, want %s as before", s, segsBefore)
	}
}

// TestFlagsAreTheOwners: only a segment's or directory's owner, or root,
// sets or removes its flags (EPERM), whoever may write it.
func TestFlagsAreTheOwners(t *testing.T) {
	x := newOpsFS(t)
	for _, k := range []string{"dir", "host"} {
		in := hdr(x.ids[k])
		in.Uid, in.Gid = 4321, 4321
		if st := x.raw.SetXAttr(nil, &fuse.SetXAttrIn{InHeader: in, Size: 6}, alloc.AttrFlags, []byte("UNLINK")); st != fuse.EPERM {
			t.Errorf("%s: a non-owner sets flags: %v, want EPERM", k, st)
		}
		if st := x.raw.RemoveXAttr(nil, &in, alloc.AttrFlags); st != fuse.EPERM {
			t.Errorf("%s: a non-owner removes flags: %v, want EPERM", k, st)
		}
	}
	x.setxattr(x.ids["dir"], alloc.AttrFlags, "NOCREATE") // root may
}

// TestRenameWithinNoCreate: a NOCREATE directory's names are sealed; an
// exchange within it keeps them and is allowed.
func TestRenameWithinNoCreate(t *testing.T) {
	x := newOpsFS(t)
	dir := x.mkdir(1, "sealed")
	x.segment(dir, "a")
	x.segment(dir, "b")
	x.setxattr(dir, alloc.AttrFlags, "NOCREATE")
	for _, to := range []string{"c", "b"} {
		if st := x.raw.Rename(nil, &fuse.RenameIn{InHeader: hdr(dir), Newdir: dir}, "a", to); st != fuse.EPERM {
			t.Errorf("rename a to %s within NOCREATE: %v, want EPERM", to, st)
		}
	}
	if st := x.raw.Rename(nil, &fuse.RenameIn{InHeader: hdr(dir), Newdir: dir, Flags: unix.RENAME_EXCHANGE}, "a", "b"); st != fuse.OK {
		t.Errorf("exchange of a and b within NOCREATE: %v, want OK", st)
	}
}
