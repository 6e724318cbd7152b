package fs

import (
	"fmt"
	"os"
	"strconv"
	"sync"
	"syscall"
	"unsafe"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// A FUSE connection lives as long as any process holds its /dev/fuse
// descriptor, so a daemon can hand it to a successor (SCM_RIGHTS) and
// exit: the mount, its clients' descriptors and working directories stay.
// go-fuse has no way to serve a connection that is already initialized,
// to hand over its node and handle tables, or to name its descriptor;
// what is here builds those on its public API (upstream, a
// NewServer(fd, InitIn) and an export/import of the identity table would
// remove connectionFd, ServeConnection's synthetic INIT and most of
// successorFS).

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
// server reads requests from the kernel. fd stays the caller's; call
// Serve on the server next.
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
	reply := make([]byte, 4096)
	n, err := unix.Read(pair[1], reply)
	if err != nil || n < 16 || *(*int32)(unsafe.Pointer(&reply[4])) != 0 {
		return nil, fmt.Errorf("INIT refused (%d bytes read: %v)", n, err)
	}
	if err := unix.Dup3(fd, pair[0], unix.O_CLOEXEC); err != nil {
		return nil, err
	}
	return srv, nil
}

// NotifyResend asks the kernel (6.9 and later) to send again every
// request of the connection fd that was read and not answered: those the
// predecessor was serving when it exited. Kernels without it answer
// ENOSYS or EINVAL, and those requests wait for ever.
func NotifyResend(fd int) error {
	// A notification is an out header with no unique and the code as
	// its error (FUSE_NOTIFY_RESEND = 7).
	hdr := fuse.OutHeader{Length: uint32(unsafe.Sizeof(fuse.OutHeader{})), Status: -fuse.NOTIFY_RESEND}
	_, err := unix.Write(fd, unsafe.Slice((*byte)(unsafe.Pointer(&hdr)), unsafe.Sizeof(hdr)))
	return err
}

// TakeOver serves raw, a node bridge made with ExternalNodeID, on the
// live connection fd that the daemon of generation gen-1 served and
// initialized with init: it registers nodes (the predecessor's
// KnownNodes) and returns those it could not, whose requests fail. Call
// NotifyResend once the predecessor is gone, then Serve.
func TakeOver(raw fuse.RawFileSystem, fd int, init []byte, gen uint64, nodes []Node, opts fuse.MountOptions) (*fuse.Server, []Node, error) {
	s := &successorFS{RawFileSystem: raw, gen: gen, adopted: map[uint64]bool{}}
	srv, err := ServeConnection(s, fd, init, opts)
	if err != nil {
		return nil, nil, err
	}
	return srv, s.adopt(nodes), nil
}

// Node is a node the kernel knows, as a daemon hands it to its successor:
// its node ID (the backing inode under ExternalNodeID), and its parent's
// node ID and name, parents before children.
type Node struct {
	ID     uint64 `json:"id"`
	Parent uint64 `json:"parent"`
	Name   string `json:"name"`
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

// successorFS serves a connection an earlier daemon served (or this one,
// generation 0, for its successor). The kernel holds node IDs and file
// handles of earlier daemons: the node IDs are backing inodes
// (ExternalNodeID) that adopt registers anew; a handle gets this
// generation in its high 32 bits, so that the handles of each generation
// stay apart, and one of an earlier daemon that is not adopted is no
// handle here.
type successorFS struct {
	fuse.RawFileSystem
	gen uint64

	mu sync.Mutex
	// adopted are the node IDs adopt registered. The kernel's count of
	// their lookups is the earlier daemons' and ours together, so their
	// FORGET is not passed on: each stays for this daemon's life (one
	// node per object the kernel held at the takeover).
	adopted map[uint64]bool
}

// adopt registers nodes (parents first) with the node bridge as the
// kernel knows them, through the lookups the kernel would make, checked
// to reach the same inode; it returns those it could not.
func (f *successorFS) adopt(nodes []Node) (lost []Node) {
	f.mu.Lock()
	defer f.mu.Unlock()
	known := map[uint64]bool{fuse.FUSE_ROOT_ID: true}
	for _, n := range nodes {
		if !known[n.Parent] {
			lost = append(lost, n)
			continue
		}
		var out fuse.EntryOut
		h := fuse.InHeader{NodeId: n.Parent, Caller: fuse.Caller{Owner: fuse.Owner{Uid: 0, Gid: 0}}}
		st := f.RawFileSystem.Lookup(nil, &h, n.Name, &out)
		if !st.Ok() || out.NodeId != n.ID {
			if st.Ok() {
				f.RawFileSystem.Forget(out.NodeId, 1)
			}
			lost = append(lost, n)
			continue
		}
		known[n.ID] = true
		f.adopted[n.ID] = true
	}
	return lost
}

// fh maps a handle the kernel sent to the node bridge's: false if it is
// none of this daemon's.
func (f *successorFS) fh(k uint64) (uint64, bool) {
	if k>>32 != f.gen {
		return 0, false
	}
	return k & 0xffffffff, true
}

// handle puts this daemon's generation into a handle it gives the kernel.
func (f *successorFS) handle(out *fuse.OpenOut) { out.Fh |= f.gen << 32 }

func (f *successorFS) Forget(nodeid, nlookup uint64) {
	f.mu.Lock()
	adopted := f.adopted[nodeid]
	f.mu.Unlock()
	if !adopted {
		f.RawFileSystem.Forget(nodeid, nlookup)
	}
}

func (f *successorFS) Open(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	st := f.RawFileSystem.Open(cancel, in, out)
	f.handle(out)
	return st
}

func (f *successorFS) OpenDir(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	st := f.RawFileSystem.OpenDir(cancel, in, out)
	f.handle(out)
	return st
}

func (f *successorFS) Create(cancel <-chan struct{}, in *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	st := f.RawFileSystem.Create(cancel, in, name, out)
	f.handle(&out.OpenOut)
	return st
}

func (f *successorFS) Tmpfile(cancel <-chan struct{}, in *fuse.CreateIn, out *fuse.CreateOut) fuse.Status {
	st := f.RawFileSystem.Tmpfile(cancel, in, out)
	f.handle(&out.OpenOut)
	return st
}

// GetAttr of an earlier daemon's handle is a GetAttr of its node.
func (f *successorFS) GetAttr(cancel <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
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
func (f *successorFS) SetAttr(cancel <-chan struct{}, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	if in.Valid&fuse.FATTR_FH != 0 {
		if fh, ok := f.fh(in.Fh); ok {
			in.Fh = fh
		} else {
			in.Valid &^= fuse.FATTR_FH
		}
	}
	return f.RawFileSystem.SetAttr(cancel, in, out)
}

func (f *successorFS) Statx(cancel <-chan struct{}, in *fuse.StatxIn, out *fuse.StatxOut) fuse.Status {
	if in.GetattrFlags&fuse.FUSE_GETATTR_FH != 0 {
		if fh, ok := f.fh(in.Fh); ok {
			in.Fh = fh
		} else {
			in.GetattrFlags &^= fuse.FUSE_GETATTR_FH
		}
	}
	return f.RawFileSystem.Statx(cancel, in, out)
}

// Release of an earlier daemon's handle releases nothing here: what it
// held went with that daemon.
func (f *successorFS) Release(cancel <-chan struct{}, in *fuse.ReleaseIn) {
	if fh, ok := f.fh(in.Fh); ok {
		in.Fh = fh
		f.RawFileSystem.Release(cancel, in)
	}
}

func (f *successorFS) ReleaseDir(in *fuse.ReleaseIn) {
	if fh, ok := f.fh(in.Fh); ok {
		in.Fh = fh
		f.RawFileSystem.ReleaseDir(in)
	}
}

// Flush and Fsync of an earlier daemon's handle have nothing to do: the
// bytes are in the backing.
func (f *successorFS) Flush(cancel <-chan struct{}, in *fuse.FlushIn) fuse.Status {
	if fh, ok := f.fh(in.Fh); ok {
		in.Fh = fh
		return f.RawFileSystem.Flush(cancel, in)
	}
	return fuse.OK
}

func (f *successorFS) Fsync(cancel <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	if fh, ok := f.fh(in.Fh); ok {
		in.Fh = fh
		return f.RawFileSystem.Fsync(cancel, in)
	}
	return fuse.OK
}

func (f *successorFS) FsyncDir(cancel <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	if fh, ok := f.fh(in.Fh); ok {
		in.Fh = fh
		return f.RawFileSystem.FsyncDir(cancel, in)
	}
	return fuse.OK
}

func (f *successorFS) Read(cancel <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	fh, ok := f.fh(in.Fh)
	if !ok {
		return nil, fuse.Status(syscall.EBADF)
	}
	in.Fh = fh
	return f.RawFileSystem.Read(cancel, in, buf)
}

func (f *successorFS) Write(cancel <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	fh, ok := f.fh(in.Fh)
	if !ok {
		return 0, fuse.Status(syscall.EBADF)
	}
	in.Fh = fh
	return f.RawFileSystem.Write(cancel, in, data)
}

func (f *successorFS) Writev(cancel <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	fh, ok := f.fh(in.Fh)
	if !ok {
		return 0, fuse.Status(syscall.EBADF)
	}
	in.Fh = fh
	return f.RawFileSystem.Writev(cancel, in, data)
}

func (f *successorFS) Lseek(cancel <-chan struct{}, in *fuse.LseekIn, out *fuse.LseekOut) fuse.Status {
	fh, ok := f.fh(in.Fh)
	if !ok {
		return fuse.Status(syscall.EBADF)
	}
	in.Fh = fh
	return f.RawFileSystem.Lseek(cancel, in, out)
}

func (f *successorFS) Fallocate(cancel <-chan struct{}, in *fuse.FallocateIn) fuse.Status {
	fh, ok := f.fh(in.Fh)
	if !ok {
		return fuse.Status(syscall.EBADF)
	}
	in.Fh = fh
	return f.RawFileSystem.Fallocate(cancel, in)
}

func (f *successorFS) CopyFileRange(cancel <-chan struct{}, in *fuse.CopyFileRangeIn) (uint32, fuse.Status) {
	fhIn, okIn := f.fh(in.FhIn)
	fhOut, okOut := f.fh(in.FhOut)
	if !okIn || !okOut {
		return 0, fuse.Status(syscall.EBADF)
	}
	in.FhIn, in.FhOut = fhIn, fhOut
	return f.RawFileSystem.CopyFileRange(cancel, in)
}

func (f *successorFS) Ioctl(cancel <-chan struct{}, in *fuse.IoctlIn, inbuf []byte, out *fuse.IoctlOut, outbuf []byte) fuse.Status {
	fh, ok := f.fh(in.Fh)
	if !ok {
		return fuse.Status(syscall.ENOTTY)
	}
	in.Fh = fh
	return f.RawFileSystem.Ioctl(cancel, in, inbuf, out, outbuf)
}

func (f *successorFS) ReadDir(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	fh, ok := f.fh(in.Fh)
	if !ok {
		return fuse.Status(syscall.EBADF)
	}
	in.Fh = fh
	return f.RawFileSystem.ReadDir(cancel, in, out)
}

func (f *successorFS) ReadDirPlus(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	fh, ok := f.fh(in.Fh)
	if !ok {
		return fuse.Status(syscall.EBADF)
	}
	in.Fh = fh
	return f.RawFileSystem.ReadDirPlus(cancel, in, out)
}
