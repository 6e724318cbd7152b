package fs

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// TestHandoverImports: an imported segment's bytes are its sender's
// file, which a successor takes over from its predecessor (a restart) or
// the keeper's journal (a crash), charged to the sender as before, and
// serves at its name. After a crash, an import whose removal was
// journaled but whose marker was not removed yet loses its name (and
// its inode's charge), and a descriptor whose marker was never made is
// closed, charged to no one.
func TestHandoverImports(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the imports are a user's: the test needs root")
	}
	for _, crashed := range []bool{false, true} {
		t.Run(map[bool]string{true: "crash", false: "restart"}[crashed], func(t *testing.T) {
			b := newHandoverBed(t)
			d := b.usersDaemon()
			imp := func(name string) Import {
				t.Helper()
				f := memfd(t, "tensor "+name)
				if err := (controlBackend{d.fsys}).Import(ownerPeer, name, f, "uint8", ""); err != nil {
					t.Fatalf("import %s: %v", name, err)
				}
				return d.importOf(t, f)
			}
			imp("a")
			gone := imp("b")
			if got := d.fsys.handles.Held(ownerPeer.Uid); got != 2 {
				t.Fatalf("uid %d is charged %d descriptors for two imports", ownerPeer.Uid, got)
			}
			want := map[string]bool{"a": true, "b": true}
			var next *bedDaemon
			if crashed {
				// b's removal was journaled when the daemon died, and an
				// import that never made its marker was.
				b.record(Record{Unimport: &gone})
				b.record(Record{Import: &Import{ID: "never-marked", UID: ownerPeer.Uid}, Fd: dupFd(t, memfd(t, "x"))})
				want["b"] = false
				next, _ = b.crash(1)
			} else {
				next, _ = b.restart(d, 1)
			}
			for name, there := range want {
				_, err := os.Lstat(filepath.Join(b.store.Dir, name))
				if (err == nil) != there {
					t.Errorf("after the takeover, %s is there: %v, want %v", name, err == nil, there)
				}
			}
			n := 0
			for _, there := range want {
				if there {
					n++
				}
			}
			if got := next.fsys.handles.Held(ownerPeer.Uid); got != int64(n) {
				t.Errorf("the successor charges uid %d %d descriptors, want one per import it took over (%d)", ownerPeer.Uid, got, n)
			}
			a := next.lookup(t, fuse.FUSE_ROOT_ID, "a")
			var out fuse.OpenOut
			if st := next.gate.Open(nil, &fuse.OpenIn{InHeader: bedHeader(a, ownerPeer.Uid), Flags: unix.O_RDONLY}, &out); !st.Ok() {
				t.Fatalf("open of the import taken over: %v", st)
			}
			if got := next.read(t, a, out.Fh, 8); got != "tensor a" {
				t.Errorf("the import taken over reads %q, want %q", got, "tensor a")
			}
			next.gate.Release(nil, &fuse.ReleaseIn{InHeader: bedHeader(a, ownerPeer.Uid), Fh: out.Fh})
			if st := next.gate.Unlink(nil, ptr(bedHeader(fuse.FUSE_ROOT_ID, ownerPeer.Uid)), "a"); !st.Ok() {
				t.Fatalf("unlink of the import taken over: %v", st)
			}
			if got := next.fsys.handles.Held(ownerPeer.Uid); got != int64(n-1) {
				t.Errorf("uid %d is charged %d descriptors once an import taken over is removed, want %d", ownerPeer.Uid, got, n-1)
			}
			journaled := map[string]bool{}
			for k := range b.imports {
				journaled[k.ID] = true
			}
			if len(journaled) != n-1 || want["b"] != journaled[gone.ID] {
				t.Errorf("the journal holds imports %v, want b's (%s) alone if b is there", journaled, gone.ID)
			}
		})
	}
}

// importOf returns the import of d whose descriptor is of f's file.
func (d *bedDaemon) importOf(t *testing.T, f *os.File) Import {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	d.fsys.imports.mu.RLock()
	defer d.fsys.imports.mu.RUnlock()
	for _, in := range d.fsys.imports.m {
		if in.ino == st.Ino && in.dev == st.Dev {
			return Import{ID: in.id, UID: in.uid}
		}
	}
	t.Fatalf("no import of %s", f.Name())
	return Import{}
}

// dupFd returns a duplicate of f's descriptor.
func dupFd(t *testing.T, f *os.File) int {
	t.Helper()
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	return fd
}

// TestHandoverLateImport: an import into a directory of UNLINK segments
// made after the successor recovered the backing and before its
// predecessor froze (a restart's window) is taken over, charged to its
// sender, and goes once its sender maps it no more, as one recovery saw
// does (keepUnlinkedImports): the successor found no marker for it, so
// no watch waited, and it kept its sender's memory and descriptor until
// unmount.
func TestHandoverLateImport(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the import is a user's: the test needs root")
	}
	b := newHandoverBed(t)
	d := b.usersDaemon()
	dir := filepath.Join(b.store.Dir, "u")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(dir, int(ownerPeer.Uid), int(ownerPeer.Gid)); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(dir, alloc.StoredName(alloc.AttrFlags), []byte("UNLINK"), 0); err != nil {
		t.Fatal(err)
	}
	rec := b.recover() // the successor's, before the import
	if err := (controlBackend{d.fsys}).Import(ownerPeer, "u/seg", memfd(t, "late"), "", ""); err != nil {
		t.Fatal(err)
	}
	next, _ := b.takeOver(b.handover(d, 1), rec)
	if got := next.fsys.handles.Held(ownerPeer.Uid); got != 1 {
		t.Fatalf("the successor charges uid %d %d descriptors, want the import's", ownerPeer.Uid, got)
	}
	next.fsys.afterMount(filepath.Join(b.top, "mnt"), rec) // as Mount does once it serves
	seg := filepath.Join(dir, "seg")
	gone := func() bool {
		_, err := os.Lstat(seg)
		return err != nil && next.fsys.handles.Held(ownerPeer.Uid) == 0
	}
	for end := time.Now().Add(5 * time.Second); !gone() && time.Now().Before(end); {
		time.Sleep(10 * time.Millisecond) // the watch's removal runs on its own
	}
	if _, err := os.Lstat(seg); err == nil {
		t.Errorf("the UNLINK import its sender maps no more is still there")
	}
	if got := next.fsys.handles.Held(ownerPeer.Uid); got != 0 {
		t.Errorf("uid %d is still charged %d descriptors once her UNLINK import went", ownerPeer.Uid, got)
	}
}
