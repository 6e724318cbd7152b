package fs

import (
	"fmt"
	"os"
	"strconv"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// redirect says where the bytes of a segment whose backing file is only
// a marker live (see alloc's marker.go), and its attributes. A nil
// *redirect means the backing object itself.
type redirect struct {
	// disk is the id of a SHARED segment's disk file, which holds its
	// bytes and its attributes (so that both outlive the backing).
	disk string
	// imported is the id of a descriptor imported over the control socket,
	// which holds the bytes; the attributes stay on the marker, never on
	// the sender's file.
	imported string
	// dev is a device segment, whose bytes are in GPU memory; the
	// attributes stay on the (empty) backing file.
	dev *devSeg
}

// attrIno is the inode that alloc.At must find where r's attributes live,
// for the segment whose marker is inode ino: 0 (any) for a SHARED
// segment's disk file, which the daemon names by its own id.
func (r *redirect) attrIno(ino uint64) uint64 {
	if r != nil && r.disk != "" {
		return 0
	}
	return ino
}

// imports holds the descriptors of imported (FROMFD) segments.
type imports struct {
	mu    sync.RWMutex // protects fds and count
	fds   map[string]imported
	count map[uint32]int // imports held, by owner
}

// imported is the descriptor of one import and the uid that sent it.
type imported struct {
	fd  int
	uid uint32
}

// maxImportsPerUID bounds the descriptors one user's imports keep open in
// the daemon, so that no user can take the descriptors FUSE service needs.
const maxImportsPerUID = 4096

// add keeps fd as import id of uid, or refuses with EMFILE when uid holds
// maxImportsPerUID imports already.
func (im *imports) add(id string, fd int, uid uint32) error {
	im.mu.Lock()
	defer im.mu.Unlock()
	if im.fds == nil {
		im.fds, im.count = map[string]imported{}, map[uint32]int{}
	}
	if im.count[uid] >= maxImportsPerUID {
		return fmt.Errorf("%w: uid %d holds %d imported segments, the most one user may", syscall.EMFILE, uid, maxImportsPerUID)
	}
	im.fds[id] = imported{fd, uid}
	im.count[uid]++
	return nil
}

// any reports whether the daemon holds imports; markers of an earlier
// daemon's imports were removed at recovery.
func (im *imports) any() bool {
	im.mu.RLock()
	defer im.mu.RUnlock()
	return len(im.fds) > 0
}

// dup returns a duplicate of import id's descriptor, which the caller
// closes: the same open file, with exactly the access its sender gave.
func (im *imports) dup(id string) (int, error) {
	im.mu.RLock()
	defer im.mu.RUnlock()
	in, ok := im.fds[id]
	if !ok {
		return -1, syscall.ENOENT
	}
	return unix.FcntlInt(uintptr(in.fd), unix.F_DUPFD_CLOEXEC, 0)
}

// procLink returns the /proc path of the daemon's descriptor of import id,
// which opens the sender's file.
func (im *imports) procLink(id string) (string, error) {
	im.mu.RLock()
	defer im.mu.RUnlock()
	in, ok := im.fds[id]
	if !ok {
		return "", syscall.ENOENT
	}
	return "/proc/" + strconv.Itoa(os.Getpid()) + "/fd/" + strconv.Itoa(in.fd), nil
}

// with runs fn with a duplicate of import id's descriptor. No lock is
// held while fn runs.
func (im *imports) with(id string, fn func(fd int) error) error {
	fd, err := im.dup(id)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return fn(fd)
}

func (im *imports) drop(id string) {
	im.mu.Lock()
	defer im.mu.Unlock()
	if in, ok := im.fds[id]; ok {
		unix.Close(in.fd)
		delete(im.fds, id)
		im.count[in.uid]--
	}
}

// redirectOf reads the marker at name in dirfd, whose stat is st: nil
// for an ordinary backing object. Only empty files can be markers.
func (fsys *filesystem) redirectOf(dirfd int, name string, st *unix.Stat_t) *redirect {
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG || st.Size != 0 {
		return nil
	}
	var r *redirect
	onDevice := false
	alloc.At(dirfd, name, st.Ino, func(p string) error {
		if fsys.imports.any() {
			if id := alloc.ImportID(p); id != "" {
				r = &redirect{imported: id}
				return nil
			}
		}
		if fsys.store.Disk != "" {
			if id := alloc.SharedID(p); id != "" {
				r = &redirect{disk: id}
				return nil
			}
		}
		onDevice = fsys.gpu != nil && alloc.DeviceOf(p) != "cpu"
		return nil
	})
	if onDevice {
		if seg, err := fsys.gpu.segment(st.Ino, dirfd, name); err == nil {
			return &redirect{dev: seg}
		}
	}
	return r
}

// withAttrs runs fn with a descriptor and name that reach the attributes
// of the segment whose marker is name in dirfd.
func (fsys *filesystem) withAttrs(r *redirect, dirfd int, name string, fn func(tfd int, tname string) error) error {
	if r != nil && r.disk != "" {
		return fn(fsys.store.DiskFd, r.disk)
	}
	return fn(dirfd, name)
}

// withData runs fn with a descriptor and name that reach the bytes of the
// segment whose marker is name in dirfd.
func (fsys *filesystem) withData(r *redirect, dirfd int, name string, fn func(tfd int, tname string) error) error {
	if r != nil && r.imported != "" {
		return fsys.imports.with(r.imported, func(fd int) error { return fn(fd, "") })
	}
	return fsys.withAttrs(r, dirfd, name, fn)
}

// statSegment fills st for the segment whose marker is name in dirfd:
// the marker's identity, owner and mode with the size and times of where
// its bytes live.
func (fsys *filesystem) statSegment(r *redirect, dirfd int, name string, st *unix.Stat_t) error {
	if err := unix.Fstatat(dirfd, name, st, nofollow(name)); err != nil || r == nil {
		return err
	}
	if r.dev != nil {
		st.Size = r.dev.Size()
		st.Blocks = (st.Size + 511) / 512
		return nil
	}
	ino, nlink := st.Ino, st.Nlink
	mode, uid, gid := st.Mode, st.Uid, st.Gid
	err := fsys.withData(r, dirfd, name, func(tfd int, tname string) error {
		return unix.Fstatat(tfd, tname, st, nofollow(tname))
	})
	st.Ino, st.Nlink = ino, nlink
	if r.imported != "" {
		st.Mode, st.Uid, st.Gid = mode, uid, gid
	}
	return err
}

// lastLinkRedirect returns the redirect of the marker at name when name is
// its last link, so that removing name must release what it redirects to.
func (fsys *filesystem) lastLinkRedirect(dirfd int, name string) *redirect {
	var st unix.Stat_t
	if unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil || st.Nlink != 1 {
		return nil
	}
	return fsys.redirectOf(dirfd, name, &st)
}

// release frees what a removed marker redirected to.
func (fsys *filesystem) release(r *redirect) error {
	switch {
	case r == nil:
	case r.disk != "":
		return fsys.store.RemoveShared(r.disk)
	case r.imported != "":
		fsys.imports.drop(r.imported)
	case r.dev != nil:
		fsys.gpu.drop(r.dev.ino)
	}
	return nil
}
