package fs

import (
	"context"
	"maps"
	"slices"
	"sync"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// orphans are the segments whose last name went while they were open, and
// the O_TMPFILE ones not linked yet: the kernel holds them, and no name a
// successor could look up reaches them. A successor gets a descriptor of
// each one's backing file, from its predecessor (Server.Handover) or,
// after a crash, from the keeper's journal (Record.Orphan, sent when the
// last name goes), and registers it under its node ID
// (rootNode.LookupNode), so that its handles keep working: one
// descriptor per segment, which holds at least one handle charged to its
// opener. The other nodes the kernel holds that no name reaches (a
// directory removed while a process works in it) are handed over by node
// ID, and become stale nodes.
type orphans struct {
	mu sync.Mutex
	// nodes are the orphans with handles open, by node ID.
	nodes map[uint64]*segmentNode
	// handed are, in a successor until Adopt has run, the descriptors its
	// predecessor handed over, by node ID.
	handed map[uint64]int
	// journal, if set, receives each new orphan with a descriptor of its
	// backing file (Options.Journal).
	journal func(Record)
	// unnamed are the node IDs of the other nodes the kernel holds that
	// no name reaches (directories removed, stale nodes), which a
	// successor registers as stale nodes (State.Unnamed), until the
	// kernel forgets them; journaled too.
	unnamed map[uint64]bool
}

// addUnnamed records node id, which no name reaches any more, and
// journals it.
func (o *orphans) addUnnamed(id uint64) {
	o.mu.Lock()
	if o.unnamed == nil {
		o.unnamed = map[uint64]bool{}
	}
	o.unnamed[id] = true
	o.mu.Unlock()
	if o.journal != nil {
		o.journal(Record{Unnamed: id})
	}
}

// forget drops node id, which the kernel forgot, if it is unnamed, and
// journals that.
func (o *orphans) forget(id uint64) {
	o.mu.Lock()
	unnamed := o.unnamed[id]
	delete(o.unnamed, id)
	o.mu.Unlock()
	if unnamed && o.journal != nil {
		o.journal(Record{Forgotten: id})
	}
}

// held returns the node IDs of the unnamed nodes the kernel holds.
func (o *orphans) held() []uint64 {
	o.mu.Lock()
	defer o.mu.Unlock()
	ids := make([]uint64, 0, len(o.unnamed))
	for id := range o.unnamed {
		ids = append(ids, id)
	}
	return ids
}

// add records n, whose last name just went (or an O_TMPFILE segment,
// made in no directory), if handles hold it, and journals it with a
// descriptor of its backing file.
func (o *orphans) add(n *segmentNode) {
	fd, err := n.backingFd()
	if err != nil {
		return // no handle, or a kind with no file of its own (imported)
	}
	id := n.StableAttr().Ino
	o.mu.Lock()
	if o.nodes == nil {
		o.nodes = map[uint64]*segmentNode{}
	}
	o.nodes[id] = n
	o.mu.Unlock()
	if o.journal != nil {
		o.journal(Record{Orphan: id, Fd: fd})
		return
	}
	unix.Close(fd)
}

// named forgets n, an O_TMPFILE segment that was just given its first
// name.
func (o *orphans) named(n *segmentNode) {
	n.orphan.Store(false)
	o.drop(n)
}

// drop forgets n once no handle holds it.
func (o *orphans) drop(n *segmentNode) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.nodes[n.StableAttr().Ino] == n {
		delete(o.nodes, n.StableAttr().Ino)
	}
}

// files returns a descriptor of the backing file of each orphan with
// handles open, by node ID, for a successor: the caller owns them.
func (o *orphans) files() map[uint64]int {
	o.mu.Lock()
	nodes := slices.Collect(maps.Values(o.nodes))
	o.mu.Unlock()
	fds := map[uint64]int{}
	for _, n := range nodes {
		if fd, err := n.backingFd(); err == nil {
			fds[n.StableAttr().Ino] = fd
		}
	}
	return fds
}

// take returns the descriptor handed over for node id, which the caller
// then owns; false if none was.
func (o *orphans) take(id uint64) (int, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	fd, ok := o.handed[id]
	delete(o.handed, id)
	return fd, ok
}

// settleOrphans ends Adopt: the descriptors handed over for nodes the
// kernel holds no handle of are closed, and so is each adopted orphan's own,
// since its handles, opened again, hold its file; an orphan none of
// whose handles opened again is let go.
func (fsys *filesystem) settleOrphans() {
	o := &fsys.orphans
	o.mu.Lock()
	for _, fd := range o.handed {
		unix.Close(fd)
	}
	o.handed = nil
	if fsys.gpu != nil {
		fsys.gpu.settleOrphans()
	}
	nodes := make([]*segmentNode, 0, len(o.nodes))
	for _, n := range o.nodes {
		nodes = append(nodes, n)
	}
	o.mu.Unlock()
	for _, n := range nodes {
		n.mu.Lock()
		held := n.held
		n.held = nil
		n.mu.Unlock()
		if held != nil {
			held.Close()
		}
		fsys.orphaned(n)
	}
}

// backingFd returns a descriptor of the backing file of n, a segment in
// no directory, through one of its handles.
func (n *segmentNode) backingFd() (int, error) {
	n.mu.Lock()
	var h segmentHandle
	if len(n.handles) > 0 {
		h = n.handles[0].open
	}
	n.mu.Unlock()
	if h == nil {
		return -1, syscall.ENOENT
	}
	r, err := h.attrRef()
	if err != nil {
		return -1, err
	}
	return r.Fd(), nil // r's descriptor is the caller's
}

// adoptOrphan makes the node of the orphan id whose backing file a
// predecessor handed over (fd, which it owns from then on): a segment of
// the kind its file says, charged as the recount at mount charges the
// objects of the backing, whose handles Adopt opens again through fd.
func (fsys *filesystem) adoptOrphan(ctx context.Context, id uint64, fd int) (*fusefs.Inode, error) {
	defer unix.Close(fd)
	r, err := alloc.OpenRef(fd, "", id)
	if err != nil {
		return nil, err
	}
	s, err := fsys.orphanKind(r)
	if err != nil {
		r.Close()
		return nil, err
	}
	fsys.inodes.count(r.Stat(), storedAttrUnits(alloc.FdPath(r.Fd())))
	n := fsys.newSegment(s)
	n.held = r
	n.orphan.Store(true)
	fsys.orphans.mu.Lock()
	if fsys.orphans.nodes == nil {
		fsys.orphans.nodes = map[uint64]*segmentNode{}
	}
	fsys.orphans.nodes[id] = n
	fsys.orphans.mu.Unlock()
	return fsys.root.NewInode(ctx, n, fusefs.StableAttr{Mode: syscall.S_IFREG, Ino: id}), nil
}

// orphanKind is the storage of the orphan whose backing file is r: the
// removed device segment claimDevices took over for it, or its kind.
func (fsys *filesystem) orphanKind(r *alloc.Ref) (storage, error) {
	if fsys.gpu != nil {
		if seg := fsys.gpu.orphan(r.Stat().Ino); seg != nil {
			return device{seg}, nil
		}
	}
	return fsys.classify(r)
}

// heldNodes returns the nodes that the handles a successor took over
// (handles, less those that did not open again, lost) hold.
func heldNodes(handles, lost []Handle) map[uint64]bool {
	failed := map[uint64]bool{}
	for _, h := range lost {
		failed[h.Fh] = true
	}
	held := map[uint64]bool{}
	for _, h := range handles {
		if !failed[h.Fh] {
			held[h.Node] = true
		}
	}
	return held
}

// settleUnlinked sorts the UNLINK segments recovery kept for a successor
// by the handles it took over (held): those no process maps and no
// handle holds it returns, to remove now, as recovery would have; those a
// handle holds go at their last close (reclaimLater), which watches
// their mappings then, so they are taken off rec.kept, whose watches
// would remove them at their last unmapping.
func settleUnlinked(rec *Recovered, held map[uint64]bool) (unheld map[uint64]bool) {
	unheld = map[uint64]bool{}
	for _, ino := range rec.unlinked {
		if !held[ino] {
			unheld[ino] = true
		}
	}
	rec.kept = slices.DeleteFunc(rec.kept, func(k keptFile) bool { return held[k.ino] })
	return unheld
}
