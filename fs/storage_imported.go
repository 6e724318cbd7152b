package fs

import (
	"cmp"
	"fmt"
	"maps"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ctl"
	"tensorfs/fdpass"
	"tensorfs/ledger"
)

// importedFile is an imported (FROMFD) segment: a descriptor a client
// sent over the control socket holds its bytes, the daemon holds the
// descriptor, and an empty marker in the backing holds its name, owner,
// flags and attributes. Its bytes are read-only through tensorfs: every
// descriptor the daemon hands out, to the kernel for an open or to a
// peer, is a new read-only open of the sender's file, never the sender's
// own open file description; a memfd is made owner-only at import, or
// refused where it is another user's (memfdOwnerOnly), so that no reader
// opens such a descriptor again for writing. A successor gets the
// descriptor from its predecessor, or after a crash from the keeper's
// journal (Record.Import); without either, recovery removes its marker.
type importedFile struct {
	table *imports
	id    string
	uid   uint32 // who sent it
	// ino and dev identify the sender's file, so that a reopen is checked.
	ino, dev uint64

	mu sync.RWMutex // read-held while fd is used; write-held to close it
	fd int          // -1 once released
}

func (*importedFile) kind() alloc.Kind { return alloc.Imported }

func (*importedFile) attrs(m *alloc.Ref, fn func(*alloc.Ref) error) error { return fn(m) }

// overlay is the marker's stat, with the size of the sender's file.
func (in *importedFile) overlay(m *alloc.Ref, st *unix.Stat_t) error {
	return in.with(func(fd int) error {
		var data unix.Stat_t
		if err := unix.Fstat(fd, &data); err != nil {
			return err
		}
		st.Size, st.Blocks = data.Size, data.Blocks
		return nil
	})
}

func (in *importedFile) open(n *segmentNode, m *alloc.Ref, h handle, flags uint32) (segmentHandle, error) {
	if h.writable || flags&unix.O_TRUNC != 0 {
		return nil, fmt.Errorf("%w: FROMFD segments are read-only: open it with mode 'r'", alloc.ErrReadOnly)
	}
	fd, err := in.reopen()
	if err != nil {
		return nil, err
	}
	_, pt := n.fs.backingFlags(flags)
	return &fileHandle{handle: h, fd: fd, passthrough: pt}, nil
}

func (*importedFile) resize(*alloc.Ref, int64) error {
	return fmt.Errorf("%w: an imported (FROMFD) segment keeps the size its owner gave it", alloc.ErrReadOnly)
}

func (in *importedFile) descriptor(m *alloc.Ref, write bool) (*os.File, error) {
	if write {
		return nil, fmt.Errorf("%w: FROMFD segments are read-only", alloc.ErrReadOnly)
	}
	fd, err := in.reopen()
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), "imported"), nil
}

// mapped: of the processes that map the sender's file outside the mount,
// only the sender's own count (the producer that maps its tensor): who
// else maps a file is not the importer's to learn (DESIGN.md §9).
func (in *importedFile) mapped(*alloc.Ref) (fileID, uint32, bool) {
	return fileID{in.dev, in.ino}, in.uid, true
}

// handle is the /proc path of the daemon's descriptor of the sender's
// file, which may have no name: the same pages, for the daemon's user.
func (in *importedFile) handle(*alloc.Ref) (p string, err error) {
	err = in.with(func(fd int) error {
		p = "/proc/" + strconv.Itoa(os.Getpid()) + "/fd/" + strconv.Itoa(fd)
		return nil
	})
	return p, err
}

// release forgets the import and closes the daemon's descriptor of the
// sender's file.
func (in *importedFile) release() error {
	in.table.drop(in)
	return nil
}

// closeFd closes the daemon's descriptor once no call uses it.
func (in *importedFile) closeFd() {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.fd >= 0 {
		unix.Close(in.fd)
		in.fd = -1
	}
}

// with runs fn with the daemon's descriptor of the sender's file.
func (in *importedFile) with(fn func(fd int) error) error {
	in.mu.RLock()
	defer in.mu.RUnlock()
	if in.fd < 0 {
		return fmt.Errorf("%w: the import was removed", syscall.ENOENT)
	}
	return fn(in.fd)
}

// reopen opens the sender's file again, read-only: a description of the
// daemon's own, checked to be that file.
func (in *importedFile) reopen() (int, error) {
	var fd int
	err := in.with(func(own int) (err error) {
		fd, err = fdpass.Reopen(own, unix.O_RDONLY)
		return err
	})
	return fd, err
}

// imports holds the mount's imported segments by id. Each keeps its
// sender's descriptor open in the daemon, taken from the same budget as
// the descriptors of open segments (filesystem.handles), so that neither
// one user nor all users but root can take the descriptors FUSE service
// needs.
type imports struct {
	held *ledger.Row // the daemon's segment descriptors, per sender
	// journal, if set, receives each import, with a duplicate of its
	// descriptor, before its marker is made, and each import's end
	// (Options.Journal).
	journal func(Record)
	// handing is read-held by an import from its descriptor's addition
	// to its marker, and by an UNLINK segment's removal outside a request
	// (a watch's, a release's) from its unlink to its import's end; and
	// write-held by a handover from its list of the imports (files) on
	// (Server.Handover): an import made meanwhile would be neither handed
	// over nor kept by the keeper, and one ended meanwhile would be
	// handed over with no name, so each waits, and dies with the daemon
	// if the handover succeeds (its successor's watch removes it then).
	handing sync.RWMutex

	mu sync.RWMutex // protects m
	m  map[string]*importedFile
}

// get returns import id, if the daemon holds it.
func (im *imports) get(id string) (*importedFile, bool) {
	im.mu.RLock()
	defer im.mu.RUnlock()
	in, ok := im.m[id]
	return in, ok
}

// add keeps the sender's file open at fd as a new import of uid, or
// refuses as the descriptor budget does (EMFILE past uid's share, ENFILE
// past the total).
func (im *imports) add(fd int, uid uint32) (*importedFile, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, err
	}
	if err := im.held.Take(uid, 1); err != nil {
		return nil, err
	}
	in := im.put(alloc.NewID(), uid, fd, &st)
	if im.journal != nil {
		if dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0); err == nil {
			im.journal(Record{Import: &Import{ID: in.id, UID: uid}, Fd: dup})
		}
	}
	return in, nil
}

// put keeps the file open at fd, whose stat is st, as import id of uid,
// already charged.
func (im *imports) put(id string, uid uint32, fd int, st *unix.Stat_t) *importedFile {
	in := &importedFile{table: im, id: id, uid: uid, ino: st.Ino, dev: st.Dev, fd: fd}
	im.mu.Lock()
	defer im.mu.Unlock()
	if im.m == nil {
		im.m = map[string]*importedFile{}
	}
	im.m[in.id] = in
	return in
}

// files returns a duplicate of each import's descriptor, for a successor:
// the caller owns them.
func (im *imports) files() map[Import]int {
	im.mu.RLock()
	all := slices.Collect(maps.Values(im.m))
	im.mu.RUnlock()
	fds := map[Import]int{}
	for _, in := range all {
		in.with(func(fd int) error {
			dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
			if err == nil {
				fds[Import{ID: in.id, UID: in.uid}] = dup
			}
			return err
		})
	}
	return fds
}

// drop forgets an import and closes its descriptor.
func (im *imports) drop(in *importedFile) {
	im.mu.Lock()
	forgot := im.m[in.id] == in
	if forgot {
		delete(im.m, in.id)
	}
	im.mu.Unlock()
	if forgot {
		im.held.Give(in.uid, 1)
		if im.journal != nil {
			im.journal(Record{Unimport: &Import{ID: in.id, UID: in.uid}})
		}
	}
	in.closeFd()
}

// forget journals the end of each import of dropped, which a successor
// did not take over (adoptImports).
func (im *imports) forget(dropped []Import) {
	for _, imp := range dropped {
		if im.journal != nil {
			im.journal(Record{Unimport: &imp})
		}
	}
}

// adoptImports takes over the imports a predecessor handed over (handed,
// whose descriptors it owns from then on), each charged to its sender as
// its predecessor charged it (over her share, she keeps it), before any
// lookup classifies their markers. Of the markers recovery kept
// (markers), those no descriptor came for are removed, as a mount's
// recovery removes them. After a crash, recovery saw every marker, so a
// descriptor with none (an import that never finished) is closed; it
// returns those, for the journal to forget once the keeper holds this
// daemon's state.
func (fsys *filesystem) adoptImports(handed map[Import]int, markers []alloc.ImportMarker, crashed bool) (dropped []Import) {
	marked := map[string]bool{}
	for _, mk := range markers {
		marked[mk.ID] = true
	}
	for imp, fd := range handed {
		var st unix.Stat_t
		if (crashed && !marked[imp.ID]) || unix.Fstat(fd, &st) != nil {
			unix.Close(fd)
			dropped = append(dropped, imp)
			continue
		}
		fsys.imports.held.Add(imp.UID, 1)
		fsys.imports.put(imp.ID, imp.UID, fd, &st)
	}
	for _, mk := range markers {
		if _, ok := fsys.imports.get(mk.ID); !ok {
			fsys.removeMarker(mk)
		}
	}
	return dropped
}

// lateImports adds to rec the markers of the imports a successor took
// over from a live predecessor that its recovery did not see: those made
// after it recovered the backing and before its predecessor froze. Else
// no watch would wait for the last mapping of an UNLINK one whose last
// close its predecessor had seen (keepUnlinkedImports), and it would keep
// its sender's memory and descriptor until unmount.
func (fsys *filesystem) lateImports(rec *Recovered) {
	seen := map[string]bool{}
	for _, mk := range rec.imports {
		seen[mk.ID] = true
	}
	late := map[string]bool{}
	fsys.imports.mu.RLock()
	for id := range fsys.imports.m {
		if !seen[id] {
			late[id] = true
		}
	}
	fsys.imports.mu.RUnlock()
	if len(late) > 0 {
		rec.imports = append(rec.imports, fsys.store.ImportMarkers(late)...)
	}
}

// keepUnlinkedImports has a successor wait, once it serves, for the last
// mapping by its sender of each UNLINK import it adopted that no handle it
// inherited holds (held), as its predecessor waited, and then remove it
// (rec.kept): recovery keeps every import's marker, mapped or not.
func (fsys *filesystem) keepUnlinkedImports(rec *Recovered, held map[uint64]bool) {
	for _, mk := range rec.imports {
		in, ok := fsys.imports.get(mk.ID)
		if !mk.Unlink || !ok || held[mk.Ino] {
			continue
		}
		id, uid, _ := in.mapped(nil)
		rec.kept = append(rec.kept, keptFile{mk.Ino, []mappedFile{{id, uid}}})
	}
}

// removeMarker removes the marker of an import whose descriptor is gone,
// if it is still at its path (found without following a link), and
// gives back its inode.
func (fsys *filesystem) removeMarker(mk alloc.ImportMarker) {
	dir, name := path.Split(mk.Rel)
	dirfd, err := openBeneath(fsys.store.RootFd, cmp.Or(dir, "."))
	var st unix.Stat_t
	if err == nil {
		defer unix.Close(dirfd)
		err = unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
	}
	if err == nil && st.Ino != mk.Ino {
		err = syscall.ENOENT
	}
	if err == nil {
		err = unix.Unlinkat(dirfd, name, 0)
	}
	if err != nil {
		fsys.log.Warn("takeover: an imported segment whose descriptor is gone keeps its marker until the next mount", "path", mk.Rel, "err", err)
		return
	}
	fsys.inodes.gone(mk.Ino)
	fsys.log.Info("takeover: removed an imported segment, its descriptor ended with an earlier daemon", "path", mk.Rel)
}

// importSegment makes the peer's descriptor f the new segment name in the
// directory open at dirfd, whose flags are pf, without a copy. The marker
// carries the segment's name, owner, flags and metadata, all set through
// its own descriptor: a name renamed or replaced meanwhile is never
// followed, and the sender's file is never written.
func (fsys *filesystem) importSegment(who ctl.Cred, dirfd int, name string, pf alloc.Flags, f *os.File, dtype, shape string) error {
	fd, err := fsys.importable(f, who.Uid)
	if err == nil {
		if err = memfdOwnerOnly(fd, who.Uid); err != nil {
			unix.Close(fd)
		}
	}
	if err != nil {
		return err
	}
	fsys.imports.handing.RLock()
	defer fsys.imports.handing.RUnlock()
	in, err := fsys.imports.add(fd, who.Uid)
	if err != nil {
		unix.Close(fd)
		return err
	}
	if err := fsys.inodes.reserve(who.Uid); err != nil {
		fsys.imports.drop(in)
		return err
	}
	marker, err := unix.Openat(dirfd, name, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		fsys.inodes.unreserve(who.Uid)
		fsys.imports.drop(in)
		return err
	}
	defer unix.Close(marker)
	var size int64
	in.with(func(fd int) error {
		var st unix.Stat_t
		err := unix.Fstat(fd, &st)
		size = st.Size
		return err
	})
	p := alloc.FdPath(marker)
	if os.Geteuid() == 0 {
		err = unix.Fchown(marker, int(who.Uid), int(who.Gid))
	}
	if err == nil {
		err = alloc.InheritFlags(pf|alloc.FromFD, p, false)
	}
	for _, a := range [][2]string{{alloc.AttrDtype, dtype}, {alloc.AttrShape, shape}} {
		if err == nil && a[1] != "" {
			err = alloc.Setxattr(alloc.Object{Path: p, Size: size}, a[0], []byte(a[1]), 0)
		}
	}
	if err == nil {
		err = alloc.MarkImport(p, in.id)
	}
	if err == nil {
		err = unix.Fchmod(marker, 0o444) // last: the daemon may not be root
	}
	var st unix.Stat_t
	if err == nil {
		err = unix.Fstat(marker, &st)
	}
	if err != nil {
		unlinkIfSame(dirfd, name, marker)
		fsys.inodes.unreserve(who.Uid)
		fsys.imports.drop(in)
		return err
	}
	fsys.inodes.made(st.Ino, who.Uid)
	return nil
}

// importable duplicates the peer's descriptor f, which uid sent, if it
// may become a segment: shared memory (a memfd, or a file on tmpfs or
// hugetlbfs, such as /dev/shm: what PyTorch's share_memory_() and
// multiprocessing make) that this very descriptor can read. An O_PATH or
// write-only descriptor would give the segment's readers an access its
// sender does not have; a file of any other filesystem (a library, a
// file on disk) would let its importer learn, through holders, which
// processes map it, and a file on a FUSE filesystem could be one of this
// mount's, which the daemon would have to serve to itself.
//
// The checks run on f itself, and only a file that passes them is
// duplicated: the close of a duplicate of a FUSE file waits for its
// FLUSH, which the sender's own FUSE server may never answer, and f is
// the control socket's to close (counted against its sender until
// closed). Nothing here asks the file's filesystem before it is known
// not to be FUSE: the type comes from the inode as cached
// (AT_STATX_DONT_SYNC), the filesystem from the mount table; only a file
// whose mount this namespace does not list (a memfd's, or another
// namespace's) is asked with fstatfs (fsMagic).
func (fsys *filesystem) importable(f *os.File, uid uint32) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return -1, err
	}
	var cerr error
	err = rc.Control(func(fd uintptr) { cerr = fsys.checkImportable(int(fd), uid) })
	if err == nil {
		err = cerr
	}
	if err != nil {
		return -1, err
	}
	return fdpass.Dup(f)
}

// checkImportable is importable's checks of the peer's descriptor fd.
func (fsys *filesystem) checkImportable(fd int, uid uint32) error {
	var stx unix.Statx_t
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err == nil {
		err = unix.Statx(fd, "", unix.AT_EMPTY_PATH|unix.AT_STATX_DONT_SYNC, unix.STATX_TYPE|unix.STATX_MNT_ID, &stx)
	}
	var magic int64
	switch {
	case err != nil:
		return err
	case fl&unix.O_PATH != 0:
		return fmt.Errorf("%w: an O_PATH descriptor grants no access to a file's bytes; send one opened for reading", syscall.EBADF)
	case fl&unix.O_ACCMODE == unix.O_WRONLY:
		return fmt.Errorf("%w: a write-only descriptor cannot be read; send one opened for reading", syscall.EBADF)
	case uint32(stx.Mode)&syscall.S_IFMT != syscall.S_IFREG:
		return fmt.Errorf("%w: import takes a regular file or memfd", alloc.ErrInvalid)
	}
	if magic, err = fsys.fsMagic(fd, stx.Mnt_id, uid); err != nil {
		return err
	}
	switch magic {
	case unix.TMPFS_MAGIC, unix.HUGETLBFS_MAGIC:
		return nil
	case unix.FUSE_SUPER_MAGIC:
		return fmt.Errorf("%w: the file is on a FUSE filesystem; a file of a tensorfs mount is shared by its path", alloc.ErrInvalid)
	}
	return fmt.Errorf("%w: import takes shared memory (a memfd, or a file on tmpfs such as /dev/shm); copy other files in", alloc.ErrInvalid)
}

// fsTypeWait bounds how long importable waits for a filesystem whose
// type the mount table does not give.
const fsTypeWait = 2 * time.Second

// fsMagic returns the filesystem magic of the file open at fd, on the
// mount of id mntID, for uid's import: from /proc/self/mountinfo where it
// lists the mount, asking no filesystem; else from fstatfs on a
// duplicate, which a FUSE server may leave unanswered, and whose close
// waits for its FLUSH. So that runs on a goroutine of its own, counted
// against uid in fsys.threads until it returns (past uid's share the
// import is refused: EMFILE), and the wait for it is fsTypeWait at most
// (ETIMEDOUT).
func (fsys *filesystem) fsMagic(fd int, mntID uint64, uid uint32) (int64, error) {
	mounts, err := mountinfo.GetMounts(func(i *mountinfo.Info) (skip, stop bool) {
		return uint64(i.ID) != mntID, uint64(i.ID) == mntID
	})
	if err == nil && len(mounts) == 1 {
		switch t := mounts[0].FSType; {
		case t == "tmpfs":
			return unix.TMPFS_MAGIC, nil
		case t == "hugetlbfs":
			return unix.HUGETLBFS_MAGIC, nil
		case t == "fuse" || t == "fuseblk" || strings.HasPrefix(t, "fuse."):
			return unix.FUSE_SUPER_MAGIC, nil
		}
		return 0, nil // another filesystem: not shared memory
	}
	if err := fsys.threads.Take(uid, 1); err != nil {
		return 0, err
	}
	own, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		fsys.threads.Give(uid, 1)
		return 0, err
	}
	type answer struct {
		magic int64
		err   error
	}
	done := make(chan answer, 1)
	go func() {
		defer fsys.threads.Give(uid, 1)
		var sfs unix.Statfs_t
		err := unix.Fstatfs(own, &sfs)
		unix.Close(own)
		done <- answer{sfs.Type, err}
	}()
	select {
	case a := <-done:
		return a.magic, a.err
	case <-time.After(fsTypeWait):
		return 0, fmt.Errorf("%w: the file's filesystem did not say what it is within %v", syscall.ETIMEDOUT, fsTypeWait)
	}
}

// memfdOwnerOnly takes the group and other bits off the mode of the file
// open at fd if it is a memfd, keeping its owner's (a new memfd is 0777:
// it becomes 0700), for an import by uid. Every descriptor of an import
// that the daemon hands out is a read-only reopen, but /proc/self/fd/N of
// a descriptor opens its file again with the file's own mode: a memfd
// left 0777 would open for writing for every reader. A file with a name
// (on /dev/shm, say) keeps the mode its owner gave it, since anyone may
// open it by that name anyway. A memfd is a file of tmpfs or hugetlbfs
// (importable checked that) that has no name and whose link in /proc
// reads "/memfd:NAME (deleted)". Its owner may widen the mode again: then
// it shares its tensor writable, as it would by handing out its
// descriptor.
//
// The daemon changes the mode only where uid could (chmod is the owner's
// or root's): uid's own memfd, or any for root. Another user's memfd
// that group or others may open, a descriptor of which someone passed to
// uid, is refused (EPERM) and keeps its mode: changed, it would be the
// daemon's doing, not its importer's; left as it is, every reader of the
// segment could open the read-only descriptors the daemon hands out
// again for writing, and write a tensor its owner gave uid read-only.
// Another user's owner-only memfd, which no reader can open again, is
// imported as it is.
func memfdOwnerOnly(fd int, uid uint32) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	link, err := os.Readlink(alloc.FdPath(fd))
	if err != nil {
		return err
	}
	if st.Nlink != 0 || !strings.HasPrefix(link, "/memfd:") || st.Mode&0o077 == 0 {
		return nil
	}
	if uid != 0 && st.Uid != uid {
		return fmt.Errorf("%w: the memfd is uid %d's and mode %#o, which would let every reader of the segment open it for writing; only its owner can make it owner-only (fchmod 0700)",
			syscall.EPERM, st.Uid, st.Mode&0o7777)
	}
	if err := unix.Fchmod(fd, st.Mode&0o700); err != nil {
		return fmt.Errorf("%w: cannot make the memfd owner-only (mode %#o to %#o), so every reader could write it: %v",
			syscall.EPERM, st.Mode&0o7777, st.Mode&0o700, err)
	}
	return nil
}

// unlinkIfSame removes name in dirfd if it still names the file open at fd.
func unlinkIfSame(dirfd int, name string, fd int) {
	var a, b unix.Stat_t
	if unix.Fstat(fd, &a) == nil && unix.Fstatat(dirfd, name, &b, unix.AT_SYMLINK_NOFOLLOW) == nil && a.Ino == b.Ino && a.Dev == b.Dev {
		unix.Unlinkat(dirfd, name, 0)
	}
}
