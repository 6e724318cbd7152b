package fs

import (
	"context"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// symlinkNode is a symbolic link of the mount. It has no user attributes
// and no mode of its own, as on tmpfs; the daemon never follows it.
type symlinkNode struct {
	nodeBase
}

// specialNode is a FIFO, socket or device node of the mount: the kernel
// serves it, tensorfs keeps only its name, owner, mode and times.
type specialNode struct {
	nodeBase
}

func (n *symlinkNode) withAttrs(fn func(a *alloc.Ref) error) error { return n.leafRef(fn) }
func (n *symlinkNode) stat(st *unix.Stat_t) error                  { return n.leafStat(st) }
func (n *specialNode) withAttrs(fn func(a *alloc.Ref) error) error { return n.leafRef(fn) }
func (n *specialNode) stat(st *unix.Stat_t) error                  { return n.leafStat(st) }

var _ = (fusefs.NodeReadlinker)((*symlinkNode)(nil))

// Readlink reads the link's target.
func (n *symlinkNode) Readlink(ctx context.Context) ([]byte, syscall.Errno) {
	var target []byte
	err := n.leafRef(func(r *alloc.Ref) (err error) {
		target, err = r.Readlink()
		return err
	})
	if err != nil {
		return nil, n.fs.errnoOf("readlink", &n.nodeBase, err)
	}
	return target, 0
}
