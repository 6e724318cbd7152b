package fs

import (
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// TestHandoverForgetOfRemovedNode: the kernel holds a node whose last
// name went until it sends its FORGET, which may reach the next daemon:
// a file unlinked with no handle open, one unlinked while open and then
// closed, and a directory removed. Each is journaled from its removal
// to its FORGET, so that a successor (after a crash, which knows the
// backing's objects and the journal; after a restart, its
// predecessor's state) registers it: a GETATTR of it is ESTALE and its
// FORGET ends it, where go-fuse panicked on an unknown node
// (TestRestartKeepsImports, after "rm" and a SIGKILL).
func TestHandoverForgetOfRemovedNode(t *testing.T) {
	for _, crashed := range []bool{true, false} {
		name := map[bool]string{true: "crash", false: "restart"}[crashed]
		t.Run(name, func(t *testing.T) {
			b := newHandoverBed(t)
			d := b.daemon(0, nil)
			closed, _ := d.create(t, fuse.FUSE_ROOT_ID, "closed", 0, true)
			open, fh := d.create(t, fuse.FUSE_ROOT_ID, "open", 0, false)
			var out fuse.EntryOut
			if st := d.gate.Mkdir(nil, &fuse.MkdirIn{InHeader: bedHeader(1, 0), Mode: 0o755}, "dir", &out); !st.Ok() {
				t.Fatalf("mkdir: %v", st)
			}
			dir := out.NodeId
			for _, n := range []string{"closed", "open"} {
				if st := d.gate.Unlink(nil, ptr(bedHeader(1, 0)), n); !st.Ok() {
					t.Fatalf("unlink %s: %v", n, st)
				}
			}
			if st := d.gate.Rmdir(nil, ptr(bedHeader(1, 0)), "dir"); !st.Ok() {
				t.Fatalf("rmdir: %v", st)
			}
			d.gate.Release(nil, &fuse.ReleaseIn{InHeader: bedHeader(open, 0), Fh: fh})
			removed := []uint64{closed, open, dir}
			for _, id := range removed {
				if !b.unnamed[id] {
					t.Errorf("node %d, removed while the kernel holds it, is not journaled (unnamed %v)", id, b.unnamed)
				}
			}

			var next *bedDaemon
			if crashed {
				next, _ = b.crash(1)
			} else {
				next, _ = b.restart(d, 1)
			}
			for _, id := range removed {
				if st := next.getattr(id); st != fuse.Status(syscall.ESTALE) {
					t.Errorf("getattr of removed node %d in the successor: %v, want ESTALE", id, st)
				}
				noPanic(t, "the successor's FORGET of a removed node", func() { next.gate.Forget(id, 1) })
				if b.unnamed[id] {
					t.Errorf("node %d is still journaled after its FORGET", id)
				}
			}
			if held := next.fsys.orphans.held(); len(held) != 0 {
				t.Errorf("the successor still lists unnamed nodes %v after their FORGET", held)
			}
		})
	}
}
