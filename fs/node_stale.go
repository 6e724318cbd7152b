package fs

import (
	"context"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"tensorfs/ledger"
)

// staleNode is a node the kernel holds from an earlier daemon that no
// name in the backing reaches any more and whose file the successor
// does not have (a directory removed while a process works in it, a
// device or imported segment removed while open): HandoverFS.Adopt registers it under its node ID so
// that its requests never reach go-fuse with an unknown node ID, which
// panics and logs a stack per request. Every request on it is ESTALE,
// quietly, as a user may repeat them at will; the handles an earlier
// daemon gave out for it are counted against their openers until the
// kernel releases them, as every adopted handle is.
type staleNode struct {
	fusefs.Inode
	fs *filesystem
}

var (
	_ = (fusefs.NodeGetattrer)((*staleNode)(nil))
	_ = (fusefs.NodeSetattrer)((*staleNode)(nil))
	_ = (fusefs.NodeStatxer)((*staleNode)(nil))
	_ = (fusefs.NodeStatfser)((*staleNode)(nil))
	_ = (fusefs.NodeGetxattrer)((*staleNode)(nil))
	_ = (fusefs.NodeListxattrer)((*staleNode)(nil))
	_ = (fusefs.NodeSetxattrer)((*staleNode)(nil))
	_ = (fusefs.NodeRemovexattrer)((*staleNode)(nil))
	_ = (fusefs.NodeIoctler)((*staleNode)(nil))
	_ = (fusefs.NodeOpener)((*staleNode)(nil))
	_ = (fusefs.NodeOpendirHandler)((*staleNode)(nil))
	_ = (fusefs.NodeLookupNoder)((*rootNode)(nil))
)

// LookupNode answers the bridge's LOOKUP of "." by node ID alone, which
// only HandoverFS.Adopt asks (the kernel asks it of a filesystem that
// offers exports, NFS and open_by_handle_at, which tensorfs does not):
// id is a node the kernel holds that no name reaches. A segment whose
// backing file the predecessor handed over becomes its segment again
// (adoptOrphan); anything else a staleNode.
func (r *rootNode) LookupNode(ctx context.Context, id uint64, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	if fd, ok := r.fs.orphans.take(id); ok {
		n, err := r.fs.adoptOrphan(ctx, id, fd)
		if err == nil {
			return n, 0
		}
		r.fs.log.Warn("takeover: a segment open in no directory is stale", "node", id, "err", err)
	}
	n := r.NewInode(ctx, &staleNode{fs: r.fs}, fusefs.StableAttr{Mode: syscall.S_IFREG, Ino: id})
	r.fs.orphans.addUnnamed(id) // for the next successor
	return n, 0
}

func (n *staleNode) Getattr(ctx context.Context, f fusefs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	return syscall.ESTALE
}

func (n *staleNode) Setattr(ctx context.Context, f fusefs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	return syscall.ESTALE
}

func (n *staleNode) Statx(ctx context.Context, f fusefs.FileHandle, flags, mask uint32, out *fuse.StatxOut) syscall.Errno {
	return syscall.ESTALE
}

func (n *staleNode) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	return syscall.ESTALE
}

func (n *staleNode) Getxattr(ctx context.Context, attr string, dest []byte) (uint32, syscall.Errno) {
	return 0, syscall.ESTALE
}

func (n *staleNode) Listxattr(ctx context.Context, dest []byte) (uint32, syscall.Errno) {
	return 0, syscall.ESTALE
}

func (n *staleNode) Setxattr(ctx context.Context, attr string, data []byte, flags uint32) syscall.Errno {
	return syscall.ESTALE
}

func (n *staleNode) Removexattr(ctx context.Context, attr string) syscall.Errno {
	return syscall.ESTALE
}

func (n *staleNode) Ioctl(ctx context.Context, f fusefs.FileHandle, cmd uint32, arg uint64, input []byte, output []byte) (int32, syscall.Errno) {
	return 0, syscall.ENOTTY
}

// Open answers an adopted handle (openAdopted) with a staleHandle charged
// to its opener; any other open is ESTALE.
func (n *staleNode) Open(ctx context.Context, flags uint32) (fusefs.FileHandle, uint32, syscall.Errno) {
	return n.adopt(ctx, flags)
}

// OpendirHandle is Open for a directory's handle.
func (n *staleNode) OpendirHandle(ctx context.Context, flags uint32) (fusefs.FileHandle, uint32, syscall.Errno) {
	return n.adopt(ctx, flags)
}

// adopt counts an adopted handle of the node against its opener.
func (n *staleNode) adopt(ctx context.Context, flags uint32) (fusefs.FileHandle, uint32, syscall.Errno) {
	if flags&openAdopted == 0 {
		return nil, 0, syscall.ESTALE
	}
	uid := caller(ctx).Uid
	n.fs.handles.Add(uid, 1) // whatever the bound, as takeHandle charges an adopted handle
	return &staleHandle{handles: n.fs.handles, uid: uid}, 0, 0
}

// staleHandle is a handle of a staleNode: it holds nothing but its
// opener's charge, and serves nothing.
type staleHandle struct {
	handles *ledger.Row
	uid     uint32
}

var (
	_ = (fusefs.FileReleaser)((*staleHandle)(nil))
	_ = (fusefs.FileReleasedirer)((*staleHandle)(nil))
	_ = (fusefs.FileReader)((*staleHandle)(nil))
	_ = (fusefs.FileWriter)((*staleHandle)(nil))
	_ = (fusefs.FileReaddirenter)((*staleHandle)(nil))
)

// Release gives the opener's charge back.
func (h *staleHandle) Release(ctx context.Context) syscall.Errno {
	h.handles.Give(h.uid, 1)
	return 0
}

// Releasedir is Release for a directory's handle.
func (h *staleHandle) Releasedir(ctx context.Context, flags uint32) { h.handles.Give(h.uid, 1) }

func (h *staleHandle) Read(ctx context.Context, buf []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	return nil, syscall.ESTALE
}

func (h *staleHandle) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	return 0, syscall.ESTALE
}

func (h *staleHandle) Readdirent(ctx context.Context) (*fuse.DirEntry, syscall.Errno) {
	return nil, syscall.ESTALE
}
