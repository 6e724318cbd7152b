package fs

import (
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// TestHandoverForgetOfRemovedNode: the kernel holds a node whose last
// name went until it sends its FORGET, which may reach the next daemon
// (TestRestartKeepsImports: "rm", then a SIGKILL before the daemon read
// the FORGET): a file unlinked with no handle open, and one unlinked
// while open and then closed. A successor, after a crash (which knows
// the backing's objects and the journal) and after a restart (its
// predecessor's state), never had them: their FORGETs, in one batch with
// a FORGET of a node it has, are nothing to forget, where go-fuse
// panicked on an unknown node and dropped the rest of the batch. A
// directory removed (journaled: a process may work in it) is a stale
// node, ESTALE, until its FORGET.
func TestHandoverForgetOfRemovedNode(t *testing.T) {
	for _, crashed := range []bool{true, false} {
		t.Run(map[bool]string{true: "crash", false: "restart"}[crashed], func(t *testing.T) {
			b := newHandoverBed(t)
			d := b.daemon(0, nil)
			root := uint64(fuse.FUSE_ROOT_ID)
			closed, _ := d.create(t, root, "closed", 0, true)
			open, fh := d.create(t, root, "open", 0, false)
			dir := d.mkdir(t, root, "dir", 0)
			for _, n := range []string{"closed", "open"} {
				if st := d.gate.Unlink(nil, ptr(bedHeader(root, 0)), n); !st.Ok() {
					t.Fatalf("unlink %s: %v", n, st)
				}
			}
			if st := d.gate.Rmdir(nil, ptr(bedHeader(root, 0)), "dir"); !st.Ok() {
				t.Fatalf("rmdir: %v", st)
			}
			d.gate.Release(nil, &fuse.ReleaseIn{InHeader: bedHeader(open, 0), Fh: fh})

			var next *bedDaemon
			if crashed {
				next, _ = b.crash(1)
			} else {
				next, _ = b.restart(d, 1)
			}
			if st := next.getattr(dir); st != fuse.Status(syscall.ESTALE) {
				t.Errorf("getattr of the removed directory in the successor: %v, want ESTALE", st)
			}
			// A node of the successor's own, which its FORGET ends.
			own, _ := next.create(t, root, "own", 0, true)
			noPanic(t, "the successor's FORGETs of removed nodes", func() {
				for _, id := range []uint64{closed, open, dir, own} {
					next.gate.Forget(id, 1)
				}
			})
			if next.fsys.root.GetChild("own") != nil {
				t.Errorf("the successor's own node is still known after its FORGET, which came after those of nodes it never had")
			}
			if b.unnamed[dir] || len(next.fsys.orphans.held()) != 0 {
				t.Errorf("the removed directory is still listed after its FORGET: journal %v, successor %v", b.unnamed, next.fsys.orphans.held())
			}
		})
	}
}
