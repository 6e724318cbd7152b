package fs

import (
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"syscall"
	"unsafe"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// A FUSE connection lives as long as any process holds its /dev/fuse
// descriptor, so a daemon can hand it to a successor (SCM_RIGHTS) and
// exit: the mount, its clients' descriptors and working directories stay.
// go-fuse has no way to serve a connection that is already initialized,
// to hand over its node and handle tables, or to name its descriptor;
// what is here builds those on its public API (upstream, a
// NewServer(fd, InitIn), a Server.Fd and an export and import of the
// identity table would remove ConnectionFd, ServeConnection's synthetic
// INIT and most of HandoverFS).

// InitBytes returns the INIT request the kernel sent srv, which its
// successor gives ServeConnection: the successor negotiates from it
// exactly what srv negotiated.
func InitBytes(srv *fuse.Server) []byte {
	in := *srv.KernelSettings()
	return append([]byte(nil), unsafe.Slice((*byte)(unsafe.Pointer(&in)), unsafe.Sizeof(in))...)
}

// ConnectionFd returns this process's /dev/fuse descriptor: the one
// go-fuse opened for its mount (it keeps its number to itself). A
// daemon serves one mount, so there is exactly one.
func ConnectionFd() (int, error) {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return -1, err
	}
	found := -1
	for _, e := range ents {
		if target, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && target == "/dev/fuse" {
			fd, _ := strconv.Atoi(e.Name())
			if found >= 0 {
				return -1, fmt.Errorf("more than one /dev/fuse descriptor (%d and %d)", found, fd)
			}
			found = fd
		}
	}
	if found < 0 {
		return -1, fmt.Errorf("no /dev/fuse descriptor")
	}
	return found, nil
}

// ServeConnection returns a server of raw on the live FUSE connection fd,
// which an earlier daemon initialized with the INIT request init
// (InitBytes): the kernel never sends INIT again, so go-fuse reads this
// one from a socket standing in at fd's number, and once it has answered
// (to the socket), the connection takes that number (dup3) and the
// server reads requests from the kernel. The server owns fd from the
// call on (closed, once it has the connection); call Serve next.
func ServeConnection(raw fuse.RawFileSystem, fd int, init []byte, opts fuse.MountOptions) (*fuse.Server, error) {
	var in fuse.InitIn
	if len(init) != int(unsafe.Sizeof(in)) {
		return nil, fmt.Errorf("INIT request of %d bytes, want %d", len(init), unsafe.Sizeof(in))
	}
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&in)), len(init)), init)
	in.Length = uint32(len(init))
	in.Opcode = 26 // FUSE_INIT
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(pair[1])
	req := unsafe.Slice((*byte)(unsafe.Pointer(&in)), len(init))
	if _, err := unix.Write(pair[1], req); err != nil {
		unix.Close(pair[0])
		return nil, err
	}
	// go-fuse owns the descriptor it serves, and mounts nothing for a
	// "/dev/fd/N" mountpoint.
	opts.DirectMount = false
	srv, err := fuse.NewServer(raw, "/dev/fd/"+strconv.Itoa(pair[0]), &opts)
	if err != nil {
		unix.Close(pair[0])
		return nil, fmt.Errorf("answer the INIT: %w", err)
	}
	if err := prefaultReads(srv); err != nil {
		return nil, err
	}
	reply := make([]byte, 4096)
	n, err := unix.Read(pair[1], reply)
	if err != nil || n < 16 || *(*int32)(unsafe.Pointer(&reply[4])) != 0 {
		return nil, fmt.Errorf("INIT refused (%d bytes read: %v)", n, err)
	}
	if err := unix.Dup3(fd, pair[0], unix.O_CLOEXEC); err != nil {
		return nil, err
	}
	unix.Close(fd)
	return srv, nil
}

// NotifyResend asks the kernel (6.9 and later) to send again every
// request of this process's connection (ConnectionFd) that was read and
// not answered: those the predecessor was serving when it exited.
// Kernels without it answer ENOSYS or EINVAL, and those requests wait
// for ever.
func NotifyResend() error {
	fd, err := ConnectionFd()
	if err != nil {
		return err
	}
	// A notification is an out header with no unique and the code as
	// its error (FUSE_NOTIFY_RESEND = 7).
	hdr := fuse.OutHeader{Length: uint32(unsafe.Sizeof(fuse.OutHeader{})), Status: -fuse.NOTIFY_RESEND}
	_, err = unix.Write(fd, unsafe.Slice((*byte)(unsafe.Pointer(&hdr)), unsafe.Sizeof(hdr)))
	return err
}

// Node is a node the kernel knows, as a daemon hands it to its successor:
// its node ID (the backing inode under ExternalNodeID), and its parent's
// node ID and name, parents before children.
type Node struct {
	ID     uint64 `json:"id"`
	Parent uint64 `json:"parent"`
	Name   string `json:"name"`
}

// Handle is a file handle the kernel holds: its number, its node, how it
// was opened and by whom, and whether the kernel serves its reads and
// writes itself (passthrough).
type Handle struct {
	Fh          uint64 `json:"fh"`
	Node        uint64 `json:"node"`
	Flags       uint32 `json:"flags"`
	Dir         bool   `json:"dir,omitempty"`
	UID         uint32 `json:"uid"`
	GID         uint32 `json:"gid"`
	Pid         uint32 `json:"pid"`
	Passthrough bool   `json:"passthrough,omitempty"`
}

// Backing is the backing file (a passthrough ID of the connection) the
// kernel's inode of a node reads and writes while one of its handles is
// open: every passthrough open of the node must name the same one.
type Backing struct {
	Node uint64 `json:"node"`
	ID   int32  `json:"id"`
}

// Import is an imported segment as a daemon hands it over: its id (the
// marker's) and the uid its descriptor is charged to (its sender).
type Import struct {
	ID  string `json:"id"`
	UID uint32 `json:"uid"`
}

// Record is one change of a daemon's State, as it journals it: a handle
// opened (Open) or released (Release), a node's backing file set
// (Backing, ID not 0) or given back (Backing, ID 0), a segment open
// in no directory any more (Orphan, its node ID), with Fd, a descriptor
// of its backing file that the journal owns (Takeover.Orphans), an
// import made (Import, with Fd, a descriptor of the sender's file that
// the journal owns: Takeover.Imports) or removed (Unimport), the
// cluster lease the node joined under (Lease), or another such node
// (Unnamed, Forgotten: State.Unnamed).
type Record struct {
	Open     *Handle  `json:"open,omitempty"`
	Release  uint64   `json:"release,omitempty"`
	Backing  *Backing `json:"backing,omitempty"`
	Orphan   uint64   `json:"orphan,omitempty"`
	Import   *Import  `json:"import,omitempty"`
	Unimport *Import  `json:"unimport,omitempty"`
	Lease    int64    `json:"lease,omitempty"`
	Fd       int      `json:"-"`
	// Unnamed is another node the kernel holds that no name reaches
	// any more (a directory removed), Forgotten one the kernel forgot.
	Unnamed   uint64 `json:"unnamed,omitempty"`
	Forgotten uint64 `json:"forgotten,omitempty"`
}

// HasFd reports whether r comes with a descriptor (Fd).
func (r Record) HasFd() bool { return r.Orphan != 0 || r.Import != nil }

// State is what a daemon hands its successor besides the connection:
// besides the nodes of its tree, the handles and backing files, the node
// IDs of other nodes the kernel may hold that no name reaches (Unnamed:
// directories removed while a process works in one).
type State struct {
	Nodes   []Node    `json:"nodes"`
	Handles []Handle  `json:"handles"`
	Backing []Backing `json:"backing"`
	Unnamed []uint64  `json:"unnamed,omitempty"`
}

// backingNodes lists every object of the backing at rootFd as a node,
// parents first: after a crash, the kernel may hold any of them. The walk
// (alloc.Tree) reaches every depth and keeps no path: the list holds a
// name per object, however deep a user made a chain.
func backingNodes(rootFd int, log *slog.Logger) []Node {
	var out []Node
	err := alloc.Tree(rootFd, func(e *alloc.Entry) error {
		parent := e.Parent
		if parent == 0 {
			parent = fuse.FUSE_ROOT_ID
		}
		out = append(out, Node{ID: e.Stat.Ino, Parent: parent, Name: e.Name})
		return nil
	})
	if err != nil {
		log.Warn("takeover: the walk of the backing stopped; what it did not reach fails if the kernel holds it", "err", err)
	}
	return out
}

// KnownNodes lists the nodes of root's tree (every node go-fuse keeps is
// one the kernel holds, or the parent of one), parents first, with
// ExternalNodeID's node IDs. It walks breadth first: no recursion on a
// depth users make.
func KnownNodes(root *fusefs.Inode) []Node {
	var out []Node
	queue := []*fusefs.Inode{root}
	ids := map[*fusefs.Inode]uint64{root: fuse.FUSE_ROOT_ID}
	for len(queue) > 0 {
		n := queue[0]
		queue = queue[1:]
		for name, ch := range n.Children() {
			if _, seen := ids[ch]; seen {
				continue // a further name of a node listed
			}
			ids[ch] = ch.StableAttr().Ino
			out = append(out, Node{ID: ch.StableAttr().Ino, Parent: ids[n], Name: name})
			queue = append(queue, ch)
		}
	}
	return out
}

// HandoverFS keeps, between the kernel and the node bridge, what a
// successor needs and go-fuse does not show: the handles the kernel
// holds and the backing files its inodes use. On a connection an earlier
// daemon served, it also serves what the kernel holds of earlier
// daemons. Node IDs are backing inodes (ExternalNodeID), which Adopt
// registers anew; a handle carries its daemon's generation in its high
// 32 bits, so that the handles of each generation stay apart.
type HandoverFS struct {
	fuse.RawFileSystem
	gen uint64
	srv *fuse.Server

	mu sync.Mutex
	// handles are the handles the kernel holds, by its number.
	handles map[uint64]Handle
	// inherited maps an earlier daemon's handle to the bridge's
	// handle opened again for it.
	inherited map[uint64]uint64
	// backing is the backing file of each node with passthrough
	// handles open: the bridge's (counted by opens), or an earlier
	// daemon's, which every open of the node names until the kernel
	// forgets the node.
	backing map[uint64]*backingRef
	// adopted are the node IDs Adopt registered. The kernel's count of
	// their lookups is the earlier daemons' and ours together, so their
	// FORGET is not passed on: each stays for this daemon's life (one
	// node per object the kernel held at the takeover).
	adopted map[uint64]bool
	// journal, if set, receives every change of handles and backing,
	// under mu, before the kernel learns of it.
	journal func(Record)
	// forgotten, if set, is told of each node the kernel forgets (it
	// sends FORGET as it evicts an inode).
	forgotten func(id uint64)
}

// backingRef is a node's backing file.
type backingRef struct {
	id        int32
	opens     int
	inherited bool
}

// NewHandoverFS wraps raw, a node bridge made with ExternalNodeID, for a
// daemon of generation gen (0: the one that mounted).
func NewHandoverFS(raw fuse.RawFileSystem, gen uint64) *HandoverFS {
	return &HandoverFS{RawFileSystem: raw, gen: gen, handles: map[uint64]Handle{}, inherited: map[uint64]uint64{}, backing: map[uint64]*backingRef{}, adopted: map[uint64]bool{}}
}

// State returns what a successor takes over: the nodes of root's tree,
// the handles and the backing files.
func (f *HandoverFS) State(root *fusefs.Inode) State {
	st := State{Nodes: KnownNodes(root)}
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, h := range f.handles {
		st.Handles = append(st.Handles, h)
	}
	for node, b := range f.backing {
		st.Backing = append(st.Backing, Backing{Node: node, ID: b.id})
	}
	return st
}

// Adopt takes st over, on a connection that ServeConnection serves
// with f (and its predecessor, the daemon st is from, still serves): it
// registers st.Nodes (parents first) with the node bridge as the kernel
// knows them, through the lookups the kernel would make, each checked to
// reach the same inode; a node the kernel holds that no name reaches any
// more (a handle's, unlinked while open) it registers by its node ID:
// the segment again if the predecessor handed its backing file over
// (Takeover.Orphans), else a stale node (staleNode: every request
// ESTALE). It opens every handle again as its
// opener (openAdopted), so that its opener is charged for it and its
// segment counts it (refcount, holders), until the kernel releases it;
// a passthrough one is not registered with the kernel again, whose inode
// keeps the backing file st names. It returns what it could not take
// over (a node whose name no longer reaches its inode, a handle that
// would not open again), whose requests fail.
func (f *HandoverFS) Adopt(st State) (lost State) {
	f.mu.Lock()
	defer f.mu.Unlock()
	known := map[uint64]bool{fuse.FUSE_ROOT_ID: true}
	for _, n := range st.Nodes {
		if !known[n.Parent] {
			lost.Nodes = append(lost.Nodes, n)
			continue
		}
		var out fuse.EntryOut
		h := fuse.InHeader{NodeId: n.Parent}
		s := f.RawFileSystem.Lookup(nil, &h, n.Name, &out)
		if !s.Ok() || out.NodeId != n.ID {
			if s.Ok() && out.NodeId != 0 { // 0: an absent name, as the bridge answers it
				f.RawFileSystem.Forget(out.NodeId, 1)
			}
			lost.Nodes = append(lost.Nodes, n)
			continue
		}
		known[n.ID] = true
		f.adopted[n.ID] = true
	}
	for _, n := range lost.Nodes {
		f.adoptUnnamed(n.ID, known)
	}
	for _, id := range st.Unnamed {
		f.adoptUnnamed(id, known)
	}
	for _, b := range st.Backing {
		f.backing[b.Node] = &backingRef{id: b.ID, inherited: true}
	}
	for _, h := range st.Handles {
		f.handles[h.Fh] = h
		f.adoptUnnamed(h.Node, known)
		in := fuse.OpenIn{InHeader: fuse.InHeader{NodeId: h.Node, Caller: fuse.Caller{Owner: fuse.Owner{Uid: h.UID, Gid: h.GID}, Pid: h.Pid}},
			Flags: h.Flags&^(syscall.O_CREAT|syscall.O_EXCL|syscall.O_TRUNC) | openAdopted}
		var out fuse.OpenOut
		var s fuse.Status
		if h.Dir {
			s = f.RawFileSystem.OpenDir(nil, &in, &out)
		} else {
			s = f.RawFileSystem.Open(nil, &in, &out)
		}
		if !s.Ok() {
			lost.Handles = append(lost.Handles, h)
			continue
		}
		f.inherited[h.Fh] = out.Fh
	}
	return lost
}

// adoptUnnamed registers id, a node the kernel holds, by its node ID
// alone if the bridge does not know it (known), so that its requests
// never reach an unknown node ID (a panic in go-fuse, and a stack in the
// log, per request). The bridge resolves a LOOKUP of "." by node ID
// through the root (rootNode.LookupNode); mu is held.
func (f *HandoverFS) adoptUnnamed(id uint64, known map[uint64]bool) {
	if known[id] {
		return
	}
	var out fuse.EntryOut
	if f.RawFileSystem.Lookup(nil, &fuse.InHeader{NodeId: id}, ".", &out).Ok() {
		known[id] = true
		f.adopted[id] = true
	}
}

// record journals r; mu is held.
func (f *HandoverFS) record(r Record) {
	if f.journal != nil {
		f.journal(r)
	}
}

// opened records a handle the bridge gave out (out, for node, opened by
// in with flags) and puts this daemon's generation into it. A
// passthrough open of a node whose inode uses an earlier daemon's
// backing file names that one.
func (f *HandoverFS) opened(in *fuse.InHeader, node uint64, flags uint32, dir bool, out *fuse.OpenOut) {
	out.Fh |= f.gen << 32
	h := Handle{Fh: out.Fh, Node: node, Flags: flags, Dir: dir, UID: in.Uid, GID: in.Gid, Pid: in.Pid, Passthrough: out.OpenFlags&fuse.FOPEN_PASSTHROUGH != 0}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.handles[h.Fh] = h
	f.record(Record{Open: &h})
	if !h.Passthrough {
		return
	}
	b := f.backing[node]
	switch {
	case b == nil:
		f.backing[node] = &backingRef{id: out.BackingID, opens: 1}
		f.record(Record{Backing: &Backing{Node: node, ID: out.BackingID}})
	case b.inherited:
		out.BackingID = b.id
	default:
		b.opens++
	}
}

// released forgets the handle k and returns the bridge's handle for it,
// false if the bridge has none (an earlier daemon's, not opened again).
func (f *HandoverFS) released(k uint64) (uint64, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	h, ok := f.handles[k]
	if ok {
		delete(f.handles, k)
		f.record(Record{Release: k})
	}
	if b := f.backing[h.Node]; ok && h.Passthrough && b != nil && !b.inherited {
		if b.opens--; b.opens == 0 {
			delete(f.backing, h.Node)
			f.record(Record{Backing: &Backing{Node: h.Node}})
		}
	}
	if fh, ok := f.inherited[k]; ok {
		delete(f.inherited, k)
		return fh, true
	}
	return k & 0xffffffff, k>>32 == f.gen
}

// fh maps a handle the kernel sent to the node bridge's: false if the
// bridge has none for it.
func (f *HandoverFS) fh(k uint64) (uint64, bool) {
	if k>>32 == f.gen {
		return k & 0xffffffff, true
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	fh, ok := f.inherited[k]
	return fh, ok
}

// Init keeps the server, which unregisters earlier daemons' backing
// files.
func (f *HandoverFS) Init(s *fuse.Server) {
	f.srv = s
	f.RawFileSystem.Init(s)
}

func (f *HandoverFS) Forget(nodeid, nlookup uint64) {
	f.mu.Lock()
	adopted := f.adopted[nodeid]
	var id int32
	if b := f.backing[nodeid]; b != nil && b.inherited {
		// The kernel forgets an inode with no handle open: nothing
		// uses its backing file any more.
		id = b.id
		delete(f.backing, nodeid)
		f.record(Record{Backing: &Backing{Node: nodeid}})
	}
	f.mu.Unlock()
	if id != 0 {
		f.srv.UnregisterBackingFd(id)
	}
	if !adopted {
		f.forgetBridge(nodeid, nlookup)
	}
	if f.forgotten != nil {
		f.forgotten(nodeid) // the kernel evicted it: no successor needs it
	}
}

// forgetBridge passes a FORGET on to the node bridge. That of a node the
// bridge never had is nothing to forget: a successor meets it for a node
// an earlier daemon gave the kernel whose last name went before the
// handover (a file unlinked whose FORGET that daemon had not read when
// it died or handed over), which no name, handle or journal record lets
// it register. go-fuse panics on it before it changes anything; the
// panic ends here, so that the rest of a BATCH_FORGET is served.
func (f *HandoverFS) forgetBridge(nodeid, nlookup uint64) {
	defer func() {
		if v := recover(); v != nil {
			if id, ok := unknownNode(v); !ok || id != nodeid {
				panic(v)
			}
		}
	}()
	f.RawFileSystem.Forget(nodeid, nlookup)
}

func (f *HandoverFS) Open(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	st := f.RawFileSystem.Open(cancel, in, out)
	if st.Ok() {
		f.opened(&in.InHeader, in.NodeId, in.Flags, false, out)
	}
	return st
}

func (f *HandoverFS) OpenDir(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	st := f.RawFileSystem.OpenDir(cancel, in, out)
	if st.Ok() {
		f.opened(&in.InHeader, in.NodeId, in.Flags, true, out)
	}
	return st
}

func (f *HandoverFS) Create(cancel <-chan struct{}, in *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	st := f.RawFileSystem.Create(cancel, in, name, out)
	if st.Ok() {
		f.opened(&in.InHeader, out.NodeId, in.Flags, false, &out.OpenOut)
	}
	return st
}

func (f *HandoverFS) Tmpfile(cancel <-chan struct{}, in *fuse.CreateIn, out *fuse.CreateOut) fuse.Status {
	st := f.RawFileSystem.Tmpfile(cancel, in, out)
	if st.Ok() {
		f.opened(&in.InHeader, out.NodeId, in.Flags, false, &out.OpenOut)
	}
	return st
}

// GetAttr of an earlier daemon's handle is a GetAttr of its node.
func (f *HandoverFS) GetAttr(cancel <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	if in.Flags()&fuse.FUSE_GETATTR_FH != 0 {
		if fh, ok := f.fh(in.Fh_); ok {
			in.Fh_ = fh
		} else {
			in.Flags_ &^= fuse.FUSE_GETATTR_FH
		}
	}
	return f.RawFileSystem.GetAttr(cancel, in, out)
}

// SetAttr through an earlier daemon's handle (ftruncate, fchmod) is one
// on its node: the kernel checked the handle's access.
func (f *HandoverFS) SetAttr(cancel <-chan struct{}, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	if in.Valid&fuse.FATTR_FH != 0 {
		if fh, ok := f.fh(in.Fh); ok {
			in.Fh = fh
		} else {
			in.Valid &^= fuse.FATTR_FH
		}
	}
	return f.RawFileSystem.SetAttr(cancel, in, out)
}

func (f *HandoverFS) Statx(cancel <-chan struct{}, in *fuse.StatxIn, out *fuse.StatxOut) fuse.Status {
	if in.GetattrFlags&fuse.FUSE_GETATTR_FH != 0 {
		if fh, ok := f.fh(in.Fh); ok {
			in.Fh = fh
		} else {
			in.GetattrFlags &^= fuse.FUSE_GETATTR_FH
		}
	}
	return f.RawFileSystem.Statx(cancel, in, out)
}

// Release of an earlier daemon's handle that was not opened again
// releases nothing here: what it held went with that daemon.
func (f *HandoverFS) Release(cancel <-chan struct{}, in *fuse.ReleaseIn) {
	if fh, ok := f.released(in.Fh); ok {
		in.Fh = fh
		f.RawFileSystem.Release(cancel, in)
	}
}

func (f *HandoverFS) ReleaseDir(in *fuse.ReleaseIn) {
	if fh, ok := f.released(in.Fh); ok {
		in.Fh = fh
		f.RawFileSystem.ReleaseDir(in)
	}
}

// Flush and Fsync of an earlier daemon's handle have nothing to do: the
// bytes are in the backing.
func (f *HandoverFS) Flush(cancel <-chan struct{}, in *fuse.FlushIn) fuse.Status {
	if fh, ok := f.fh(in.Fh); ok {
		in.Fh = fh
		return f.RawFileSystem.Flush(cancel, in)
	}
	return fuse.OK
}

func (f *HandoverFS) Fsync(cancel <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	if fh, ok := f.fh(in.Fh); ok {
		in.Fh = fh
		return f.RawFileSystem.Fsync(cancel, in)
	}
	return fuse.OK
}

func (f *HandoverFS) FsyncDir(cancel <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	if fh, ok := f.fh(in.Fh); ok {
		in.Fh = fh
		return f.RawFileSystem.FsyncDir(cancel, in)
	}
	return fuse.OK
}

func (f *HandoverFS) Read(cancel <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	fh, ok := f.fh(in.Fh)
	if !ok {
		return nil, fuse.Status(syscall.EBADF)
	}
	in.Fh = fh
	return f.RawFileSystem.Read(cancel, in, buf)
}

func (f *HandoverFS) Write(cancel <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	fh, ok := f.fh(in.Fh)
	if !ok {
		return 0, fuse.Status(syscall.EBADF)
	}
	in.Fh = fh
	return f.RawFileSystem.Write(cancel, in, data)
}

func (f *HandoverFS) Writev(cancel <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	fh, ok := f.fh(in.Fh)
	if !ok {
		return 0, fuse.Status(syscall.EBADF)
	}
	in.Fh = fh
	return f.RawFileSystem.Writev(cancel, in, data)
}

func (f *HandoverFS) Lseek(cancel <-chan struct{}, in *fuse.LseekIn, out *fuse.LseekOut) fuse.Status {
	fh, ok := f.fh(in.Fh)
	if !ok {
		return fuse.Status(syscall.EBADF)
	}
	in.Fh = fh
	return f.RawFileSystem.Lseek(cancel, in, out)
}

func (f *HandoverFS) Fallocate(cancel <-chan struct{}, in *fuse.FallocateIn) fuse.Status {
	fh, ok := f.fh(in.Fh)
	if !ok {
		return fuse.Status(syscall.EBADF)
	}
	in.Fh = fh
	return f.RawFileSystem.Fallocate(cancel, in)
}

func (f *HandoverFS) CopyFileRange(cancel <-chan struct{}, in *fuse.CopyFileRangeIn) (uint32, fuse.Status) {
	fhIn, okIn := f.fh(in.FhIn)
	fhOut, okOut := f.fh(in.FhOut)
	if !okIn || !okOut {
		return 0, fuse.Status(syscall.EBADF)
	}
	in.FhIn, in.FhOut = fhIn, fhOut
	return f.RawFileSystem.CopyFileRange(cancel, in)
}

func (f *HandoverFS) Ioctl(cancel <-chan struct{}, in *fuse.IoctlIn, inbuf []byte, out *fuse.IoctlOut, outbuf []byte) fuse.Status {
	fh, ok := f.fh(in.Fh)
	if !ok {
		return fuse.Status(syscall.ENOTTY)
	}
	in.Fh = fh
	return f.RawFileSystem.Ioctl(cancel, in, inbuf, out, outbuf)
}

func (f *HandoverFS) ReadDir(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	fh, ok := f.fh(in.Fh)
	if !ok {
		return fuse.Status(syscall.EBADF)
	}
	in.Fh = fh
	return f.RawFileSystem.ReadDir(cancel, in, out)
}

func (f *HandoverFS) ReadDirPlus(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	fh, ok := f.fh(in.Fh)
	if !ok {
		return fuse.Status(syscall.EBADF)
	}
	in.Fh = fh
	return f.RawFileSystem.ReadDirPlus(cancel, in, out)
}
