package fs

// Publishing a directory from the backing (DESIGN.md §10), and the
// control socket's publish and pull.

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/cluster"
	"tensorfs/ctl"
)

// published is one object of a directory being published.
type published struct {
	entry cluster.LocalEntry
	seg   *pulled // its pulled segment (nil for a directory)
	// at is a segment's backing file: its bytes are read from there, one
	// file at a time, never held open for the whole publish.
	at loc
	// frozen is true for a host segment this publish made read-only.
	frozen bool
	node   *segmentNode // its node in the kernel's tree, if any
	// ino is a directory's inode, marked as the cluster's once published.
	ino uint64
}

// publish publishes the directory dir (relative to the root) for who:
// every segment and directory below it, with its owner, mode, time and
// attributes, becomes a new version of dir cluster-wide, and its host
// segments become pulled ones here, read-only. who must own dir or may
// write it, and must be able to read and write each host segment (a
// publish freezes it) and read each directory and published segment;
// and, since its unpublish removes them, may remove each host segment
// and directory from its directory, dir itself too unless who owns it.
// Refused: segments of other kinds (device, imported, SHARED, one still
// to be pulled), a segment open for writing or with more than one name,
// and objects that are neither segments nor directories. It returns the
// version.
func (c *clusterFS) publish(who ctl.Cred, dir string) (string, error) {
	if err := cluster.CheckDir(dir); err != nil {
		return "", err
	}
	// A uid's publishes run one at a time, before the namespace lock:
	// each walks, freezes and hashes its whole directory under that lock,
	// so another user's publish waits for one of hers at most, not for as
	// many as her connections could queue.
	defer c.fsys.usageWalks.lock(who.Uid)()
	c.nsMu.Lock()
	defer c.nsMu.Unlock()
	var top int
	var parent unix.Stat_t
	err := controlBackend{c.fsys}.walk(who, dir, func(pfd int, name string) (err error) {
		if err = unix.Fstat(pfd, &parent); err != nil {
			return err
		}
		top, err = unix.Openat(pfd, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		return err
	})
	if err != nil {
		return "", err
	}
	defer unix.Close(top)
	var st unix.Stat_t
	if err := unix.Fstat(top, &st); err != nil {
		return "", err
	}
	if who.Uid != 0 && who.Uid != st.Uid {
		if !permitted(&who, &st, 2|1) {
			return "", fmt.Errorf("%w: publishing a directory needs its ownership or write permission on it", syscall.EACCES)
		}
		if err := mayRemove(&who, &parent, &st); err != nil {
			return "", fmt.Errorf("its unpublish removes the directory, which uid %d may not: %w", who.Uid, err)
		}
	}
	objs, err := c.collect(who, top, dir, &st)
	if err == nil {
		err = c.freeze(objs, dir)
	}
	if err != nil {
		return "", err
	}
	local := make([]cluster.LocalEntry, len(objs))
	var size int64
	for i, o := range objs {
		local[i] = o.entry
		size += o.entry.Size
	}
	prev := c.charges[dir]
	if err := c.chargeLocked(dir, newCharge(dir, who.Uid, int64(len(objs)), size)); err != nil {
		c.thaw(objs, dir)
		return "", err
	}
	info, err := c.node.Publish(c.ctx, dir, local, cluster.PublishOptions{UID: who.Uid, Keep: c.bounds.keep, Admit: c.bounds.admit})
	var v *cluster.Version
	if err == nil {
		v, err = c.node.Version(c.ctx, info.Version)
	}
	if err != nil {
		c.chargeLocked(dir, prev) // what it gave back is free still: nsMu is held
		c.thaw(objs, dir)
		return "", err
	}
	c.forgetRemovedLocked(dir) // its charge was replaced
	cids := map[string]string{}
	for _, e := range v.Entries {
		cids[e.Path] = e.Content
	}
	// The cluster serves each content from the first segment of it (in
	// the order of their paths, as Publish takes them).
	slices.SortFunc(objs, func(a, b published) int { return entryOrder(a.entry.Path, b.entry.Path) })
	seen := map[string]bool{}
	for i := range objs {
		o := &objs[i]
		if o.seg == nil {
			continue
		}
		cid := cids[o.entry.Path]
		if o.frozen {
			mk := alloc.Marker{Kind: alloc.Pulled, Content: cid, Size: o.entry.Size, Complete: true}
			if err := c.fsys.pathAt(o.at, func(p string) error { return alloc.MarkPulled(p, mk) }); err != nil {
				c.fsys.log.Error("cluster: a published segment's marker was not written; a restart makes it writable again", "path", alloc.EscapeText(dir+"/"+o.entry.Path), "err", err)
			}
			c.fsys.pulled.identify(o.seg, cid, o.entry.Size)
		}
		if !seen[cid] {
			seen[cid] = true
			c.fsys.pulled.serveFrom(cid, o.at, o.entry.Size)
		}
	}
	rec, _ := json.Marshal(dirRecord{Dir: dir, Version: info.Version, Publisher: info.Publisher, UID: info.UID, Time: info.Time})
	if err := alloc.MarkPublished(alloc.FdPath(top), rec); err != nil {
		c.fsys.log.Warn("cluster: the published directory's version is not recorded here", "dir", alloc.EscapeText(dir), "err", err)
	}
	c.markDirs(top, dir, objs)
	c.mu.Lock()
	maps.Copy(c.known, v.Contents)
	c.made[dir] = v
	c.placed[dir] = true
	c.mu.Unlock()
	c.fsys.log.Info("published", "dir", alloc.EscapeText(dir), "version", info.Version, "entries", len(v.Entries), "bytes", v.Bytes(), "uid", who.Uid)
	return info.Version, nil
}

// markDirs marks the directories below the published directory dir (open
// at top) that objs published as the cluster's, each only if it is still
// the directory published (its inode), reached without following a
// symbolic link: the versions made here from then on may use them.
func (c *clusterFS) markDirs(top int, dir string, objs []published) {
	for _, o := range objs {
		if o.ino == 0 {
			continue
		}
		fd, err := reopenDir(top, o.entry.Path, o.ino)
		if err == nil {
			err = alloc.MarkMade(alloc.FdPath(fd), dir)
			unix.Close(fd)
		}
		if err != nil {
			c.fsys.log.Warn("cluster: a published directory is not marked as the cluster's here; its versions leave it alone", "path", alloc.EscapeText(dir+"/"+o.entry.Path), "err", err)
		}
	}
}

// entryOrder orders paths of a published directory as package cluster
// does: "." first, then bytewise.
func entryOrder(a, b string) int {
	switch {
	case a == b:
		return 0
	case a == ".":
		return -1
	case b == ".":
		return 1
	}
	return strings.Compare(a, b)
}

// collect describes every object below the directory open at top (dir in
// the mount, whose stat is st) for a publish by who, checking it.
func (c *clusterFS) collect(who ctl.Cred, top int, dir string, st *unix.Stat_t) ([]published, error) {
	if !permitted(&who, st, 4|1) {
		return nil, fmt.Errorf("%w: %s: publishing needs read and search permission on every directory", syscall.EACCES, alloc.EscapeText(dir))
	}
	root, err := dirEntry(alloc.FdPath(top), ".", st)
	if err != nil {
		return nil, err
	}
	objs := []published{{entry: cluster.LocalEntry{Entry: root}}}
	err = c.fsys.walkFor(who.Uid, top, func(fd int, name, rel string, st *unix.Stat_t) error {
		where := alloc.EscapeText(dir + "/" + rel)
		switch st.Mode & syscall.S_IFMT {
		case syscall.S_IFDIR:
			if !permitted(&who, st, 4|1) {
				return fmt.Errorf("%w: %s: publishing needs read and search permission on every directory", syscall.EACCES, where)
			}
			if err := mayRemoveAt(&who, fd, st); err != nil {
				return fmt.Errorf("%s: its unpublish removes it, which uid %d may not: %w", where, who.Uid, err)
			}
			var e cluster.Entry
			err := alloc.At(fd, name, st.Ino, func(p string) (err error) {
				e, err = dirEntry(p, rel, st)
				return err
			})
			objs = append(objs, published{entry: cluster.LocalEntry{Entry: e}, ino: st.Ino})
			return err
		case syscall.S_IFREG:
			o, err := c.segmentEntry(who, fd, name, dir, rel, st)
			if err != nil {
				return fmt.Errorf("%s: %w", where, err)
			}
			objs = append(objs, o)
			return nil
		}
		return fmt.Errorf("%w: %s: only segments and directories are published", alloc.ErrInvalid, where)
	})
	return objs, err
}

// mayRemoveAt is mayRemove for the object st in the directory open at
// dirfd.
func mayRemoveAt(who *ctl.Cred, dirfd int, st *unix.Stat_t) error {
	var dir unix.Stat_t
	if err := unix.Fstat(dirfd, &dir); err != nil {
		return err
	}
	return mayRemove(who, &dir, st)
}

// dirEntry describes the directory at p (rel in the published one).
func dirEntry(p, rel string, st *unix.Stat_t) (cluster.Entry, error) {
	e := cluster.Entry{Path: rel, Mode: st.Mode, UID: st.Uid, GID: st.Gid, Mtime: st.Mtim.Nano()}
	var err error
	e.Xattrs, err = userXattrs(p)
	return e, err
}

// userXattrs reads the user.* attributes a manifest carries: all but
// tensorfs's own and the tensor attributes (which have fields of their
// own).
func userXattrs(p string) (map[string][]byte, error) {
	names, err := alloc.Listxattr(p)
	if err != nil {
		return nil, err
	}
	var attrs map[string][]byte
	for _, name := range names {
		if strings.HasPrefix(name, "user.tensorfs.") || alloc.TensorAttr(name) {
			continue
		}
		v, ok, err := alloc.GetXattr(p, name)
		if err != nil {
			return nil, err
		}
		if ok {
			if attrs == nil {
				attrs = map[string][]byte{}
			}
			attrs[name] = v
		}
	}
	return attrs, nil
}

// segmentEntry describes the segment name in fd (rel in the published
// directory dir) for a publish by who, with where its bytes are.
func (c *clusterFS) segmentEntry(who ctl.Cred, fd int, name, dir, rel string, st *unix.Stat_t) (published, error) {
	var o published
	m, err := alloc.OpenRef(fd, name, st.Ino)
	if err != nil {
		return o, err
	}
	defer m.Close()
	s, err := c.fsys.classify(m)
	if err != nil {
		return o, err
	}
	if err := statOf(m, s, st); err != nil {
		return o, err
	}
	switch p, _ := s.(*pulled); {
	case s.kind() == alloc.Host:
		if !permitted(&who, st, 4|2) {
			return o, fmt.Errorf("%w: publishing a segment makes it read-only: it needs read and write permission", syscall.EACCES)
		}
		if err := mayRemoveAt(&who, fd, st); err != nil {
			return o, fmt.Errorf("publishing a segment makes it read-only and its unpublish removes it, which uid %d may not: %w", who.Uid, err)
		}
		if st.Nlink > 1 {
			return o, fmt.Errorf("%w: the segment has %d names; a published one has one", alloc.ErrInvalid, st.Nlink)
		}
	case p != nil && p.isComplete():
		if !permitted(&who, st, 4) {
			return o, fmt.Errorf("%w: no read permission", syscall.EACCES)
		}
		o.seg = p
	case p != nil:
		return o, fmt.Errorf("%w: the segment is not pulled here yet (tensorfs pull it first)", alloc.ErrInvalid)
	default:
		return o, fmt.Errorf("%w: %s segments are not published (copy it into a host segment)", alloc.ErrInvalid, s.kind())
	}
	path, _ := m.Path()
	l, err := c.fsys.readLayout(path, rel)
	if err != nil {
		return o, err
	}
	e := cluster.Entry{Path: rel, Mode: st.Mode, UID: st.Uid, GID: st.Gid, Mtime: st.Mtim.Nano(), Size: st.Size,
		Dtype: l.Dtype, Shape: l.Shape, Stride: l.Stride, StorageOffset: l.Offset}
	if e.Xattrs, err = userXattrs(path); err != nil {
		return o, err
	}
	o.at = loc{dir + "/" + rel, st.Ino}
	o.entry = cluster.LocalEntry{Entry: e, Data: locReader{&c.fsys.pulled.fds, o.at}}
	return o, nil
}

// freeze makes the host segments of objs (below dir) read-only before
// they are hashed: each gets a pulled marker without a content ID, joins
// the pulled set, and its node (if the kernel has one) gets the pulled
// storage once no handle has it open for writing. A segment open for
// writing, or one no longer where collect found it, undoes it all.
func (c *clusterFS) freeze(objs []published, dir string) error {
	for i := range objs {
		o := &objs[i]
		if o.seg != nil || o.entry.IsDir() {
			continue
		}
		f, err := openLoc(c.fsys.store.RootFd, o.at)
		if err == nil {
			err = c.freezeOne(o, f, dir)
			f.Close()
		}
		if err != nil {
			c.thaw(objs, dir)
			return err
		}
	}
	return nil
}

// freezeOne freezes the host segment of o, whose backing file is open
// read-only at f.
func (c *clusterFS) freezeOne(o *published, f *os.File, dir string) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return err
	}
	mk := alloc.Marker{Kind: alloc.Pulled, Size: st.Size, Complete: true}
	if err := alloc.MarkPulled(alloc.FdPath(int(f.Fd())), mk); err != nil {
		return err
	}
	o.seg, o.frozen = c.fsys.pulled.add(st.Ino, mk), true
	if n := c.fsys.segmentAt(dir + "/" + o.entry.Path); n != nil && n.StableAttr().Ino == st.Ino {
		// A writer that has exited may still hold a handle for a moment:
		// the kernel releases a closed file after close(2) returns. Its
		// release is waited for, a second at most.
		for wait := 0; ; wait++ {
			n.opening.Lock()
			n.mu.Lock()
			i := slices.IndexFunc(n.handles, func(h *handle) bool { return h.writable })
			var pid int
			if i >= 0 {
				pid = int(n.handles[i].pid)
			}
			n.mu.Unlock()
			if i < 0 {
				n.kind.store(o.seg)
				o.node = n
			}
			n.opening.Unlock()
			if i < 0 {
				break
			}
			if unix.Kill(pid, 0) != unix.ESRCH || wait == 100 {
				return fmt.Errorf("%w: %s is open for writing by pid %d (%s); close it, then publish", syscall.EBUSY, alloc.EscapeText(dir+"/"+o.entry.Path), pid, alloc.Escape(comm(pid)))
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	// Bytes written before the freeze are what is hashed: the size is
	// read again once no writer is left.
	err := c.noWriter(f, dir+"/"+o.entry.Path)
	if err == nil {
		err = unix.Fstat(int(f.Fd()), &st)
	}
	if err != nil {
		return err
	}
	o.entry.Size = st.Size
	return nil
}

// noWriter returns nil if nothing can write the frozen segment at rel,
// whose backing file is open read-only at f, any more: no open file
// description of that file anywhere has write access (a descriptor in any
// process or in flight, one that export or load handed out, a writable
// mapping that outlived its close, the kernel's passthrough file), which
// the kernel tells by granting a read lease (taken and given back at
// once). Otherwise EBUSY, naming the writers /proc shows; where no lease
// can be asked (leases off), EBUSY too: a check that cannot see never
// concludes there is no writer. A writer that comes after the freeze is
// refused by its open (frozen).
func (c *clusterFS) noWriter(f *os.File, rel string) error {
	fd := int(f.Fd())
	_, err := unix.FcntlInt(uintptr(fd), unix.F_SETLEASE, unix.F_RDLCK)
	if err == nil {
		_, err = unix.FcntlInt(uintptr(fd), unix.F_SETLEASE, unix.F_UNLCK)
		return err
	}
	where := alloc.EscapeText(rel)
	if !errors.Is(err, unix.EAGAIN) {
		return fmt.Errorf("%w: %s: whether anything may still write it cannot be told (a read lease: %v; publishing needs file leases, fs.leases-enable=1)", syscall.EBUSY, where, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	who := writers(c.fsys.segmentFiles(&st), fd)
	if len(who) > maxNamed {
		who = append(who[:maxNamed], fmt.Sprintf("%d more", len(who)-maxNamed))
	}
	if len(who) == 0 {
		who = []string{"a descriptor export or load handed out, or, in passthrough mode, a process that has it open or mapped (the kernel's file of it is read-write), or a lease on it"}
	}
	return fmt.Errorf("%w: %s may still be written: %s; close or unmap it, then publish", syscall.EBUSY, where, strings.Join(who, "; "))
}

// maxNamed bounds the writers a refused publish names.
const maxNamed = 8

// frozen refuses a writable open or descriptor of the segment of backing
// inode ino, just opened, if a publish froze it meanwhile (noWriter saw
// the open, or the open sees the freeze).
func (fsys *filesystem) frozen(ino uint64) error {
	if fsys.pulled.has(ino) {
		return errPublished
	}
	return nil
}

// segmentFiles returns the files whose mappings map the segment whose
// backing file's stat is st: through this mount, earlier ones, and the
// backing file itself.
func (fsys *filesystem) segmentFiles(st *unix.Stat_t) []mappedFile {
	files := everyone(fileID{fsys.fuseDev.Load(), st.Ino}, fileID{st.Dev, st.Ino})
	for _, dev := range fsys.oldDevs {
		files = append(files, mappedFile{fileID{dev, st.Ino}, anyUID})
	}
	return files
}

// thaw undoes freeze: the segments it froze are host segments again.
func (c *clusterFS) thaw(objs []published, dir string) {
	for i := range objs {
		o := &objs[i]
		if !o.frozen {
			continue
		}
		if err := c.fsys.pathAt(o.at, alloc.Unmark); err != nil {
			c.fsys.log.Error("cluster: a segment frozen for a failed publish keeps its marker; a restart makes it writable again", "path", alloc.EscapeText(dir+"/"+o.entry.Path), "err", err)
		}
		c.fsys.pulled.forget(o.seg)
		if o.node != nil {
			o.node.opening.Lock()
			o.node.kind.store(host{})
			o.node.opening.Unlock()
		}
		o.frozen, o.seg, o.node = false, nil, nil
	}
}

// segmentAt returns the node the kernel knows at rel (relative to the
// root) if it is a segment's.
func (fsys *filesystem) segmentAt(rel string) *segmentNode {
	i := fsys.inodeAt(rel)
	if i == nil {
		return nil
	}
	n, _ := i.Operations().(*segmentNode)
	return n
}

// inodeAt returns the inode the kernel knows at rel (relative to the
// root; "." is the root), nil where it knows none.
func (fsys *filesystem) inodeAt(rel string) *fusefs.Inode {
	i := fsys.root.EmbeddedInode()
	if rel == "." {
		return i
	}
	for _, part := range strings.Split(rel, "/") {
		if i = i.GetChild(part); i == nil {
			return nil
		}
	}
	return i
}

var _ = (ctl.Publisher)(controlBackend{})

// Publish serves the control socket's publish (clusterFS.publish).
func (b controlBackend) Publish(cred ctl.Cred, dir string) (string, error) {
	if b.fsys.cl == nil {
		return "", errNoCluster
	}
	v, err := b.fsys.cl.publish(cred, dir)
	if err != nil {
		return "", fmt.Errorf("%s: %w", alloc.EscapeText(dir), err)
	}
	return v, nil
}

// Pull serves the control socket's pull (clusterFS.pullDir).
func (b controlBackend) Pull(cred ctl.Cred, dir string) (int64, error) {
	if b.fsys.cl == nil {
		return 0, errNoCluster
	}
	n, err := b.fsys.cl.pullDir(cred, dir)
	if err != nil {
		return n, fmt.Errorf("%s: %w", alloc.EscapeText(dir), err)
	}
	return n, nil
}
