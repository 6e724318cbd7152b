package fs

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"path"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/cluster"
	"tensorfs/ctl"
)

// The mount's side of a cluster (DESIGN.md §10): package cluster moves
// the bytes and keeps the namespace in etcd; here, a directory is
// published from the backing, every published directory is made in the
// backing as its versions arrive (names, owners, modes, times, attributes
// and pulled markers, without the bytes), and pulled segments are filled
// from the cluster straight into their backing files. Nothing here runs
// unless the mount joined a cluster (Options.Cluster).

// errNoCluster refuses a cluster operation on a mount that joined none.
var errNoCluster = fmt.Errorf("%w: this mount has joined no cluster (mount with --cluster)", syscall.EOPNOTSUPP)

// clusterFS is the mount's membership of a cluster.
type clusterFS struct {
	fsys *filesystem
	node *cluster.Node
	ctx  context.Context // ends at close
	stop context.CancelFunc
	wg   sync.WaitGroup // the watch and the pulls' waiters

	// nsMu serialises the changes to published directories' names: a
	// publish, and the making of a version from the namespace.
	nsMu sync.Mutex

	mu sync.Mutex
	// known are the contents of the versions seen, by ID: their piece
	// hashes, for pulls.
	known map[string]*cluster.Content
	// busy are the contents being pulled, by ID.
	busy map[string]*leader
	// pulls are the pulls that "tensorfs pull" runs, by directory, for
	// the progress user.tensorfs.cluster shows.
	pulls map[string]*cluster.Pull
	// made is the version of each published directory last made here.
	made map[string]*cluster.Version
	// tried is the version of each published directory this node last
	// set out to make: one not made (a conflict, a refusal) is not tried
	// again for a pull, which would read its whole manifest and find the
	// same.
	tried map[string]string
	// placed are the published directories whose versions are made, or
	// being made, here: a node finds what a version made by its path, so
	// no directory on the way to one is renamed (fs.clusterStays).
	placed map[string]bool
	// conflicts are, by published directory, the names of its version
	// last made here that this node left alone.
	conflicts map[string]conflicts

	// bounds are what one user's publications may take; charges what
	// each published directory's version made here is charged (nsMu).
	bounds  *bounds
	charges map[string]charge
	// removed are the published directories removed here, whose
	// versions are not made here again (nsMu; cluster_removed.go).
	removed map[string]removedRecord
}

// conflicts are the names of a published version left alone here.
type conflicts struct {
	dirRecord
	paths []string // relative to the root
}

// joinCluster makes the mount a node of the cluster cfg names, its
// users' publications bounded by b (the piece server listens from now
// on; etcd is reached in the background).
func (fsys *filesystem) joinCluster(cfg cluster.Config, b ClusterBounds) error {
	if cfg.Log == nil {
		cfg.Log = fsys.log
	}
	bnd, err := newBounds(b, fsys.store.RootFd, fsys.ledger)
	if err != nil {
		return err
	}
	bnd.log(fsys.log)
	node, err := cluster.Join(cfg)
	if err != nil {
		return err
	}
	c := &clusterFS{fsys: fsys, node: node, known: map[string]*cluster.Content{}, busy: map[string]*leader{}, pulls: map[string]*cluster.Pull{},
		made: map[string]*cluster.Version{}, tried: map[string]string{}, placed: map[string]bool{}, conflicts: map[string]conflicts{}, bounds: bnd, charges: map[string]charge{}, removed: map[string]removedRecord{}}
	c.ctx, c.stop = context.WithCancel(context.Background())
	fsys.cl = c
	return nil
}

// start charges the published directories in the backing to their
// publishers, serves the complete pulled segments recovery found and
// makes the published directories as they are and as they change, until
// close.
func (c *clusterFS) start() {
	c.recount()
	c.loadRemoved()
	for cid, size := range c.fsys.pulled.served() {
		c.node.Offer(cid, c.fsys.pulled.source(cid), size)
	}
	c.node.Offered()
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		c.watch()
	}()
}

// close leaves the cluster: pulls end, the node revokes its lease.
func (c *clusterFS) close() {
	c.stop()
	c.node.Close()
	c.wg.Wait()
	c.fsys.pulled.fds.closeIdle()
}

// watch makes each published directory's versions as they arrive.
func (c *clusterFS) watch() {
	for ev := range c.node.Watch(c.ctx, c.knownDirs()) {
		if ev.Deleted {
			c.withdraw(ev.Dir, ev.Missed)
			continue
		}
		for try := 0; c.ctx.Err() == nil; try++ {
			v, err := c.node.Version(c.ctx, ev.Version)
			if err == nil {
				err = c.materialize(ev.DirInfo, v)
			}
			if err == nil {
				break
			}
			c.fsys.log.Warn("cluster: cannot make a published version here", "dir", alloc.EscapeText(ev.Dir), "version", ev.Version, "err", err)
			if !errors.Is(err, cluster.ErrUnavailable) {
				break // a version refused is not asked for again
			}
			select {
			case <-time.After(cluster.Backoff(try)):
			case <-c.ctx.Done():
			}
		}
	}
}

// dirRecord is what a published directory's backing directory records
// of its version (alloc.MarkPublished), and user.tensorfs.cluster shows.
type dirRecord struct {
	// Dir is the published directory's path, as published: the
	// directory keeps it under any name it is moved to.
	Dir       string    `json:"dir,omitempty"`
	Version   string    `json:"version"`
	Publisher string    `json:"publisher"`
	UID       uint32    `json:"uid"` // the publisher's uid, charged with what the version made here
	Time      time.Time `json:"time"`
	// Refused is the last version not made here, past its publisher's
	// bounds on this node, and why.
	Refused *refusedVersion `json:"refused,omitempty"`
}

// materialize makes version v of the published directory info.Dir in the
// backing: its directories and, for each file, a pulled segment with the
// published owner, mode, times and attributes whose bytes come when it is
// opened or pulled. A name whose content did not change keeps its
// segment (and its bytes); one that changed gets a new segment, while an
// open file of the old one keeps working; names of the old version that
// v has not are removed. Objects that are not pulled segments (a local
// segment a user made at a published name) are left alone. Nothing is
// followed: every directory is opened below its parent without following
// a symbolic link, and entries were checked by package cluster (clean
// relative paths, files and directories only).
func (c *clusterFS) materialize(info cluster.DirInfo, v *cluster.Version) error {
	if err := cluster.CheckDir(info.Dir); err != nil {
		return err // package cluster refuses such a name; never walk one
	}
	c.nsMu.Lock()
	defer c.nsMu.Unlock()
	// A version replaced since its event was sent is not made: it would
	// undo its successor, a publish of this node's among them (which the
	// watch reports after the publish has made it here). The successor's
	// event follows.
	cur, err := c.node.Lookup(c.ctx, info.Dir)
	switch {
	case errors.Is(err, cluster.ErrNotPublished):
		return nil // unpublished since: its event follows
	case err != nil:
		return err
	case cur.Version != v.ID:
		c.fsys.log.Info("cluster: a version already replaced is not made", "dir", alloc.EscapeText(info.Dir), "version", v.ID, "current", cur.Version)
		return nil
	}
	c.mu.Lock()
	c.tried[info.Dir] = v.ID
	c.mu.Unlock()
	if c.skipRemovedLocked(info.Dir, v.ID) {
		c.fsys.log.Info("cluster: a version removed here is not made again", "dir", alloc.EscapeText(info.Dir), "version", v.ID)
		return nil
	}
	if err := c.chargeLocked(info.Dir, newCharge(info.Dir, info.UID, int64(len(v.Entries)), v.Bytes())); err != nil {
		c.refuse(info, ownerOf(v), err)
		return err
	}
	c.mu.Lock()
	maps.Copy(c.known, v.Contents)
	prev := c.made[info.Dir]
	placed := c.placed[info.Dir]
	c.placed[info.Dir] = true // before its path is walked: no rename moves it meanwhile
	c.mu.Unlock()
	top, err := c.openPath(info.Dir, ownerOf(v))
	if err != nil && !placed {
		c.mu.Lock()
		delete(c.placed, info.Dir) // nothing made: the local directories on its path are free to move
		c.mu.Unlock()
	}
	if cf := (*conflict)(nil); errors.As(err, &cf) {
		c.leftAlone(info, []*conflict{cf})
		return nil
	}
	if err != nil {
		c.leftAlone(info, nil)
		return err
	}
	defer unix.Close(top)
	var left []*conflict
	dirs := newDirCache(top)
	defer dirs.close()
	want := map[string]bool{}
	var failed error
	for i := range v.Entries {
		e := &v.Entries[i]
		want[e.Path] = true
		if e.Path == "." {
			continue
		}
		rel := info.Dir + "/" + e.Path
		pfd, err := dirs.get(path.Dir(e.Path))
		switch {
		case errors.Is(err, errNotMade):
			continue // its directory could not be made
		case err != nil:
		case e.IsDir():
			var fd int
			if fd, err = c.makeDir(pfd, path.Base(e.Path), rel, info.Dir); err == nil {
				err = dirs.put(e.Path, fd)
			}
		default:
			err = c.makeFile(pfd, path.Base(e.Path), rel, e)
		}
		var cf *conflict
		switch {
		case errors.As(err, &cf):
			left = append(left, cf)
		case err != nil:
			failed = cmpErr(failed, err)
		}
	}
	c.removeStale(top, info.Dir, want, prev)
	// Directories' attributes last, deepest first: their times change
	// while their names are made.
	for i := len(v.Entries) - 1; i >= 0; i-- {
		e := &v.Entries[i]
		if !e.IsDir() {
			continue
		}
		fd, err := dirs.get(e.Path)
		if err == nil {
			err = applyEntry(alloc.FdPath(fd), e)
		}
		if err != nil && !errors.Is(err, errNotMade) {
			failed = cmpErr(failed, fmt.Errorf("%s: %w", alloc.EscapeText(info.Dir+"/"+e.Path), err))
		}
	}
	rec, _ := json.Marshal(dirRecord{Dir: info.Dir, Version: v.ID, Publisher: info.Publisher, UID: info.UID, Time: info.Time})
	if err := alloc.MarkPublished(alloc.FdPath(top), rec); err != nil {
		failed = cmpErr(failed, err)
	}
	c.leftAlone(info, left) // before made: whoever sees the version made sees what it left
	c.mu.Lock()
	c.made[info.Dir] = v
	c.mu.Unlock()
	if failed == nil {
		c.fsys.log.Info("cluster: version made here", "dir", alloc.EscapeText(info.Dir), "version", v.ID, "publisher", info.Publisher, "entries", len(v.Entries))
	}
	return failed
}

// leftAlone logs each published name of info.Dir that this node left
// alone (a conflict) and keeps their paths for user.tensorfs.cluster.
func (c *clusterFS) leftAlone(info cluster.DirInfo, left []*conflict) {
	var paths []string
	for _, cf := range left {
		c.fsys.log.Warn("cluster: a published name is left alone", "dir", alloc.EscapeText(info.Dir), "version", info.Version, "why", cf)
		paths = append(paths, cf.path)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(paths) == 0 {
		delete(c.conflicts, info.Dir)
		return
	}
	c.conflicts[info.Dir] = conflicts{dirRecord{Version: info.Version, Publisher: info.Publisher, Time: info.Time}, paths}
}

// cmpErr keeps the first error.
func cmpErr(first, err error) error {
	if first != nil {
		return first
	}
	return err
}

// conflict refuses to make a published name where this node holds a
// local object (any user's, root's included), which is left alone: its
// path (relative to the root) and what it is.
type conflict struct{ path, what string }

func (e *conflict) Error() string {
	return fmt.Sprintf("%s: %s here; it is left alone", alloc.EscapeText(e.path), e.what)
}

// conflictAt is the conflict of the object at rel whose stat is st, or,
// without one, what is said.
func conflictAt(rel string, st *unix.Stat_t, what string) error {
	if st != nil {
		what = fmt.Sprintf("%s of uid %d, mode %04o, holds a published name", fileType(st.Mode), st.Uid, st.Mode&07777)
	}
	return &conflict{rel, what}
}

// fileType names the type of object mode says.
func fileType(mode uint32) string {
	switch mode & syscall.S_IFMT {
	case syscall.S_IFDIR:
		return "a directory"
	case syscall.S_IFREG:
		return "a local segment"
	case syscall.S_IFLNK:
		return "a symbolic link"
	}
	return "another object"
}

// clusterDir reports whether the directory open at fd is the cluster's:
// one the daemon made for a published directory (alloc.MarkMade) or one
// published. Only the daemon sets either mark; any other is local.
func clusterDir(fd int) (bool, error) {
	p := alloc.FdPath(fd)
	made, err := alloc.ReadMade(p)
	if err != nil || made != "" {
		return made != "", err
	}
	rec, err := alloc.ReadPublished(p)
	return rec != nil, err
}

// ownerOf returns the owner of version v's directory, whose credentials
// decide where on the way to it a name may be made in a local directory.
// Root's count as nobody's: whoever may write a directory of root's may
// publish it, and gains no root rights on other nodes by it.
func ownerOf(v *cluster.Version) ctl.Cred {
	for _, e := range v.Entries {
		if e.Path == "." && e.UID != 0 {
			return ctl.Cred{Uid: e.UID, Gid: e.GID}
		}
	}
	return ctl.Cred{Uid: nobody, Gid: nobody}
}

// nobody is the unprivileged user that the owner of a version's
// directory counts as where it is root.
const nobody = 65534

// openPath opens the backing directory of the published directory dir
// below the root, one component at a time without following a symbolic
// link, and returns its O_PATH descriptor. A missing component is made
// (root's, 0755, marked as the cluster's) in the root, in a directory
// that is the cluster's, or in a local one that owner (the published
// directory's) may write and search, as owner could on tmpfs; the
// published directory, where it exists, must be the cluster's. Otherwise
// a conflict names the path: nothing is taken from a local directory, or
// made in one its owner's rules keep owner out of.
func (c *clusterFS) openPath(dir string, owner ctl.Cred) (int, error) {
	fd, err := unix.FcntlInt(uintptr(c.fsys.store.RootFd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	own, done := true, ""
	parts := strings.Split(dir, "/")
	for i, part := range parts {
		if part == "" || part == "." || part == ".." {
			unix.Close(fd)
			return -1, fmt.Errorf("%w: %q is not a clean relative path", alloc.ErrInvalid, dir)
		}
		done = path.Join(done, part)
		next, made, err := c.dirAt(fd, part, done, dir, own || mayWrite(fd, &owner), 0o755)
		unix.Close(fd)
		if err != nil {
			return -1, err
		}
		fd = next
		own = made
		if !made {
			own, err = clusterDir(fd)
		}
		if err == nil && !own && i == len(parts)-1 {
			err = conflictStat(fd, done)
		}
		if err != nil {
			unix.Close(fd)
			return -1, err
		}
	}
	return fd, nil
}

// mayWrite reports whether who may make a name in the directory open at
// fd (write and search permission).
func mayWrite(fd int, who *ctl.Cred) bool {
	var st unix.Stat_t
	return unix.Fstat(fd, &st) == nil && permitted(who, &st, 2|1)
}

// conflictStat is conflictAt for the object open at fd.
func conflictStat(fd int, rel string) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	return conflictAt(rel, &st, "")
}

// dirAt opens the directory name in parent (rel in the mount), or, if it
// is missing and mayMake is set, makes it (mode, marked as made for the
// published directory dir) and reports made. Another object at name, or
// a missing one that may not be made, is a conflict.
func (c *clusterFS) dirAt(parent int, name, rel, dir string, mayMake bool, mode uint32) (fd int, made bool, err error) {
	for range 2 { // a name made meanwhile by another is opened again
		fd, err := unix.Openat(parent, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		switch {
		case err == nil:
			return fd, false, nil
		case errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP):
			var st unix.Stat_t
			if err := unix.Fstatat(parent, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
				return -1, false, err
			}
			return -1, false, conflictAt(rel, &st, "")
		case !errors.Is(err, unix.ENOENT):
			return -1, false, fmt.Errorf("%s: %w", alloc.EscapeText(rel), err)
		case !mayMake:
			return -1, false, conflictAt(path.Dir(rel), nil, "a local directory the published directory's owner may not write is on its path: no name is made in it")
		}
		fd, err = c.newDir(parent, name, rel, dir, mode)
		if !errors.Is(err, unix.EEXIST) {
			return fd, err == nil, err
		}
	}
	return -1, false, fmt.Errorf("%s: %w", alloc.EscapeText(rel), unix.EEXIST)
}

// newDir makes the directory name in parent, marked as made for the
// published directory dir before it has its name (made under a temporary
// one, then renamed without replacing anything), and returns its O_PATH
// descriptor; EEXIST if name exists by then.
func (c *clusterFS) newDir(parent int, name, rel, dir string, mode uint32) (int, error) {
	tmp := ".tensorfs-made-" + alloc.NewID()
	if err := unix.Mkdirat(parent, tmp, mode); err != nil {
		return -1, fmt.Errorf("%s: %w", alloc.EscapeText(rel), err)
	}
	fd, err := unix.Openat(parent, tmp, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err == nil {
		if err = alloc.MarkMade(alloc.FdPath(fd), dir); err == nil {
			err = unix.Renameat2(parent, tmp, parent, name, unix.RENAME_NOREPLACE)
		}
		if err != nil {
			unix.Close(fd)
		}
	}
	if err != nil {
		unix.Unlinkat(parent, tmp, unix.AT_REMOVEDIR)
		if errors.Is(err, unix.EEXIST) {
			return -1, err
		}
		return -1, fmt.Errorf("%s: %w", alloc.EscapeText(rel), err)
	}
	c.fsys.notifyNewName(rel)
	return fd, nil
}

// makeDir makes (or finds, if it is the cluster's) the directory name in
// dirfd, rel in the mount, of the published directory dir, and returns
// its O_PATH descriptor.
func (c *clusterFS) makeDir(dirfd int, name, rel, dir string) (int, error) {
	fd, made, err := c.dirAt(dirfd, name, rel, dir, true, 0o700) // its mode comes with its attributes
	if err != nil || made {
		return fd, err
	}
	own, err := clusterDir(fd)
	if err == nil && !own {
		err = conflictStat(fd, rel)
	}
	if err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// makeFile makes the pulled segment of entry e at name in dirfd (rel in
// the mount), or keeps the one there if it has e's content.
func (c *clusterFS) makeFile(dirfd int, name, rel string, e *cluster.Entry) error {
	var old *alloc.Ref
	var st unix.Stat_t
	err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
	switch {
	case errors.Is(err, unix.ENOENT):
	case err != nil:
		return err
	case st.Mode&syscall.S_IFMT != syscall.S_IFREG:
		return conflictAt(rel, &st, "")
	default:
		if old, err = alloc.OpenRef(dirfd, name, st.Ino); err != nil {
			return err
		}
		defer old.Close()
		p, _ := old.Path()
		mk, err := alloc.ReadMarker(p, old.Stat())
		if err != nil {
			return err
		}
		if mk.Kind != alloc.Pulled {
			return conflictAt(rel, &st, "")
		}
		if mk.Content == e.Content {
			c.fsys.pulled.classify(old.Stat(), mk)
			return applyEntry(p, e)
		}
	}
	fd, err := unix.Openat(dirfd, ".", unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	mk := alloc.Marker{Kind: alloc.Pulled, Content: e.Content, Size: e.Size, Complete: e.Size == 0}
	p := alloc.FdPath(fd)
	if err := alloc.MarkPulled(p, mk); err != nil {
		return err
	}
	if err := applyEntry(p, e); err != nil {
		return err
	}
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	seg := c.fsys.pulled.add(st.Ino, mk)
	if err = c.link(dirfd, fd, name, old != nil); err != nil {
		c.fsys.pulled.forget(seg)
		return fmt.Errorf("%s: %w", alloc.EscapeText(rel), err)
	}
	if old != nil {
		if prev := c.fsys.pulled.get(old.Stat().Ino); prev != nil {
			prev.release()
		}
		c.fsys.forgetName(rel)
	}
	c.fsys.notifyNewName(rel)
	return nil
}

// link gives the unnamed file open at fd the name name in dirfd,
// replacing what is there if replace is set (through a temporary name
// and a rename, so that the name is never missing).
func (c *clusterFS) link(dirfd, fd int, name string, replace bool) error {
	to := name
	if replace {
		to = ".tensorfs-pulled-" + alloc.NewID()
	}
	if err := unix.Linkat(unix.AT_FDCWD, alloc.FdPath(fd), dirfd, to, unix.AT_SYMLINK_FOLLOW); err != nil {
		return err
	}
	if !replace {
		return nil
	}
	if err := unix.Renameat(dirfd, to, dirfd, name); err != nil {
		unix.Unlinkat(dirfd, to, 0)
		return err
	}
	return nil
}

// applyEntry gives the object at p (a FdPath) e's owner, mode, times and
// attributes where they differ. Tensor attributes are written as published (package cluster
// checked them against the size), other user.* attributes not in e are
// removed; tensorfs's own (user.tensorfs.*) are left alone.
func applyEntry(p string, e *cluster.Entry) error {
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		return err
	}
	attrs := map[string][]byte{}
	for name, v := range e.Xattrs {
		attrs[name] = v
	}
	l := e.Layout()
	for _, a := range [][2]string{{alloc.AttrDtype, l.Dtype}, {alloc.AttrShape, l.Shape}, {alloc.AttrStride, l.Stride}, {alloc.AttrOffset, l.Offset}} {
		if a[1] != "" {
			attrs[a[0]] = []byte(a[1])
		}
	}
	have, err := alloc.Listxattr(p)
	if err != nil {
		return err
	}
	for _, name := range have {
		if _, ok := attrs[name]; !ok && !strings.HasPrefix(name, "user.tensorfs.") {
			if err := unix.Removexattr(p, name); err != nil {
				return err
			}
		}
	}
	for name, v := range attrs {
		cur, ok, err := alloc.GetXattr(p, name)
		if err == nil && (!ok || !bytes.Equal(cur, v)) {
			err = unix.Setxattr(p, name, v, 0)
		}
		if err != nil {
			return err
		}
	}
	if st.Uid != e.UID || st.Gid != e.GID {
		if err := unix.Chown(p, int(e.UID), int(e.GID)); err != nil {
			return err
		}
	}
	if st.Mode&07777 != e.Mode&07777 || st.Uid != e.UID || st.Gid != e.GID {
		if err := unix.Chmod(p, e.Mode&07777); err != nil { // after chown, which clears set-id bits
			return err
		}
	}
	if st.Mtim.Nano() != e.Mtime {
		mt := unix.NsecToTimespec(e.Mtime)
		return unix.UtimesNanoAt(unix.AT_FDCWD, p, []unix.Timespec{mt, mt}, 0)
	}
	return nil
}

// removeStale removes, below the published directory open at top (dir in
// the mount), the pulled segments whose paths the current version has
// not, and the directories of the previous version made here (prev, nil
// if unknown) that it has not, once they are empty. A directory below
// that is published on its own is its own version's.
func (c *clusterFS) removeStale(top int, dir string, want map[string]bool, prev *cluster.Version) {
	var gone []string
	if prev != nil {
		for _, e := range prev.Entries {
			if e.IsDir() && !want[e.Path] {
				gone = append(gone, e.Path)
			}
		}
	}
	c.removePulled(top, dir, want)
	slices.Sort(gone)
	for i := len(gone) - 1; i >= 0; i-- { // deepest first
		if removeClusterDir(top, gone[i]) == nil {
			c.fsys.forgetName(dir + "/" + gone[i])
		}
	}
}

// removePulled removes, below the published directory open at top (dir
// in the mount), the pulled segments whose paths want has not, and
// returns the paths of the directories it found there; a directory below
// that is published on its own is its own version's.
func (c *clusterFS) removePulled(top int, dir string, want map[string]bool) []string {
	var dirs []string
	alloc.Walk(top, func(fd int, name, rel string, st *unix.Stat_t) error {
		if isPublishedDir(fd, name, st) {
			return alloc.ErrSkipDir
		}
		switch st.Mode & syscall.S_IFMT {
		case syscall.S_IFDIR:
			dirs = append(dirs, rel)
		case syscall.S_IFREG:
			p := c.fsys.pulled.get(st.Ino)
			if p == nil || want[rel] {
				return nil
			}
			if err := unix.Unlinkat(fd, name, 0); err != nil {
				return nil
			}
			p.release()
			c.fsys.forgetName(dir + "/" + rel)
		}
		return nil
	})
	return dirs
}

// removeClusterDir removes the directory rel below the directory open at
// top if it is empty and the cluster's (clusterDir), reaching it without
// following a symbolic link.
func removeClusterDir(top int, rel string) error {
	parent, err := openBeneath(top, path.Dir(rel))
	if err != nil {
		return err
	}
	defer unix.Close(parent)
	fd, err := unix.Openat(parent, path.Base(rel), unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	own, err := clusterDir(fd)
	unix.Close(fd)
	if err == nil && !own {
		err = fmt.Errorf("%w: %s is a local directory", syscall.EPERM, alloc.EscapeText(rel))
	}
	if err != nil {
		return err
	}
	return unix.Unlinkat(parent, path.Base(rel), unix.AT_REMOVEDIR)
}

// forgetName tells the kernel, and go-fuse's tree, that the name at rel
// (relative to the root) no longer names what it named: an object a
// process holds open becomes nameless, as an unlinked file does.
func (fsys *filesystem) forgetName(rel string) {
	dir := fsys.root.EmbeddedInode()
	parts := strings.Split(rel, "/")
	for _, part := range parts[:len(parts)-1] {
		if dir = dir.GetChild(part); dir == nil {
			return
		}
	}
	name := parts[len(parts)-1]
	if ch := dir.GetChild(name); ch != nil {
		dir.RmChild(name)
		dir.NotifyDelete(name, ch)
		return
	}
	dir.NotifyEntry(name)
}

// clusterAttr is user.tensorfs.cluster of a published directory, for
// who: its version, publisher and time, how many of its segments and
// bytes are complete here, the progress of a "tensorfs pull" of it, and
// the names this node left alone (those who may see). A local directory
// at a published directory's path that was left alone shows its version
// and that conflict. Segments are counted, as rbytes counts them, in the
// directories who may list, and a uid's walks run one at a time
// (usageWalks).
func (fsys *filesystem) clusterAttr(who ctl.Cred, d *dirNode) ([]byte, error) {
	var out struct {
		dirRecord
		Segments  int64             `json:"segments"`
		Complete  int64             `json:"complete"`
		Bytes     int64             `json:"bytes"`
		Local     int64             `json:"local_bytes"`
		Pull      *cluster.Progress `json:"pull,omitempty"`
		Conflicts []string          `json:"conflicts,omitempty"`
	}
	left := fsys.conflictsAt(d.Path(nil))
	out.dirRecord = left.dirRecord
	for _, p := range left.paths {
		if (controlBackend{fsys}).visible(who, p) {
			out.Conflicts = append(out.Conflicts, p)
		}
	}
	err := d.withDir(func(fd int) error {
		rec, err := alloc.ReadPublished(alloc.FdPath(fd))
		if err != nil {
			return err
		}
		if rec == nil {
			if left.paths != nil {
				return nil
			}
			return alloc.ErrNoAttr
		}
		if err := json.Unmarshal(rec, &out.dirRecord); err != nil {
			return fmt.Errorf("%w: the directory's published version %q", alloc.ErrInvalid, rec)
		}
		defer fsys.usageWalks.lock(who.Uid)()
		return fsys.walkFor(who.Uid, fd, func(dfd int, name, _ string, st *unix.Stat_t) error {
			if st.Mode&syscall.S_IFMT == syscall.S_IFDIR && !permitted(&who, st, 4|1) {
				return alloc.ErrSkipDir
			}
			if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
				return nil
			}
			p := fsys.pulled.get(st.Ino)
			if p == nil {
				return nil
			}
			size, complete := p.state()
			out.Segments++
			out.Bytes += size
			if complete {
				out.Complete++
				out.Local += size
			}
			return nil
		})
	})
	if err != nil {
		return nil, err
	}
	if c := fsys.cl; c != nil {
		c.mu.Lock()
		pl := c.pulls[d.Path(nil)]
		c.mu.Unlock()
		if pl != nil {
			pr := pl.Progress()
			out.Pull = &pr
		}
	}
	return json.Marshal(out)
}

// conflictsAt returns the names of the published directory dir that
// this node left alone, if any.
func (fsys *filesystem) conflictsAt(dir string) conflicts {
	c := fsys.cl
	if c == nil {
		return conflicts{}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.conflicts[dir]
}

// visible reports whether who may look the object at rel up (search
// permission on every directory on the way), as on tmpfs: a conflict
// is shown only to those who could see the object left alone.
func (b controlBackend) visible(who ctl.Cred, rel string) bool {
	return b.walk(who, rel, func(dirfd int, name string) error {
		var st unix.Stat_t
		return unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
	}) == nil
}

// clusterAttrs lists user.tensorfs.cluster for a published directory,
// and for a local one at a published path that was left alone; a mount
// with no cluster and no pulled segment has none to look for.
func (fsys *filesystem) clusterAttrs(d *dirNode) []string {
	if fsys.cl == nil && fsys.pulled.n.Load() == 0 {
		return nil
	}
	if fsys.conflictsAt(d.Path(nil)).paths != nil {
		return []string{alloc.AttrCluster}
	}
	var names []string
	d.withDir(func(fd int) error {
		if rec, err := alloc.ReadPublished(alloc.FdPath(fd)); err == nil && rec != nil {
			names = append(names, alloc.AttrCluster)
		}
		return nil
	})
	return names
}

// clusterStats is the "cluster" member of user.tensorfs.stats: this
// node's name and piece server, whether it is joined (and why not), and
// what it has moved since it joined; nil without a cluster.
func (fsys *filesystem) clusterStats() map[string]any {
	if fsys.cl == nil {
		return nil
	}
	n := fsys.cl.node
	st := n.Stats()
	m := map[string]any{"node": n.Name(), "addr": n.Addr(), "joined": true, "pulled_segments": fsys.pulled.n.Load(),
		"pieces_served": st.PiecesServed, "bytes_served": st.BytesServed, "pieces_fetched": st.PiecesFetched,
		"bytes_fetched": st.BytesFetched, "bad_pieces": st.BadPieces, "failed_fetches": st.FailedFetches}
	if err := n.Joined(); err != nil {
		m["joined"], m["not_joined"] = false, err.Error()
	}
	return m
}

// maxOpenDirs bounds the directories a version being made keeps open.
const maxOpenDirs = 64

// errNotMade is dirCache.get's answer for a directory of the version that
// was not made (a conflict, or a failure already reported).
var errNotMade = errors.New("directory not made")

// dirCache is the directories of a version being made (materialize): the
// inode of each made or found, by path in the published directory, and
// at most maxOpenDirs of them open (O_PATH), the most recently used; the
// others are reopened below the published directory when needed, without
// following a symbolic link, and must still be the inode made.
type dirCache struct {
	top  int               // the published directory, "."; its caller's
	inos map[string]uint64 // every directory made or found
	open map[string]int    // the open ones
	lru  []string          // the open ones' paths, least recently used first
}

// newDirCache returns the cache of the published directory open at top.
func newDirCache(top int) *dirCache {
	return &dirCache{top: top, inos: map[string]uint64{}, open: map[string]int{}}
}

// put records the directory rel, open at fd (which the cache now owns).
func (d *dirCache) put(rel string, fd int) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return err
	}
	d.inos[rel] = st.Ino
	d.keep(rel, fd)
	return nil
}

// keep adds fd, open at rel, to the open ones, closing the least recently
// used past maxOpenDirs.
func (d *dirCache) keep(rel string, fd int) {
	d.open[rel] = fd
	d.lru = append(d.lru, rel)
	if len(d.lru) > maxOpenDirs {
		unix.Close(d.open[d.lru[0]])
		delete(d.open, d.lru[0])
		d.lru = d.lru[1:]
	}
}

// get returns a descriptor of the directory rel, valid until the next
// get or put: errNotMade if it was not made, ESTALE if another object is
// at its path now.
func (d *dirCache) get(rel string) (int, error) {
	if rel == "." {
		return d.top, nil
	}
	if fd, ok := d.open[rel]; ok {
		i := slices.Index(d.lru, rel)
		d.lru = append(slices.Delete(d.lru, i, i+1), rel)
		return fd, nil
	}
	ino, ok := d.inos[rel]
	if !ok {
		return -1, errNotMade
	}
	fd, err := reopenDir(d.top, rel, ino)
	if err != nil {
		return -1, err
	}
	d.keep(rel, fd)
	return fd, nil
}

// close closes the open directories.
func (d *dirCache) close() {
	for _, fd := range d.open {
		unix.Close(fd)
	}
}

// reopenDir opens (O_PATH) the directory rel below the directory open at
// top, without following a symbolic link or leaving top, if it is still
// the inode ino: ESTALE if another object is there now.
func reopenDir(top int, rel string, ino uint64) (int, error) {
	fd, err := openBeneath(top, rel)
	if err != nil {
		return -1, err
	}
	var st unix.Stat_t
	if err = unix.Fstat(fd, &st); err == nil && st.Ino != ino {
		err = fmt.Errorf("%w: replaced since it was made", unix.ESTALE)
	}
	if err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}
