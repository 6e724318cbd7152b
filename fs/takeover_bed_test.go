package fs

import (
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// handoverBed is one backing served in turn, in-process, by the daemons
// of a mount that is handed over: each one's node bridge under its
// HandoverFS, as Mount makes them, and what a keeper keeps of their
// journal (lifecycle.keeper's apply, which fs cannot import).
type handoverBed struct {
	t       *testing.T
	store   *alloc.Store
	log     *slog.Logger
	top     string
	mu      sync.Mutex
	unnamed map[uint64]bool
	handles map[uint64]Handle
	orphans map[uint64]int
	imports map[Import]int
}

// bedDaemon is one daemon of a handoverBed: requests go through its
// gate, as the kernel's do.
type bedDaemon struct {
	fsys *filesystem
	raw  *HandoverFS
	gate *gateFS
}

// newHandoverBed makes an empty backing.
func newHandoverBed(t *testing.T) *handoverBed {
	t.Helper()
	store, top, log := testStore(t)
	b := &handoverBed{t: t, store: store, log: log, top: top, unnamed: map[uint64]bool{}, handles: map[uint64]Handle{},
		orphans: map[uint64]int{}, imports: map[Import]int{}}
	t.Cleanup(func() {
		closeFds(b.orphans)
		closeFds(b.imports)
	})
	return b
}

// closeFds closes the descriptors of fds.
func closeFds[K comparable](fds map[K]int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// record keeps r as a keeper does.
func (b *handoverBed) record(r Record) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case r.Orphan != 0:
		if old, ok := b.orphans[r.Orphan]; ok {
			unix.Close(old)
		}
		b.orphans[r.Orphan] = r.Fd
	case r.Import != nil:
		b.imports[*r.Import] = r.Fd
	case r.Unimport != nil:
		if fd, ok := b.imports[*r.Unimport]; ok {
			unix.Close(fd)
			delete(b.imports, *r.Unimport)
		}
	case r.Open != nil:
		b.handles[r.Open.Fh] = *r.Open
	case r.Release != 0:
		node := b.handles[r.Release].Node
		delete(b.handles, r.Release)
		if fd, ok := b.orphans[node]; ok && !b.holds(node) {
			unix.Close(fd)
			delete(b.orphans, node)
		}
	case r.Unnamed != 0:
		b.unnamed[r.Unnamed] = true
	case r.Forgotten != 0:
		delete(b.unnamed, r.Forgotten)
	}
}

// holds reports whether a handle of node is open; mu is held.
func (b *handoverBed) holds(node uint64) bool {
	for _, h := range b.handles {
		if h.Node == node {
			return true
		}
	}
	return false
}

// usersDaemon is the bed's first daemon, serving other users (as
// --allow-other does) on a backing whose root is 1777, for the tests of
// users' handles and imports.
func (b *handoverBed) usersDaemon() *bedDaemon {
	b.t.Helper()
	if err := os.Chmod(b.store.Dir, 0o1777); err != nil {
		b.t.Fatal(err)
	}
	d := b.daemon(0, nil)
	d.fsys.allowOther = true
	return d
}

// daemon starts the filesystem of generation gen on the backing, its
// journal kept by b; rec is what recovery found (nil: nothing).
func (b *handoverBed) daemon(gen uint64, rec *Recovered) *bedDaemon {
	b.t.Helper()
	fsys, err := newFilesystem(Options{Store: b.store, Log: b.log, Mountpoint: filepath.Join(b.top, "mnt"), Recovered: rec})
	if err != nil {
		b.t.Fatal(err)
	}
	b.t.Cleanup(fsys.close)
	raw := fsys.handoverFS(&fusefs.Options{ExternalNodeID: true}, b.record)
	raw.gen = gen
	return &bedDaemon{fsys: fsys, raw: raw, gate: &gateFS{RawFileSystem: raw}}
}

// crash starts the successor of generation gen of a daemon that died,
// which takes over what b kept of the journal; it returns it with what it
// could not take over.
func (b *handoverBed) crash(gen uint64) (*bedDaemon, State) {
	b.mu.Lock()
	t := &Takeover{Gen: gen, Crashed: true, State: State{Unnamed: keys(b.unnamed), Handles: slicesOf(b.handles)},
		Orphans: dupFdMap(b.t, b.orphans), Imports: dupFdMap(b.t, b.imports)}
	b.mu.Unlock()
	return b.takeOver(t, b.recover())
}

// restart starts the successor of generation gen of prev, which hands
// its mount over (handover).
func (b *handoverBed) restart(prev *bedDaemon, gen uint64) (*bedDaemon, State) {
	return b.takeOver(b.handover(prev, gen), b.recover())
}

// handover is what prev hands its successor of generation gen, as
// Server.Handover has it.
func (b *handoverBed) handover(prev *bedDaemon, gen uint64) *Takeover {
	st := prev.raw.State(prev.fsys.root.EmbeddedInode())
	st.Unnamed = prev.fsys.orphans.held()
	return &Takeover{Gen: gen, State: st, Orphans: prev.fsys.orphans.files(), Imports: prev.fsys.imports.files()}
}

// recover recovers the backing as a successor does before it takes the
// mount over.
func (b *handoverBed) recover() *Recovered {
	b.t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(b.store.RootFd, &st); err != nil {
		b.t.Fatal(err)
	}
	_, _, rec, err := Recover(b.store, st.Dev)
	if err != nil {
		b.t.Fatal(err)
	}
	return rec
}

// takeOver starts a daemon that takes t over as takeOver does, with what
// its recovery found (rec), and removes the UNLINK segments no handle
// holds, as Mount does once it serves.
func (b *handoverBed) takeOver(t *Takeover, rec *Recovered) (*bedDaemon, State) {
	b.t.Helper()
	d := b.daemon(t.Gen, rec)
	dropped := d.fsys.receive(d.raw, t, rec)
	lost, unheld := d.fsys.adopt(d.raw, t.State, rec)
	d.fsys.imports.forget(dropped)
	if len(unheld) > 0 {
		d.fsys.removeUnlinkedNames(unheld)
	}
	return d, lost
}

// keys lists the keys of m.
func keys[K comparable](m map[K]bool) []K {
	out := make([]K, 0, len(m))
	for k := range maps.Keys(m) {
		out = append(out, k)
	}
	return out
}

// slicesOf lists the values of m.
func slicesOf[K comparable, V any](m map[K]V) []V {
	out := make([]V, 0, len(m))
	for v := range maps.Values(m) {
		out = append(out, v)
	}
	return out
}

// dupFdMap returns duplicates of the descriptors of fds, as a keeper
// gives a successor its own.
func dupFdMap[K comparable](t *testing.T, fds map[K]int) map[K]int {
	out := map[K]int{}
	for k, fd := range fds {
		dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		out[k] = dup
	}
	return out
}

// create makes name in node parent through d's HandoverFS as uid, and
// returns its node ID and its handle (released if release).
func (d *bedDaemon) create(t *testing.T, parent uint64, name string, uid uint32, release bool) (uint64, uint64) {
	t.Helper()
	in := fuse.CreateIn{InHeader: bedHeader(parent, uid), Flags: syscall.O_RDWR, Mode: 0o644}
	var out fuse.CreateOut
	if st := d.gate.Create(nil, &in, name, &out); !st.Ok() {
		t.Fatalf("create %s: %v", name, st)
	}
	if release {
		d.gate.Release(nil, &fuse.ReleaseIn{InHeader: bedHeader(out.NodeId, uid), Fh: out.Fh})
	}
	return out.NodeId, out.Fh
}

// lookup looks name up in node parent through d's HandoverFS.
func (d *bedDaemon) lookup(t *testing.T, parent uint64, name string) uint64 {
	t.Helper()
	var out fuse.EntryOut
	if st := d.gate.Lookup(nil, ptr(bedHeader(parent, 0)), name, &out); !st.Ok() {
		t.Fatalf("lookup %s: %v", name, st)
	}
	return out.NodeId
}

// getattr is a GETATTR of node through d's HandoverFS.
func (d *bedDaemon) getattr(node uint64) fuse.Status {
	return d.gate.GetAttr(nil, &fuse.GetAttrIn{InHeader: bedHeader(node, 0)}, &fuse.AttrOut{})
}

// bedHeader is a request of uid's about node.
func bedHeader(node uint64, uid uint32) fuse.InHeader {
	return fuse.InHeader{NodeId: node, Caller: fuse.Caller{Owner: fuse.Owner{Uid: uid, Gid: uid}, Pid: uint32(os.Getpid())}}
}

// noPanic runs fn and fails t with what it panicked with, if it did.
func noPanic(t *testing.T, what string, fn func()) {
	t.Helper()
	defer func() {
		if r := recover(); r != nil {
			t.Fatalf("%s panicked: %v", what, r)
		}
	}()
	fn()
}
