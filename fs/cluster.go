package fs

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
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
}

// joinCluster makes the mount a node of the cluster cfg names (the
// piece server listens from now on; etcd is reached in the background).
func (fsys *filesystem) joinCluster(cfg cluster.Config) error {
	if cfg.Log == nil {
		cfg.Log = fsys.log
	}
	node, err := cluster.Join(cfg)
	if err != nil {
		return err
	}
	c := &clusterFS{fsys: fsys, node: node, known: map[string]*cluster.Content{}, busy: map[string]*leader{}, pulls: map[string]*cluster.Pull{}, made: map[string]*cluster.Version{}}
	c.ctx, c.stop = context.WithCancel(context.Background())
	fsys.cl = c
	return nil
}

// start serves the complete pulled segments recovery found and makes the
// published directories as they are and as they change, until close.
func (c *clusterFS) start() {
	for cid, f := range c.fsys.pulled.servedFiles() {
		var st unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &st); err == nil {
			c.node.Offer(cid, f, st.Size)
		}
	}
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
	c.fsys.pulled.closeAll()
}

// watch makes each published directory's versions as they arrive.
func (c *clusterFS) watch() {
	for ev := range c.node.Watch(c.ctx) {
		if ev.Deleted {
			c.fsys.log.Info("cluster: directory unpublished; its names stay as they are", "dir", alloc.EscapeText(ev.Dir))
			continue
		}
		for c.ctx.Err() == nil {
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
			case <-time.After(time.Second):
			case <-c.ctx.Done():
			}
		}
	}
}

// dirRecord is what a published directory's backing directory records
// of its version (alloc.MarkPublished), and user.tensorfs.cluster shows.
type dirRecord struct {
	Version   string    `json:"version"`
	Publisher string    `json:"publisher"`
	Time      time.Time `json:"time"`
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
	c.mu.Lock()
	maps.Copy(c.known, v.Contents)
	prev := c.made[info.Dir]
	c.mu.Unlock()
	c.nsMu.Lock()
	defer c.nsMu.Unlock()
	top, err := c.openPath(info.Dir, true)
	if err != nil {
		return err
	}
	dirs := map[string]int{".": top}
	defer func() {
		for _, fd := range dirs {
			unix.Close(fd)
		}
	}()
	want := map[string]bool{}
	var failed error
	for i := range v.Entries {
		e := &v.Entries[i]
		want[e.Path] = true
		if e.Path == "." {
			continue
		}
		pfd, ok := dirs[path.Dir(e.Path)]
		if !ok {
			continue // its directory could not be made
		}
		rel := info.Dir + "/" + e.Path
		if e.IsDir() {
			fd, err := c.makeDir(pfd, path.Base(e.Path), rel)
			if err != nil {
				failed = cmpErr(failed, err)
				continue
			}
			dirs[e.Path] = fd
			continue
		}
		if err := c.makeFile(pfd, path.Base(e.Path), rel, e); err != nil {
			failed = cmpErr(failed, err)
		}
	}
	c.removeStale(top, info.Dir, want, prev)
	// Directories' attributes last, deepest first: their times change
	// while their names are made.
	for i := len(v.Entries) - 1; i >= 0; i-- {
		e := &v.Entries[i]
		if fd, ok := dirs[e.Path]; ok && e.IsDir() {
			if err := applyEntry(alloc.FdPath(fd), e); err != nil {
				failed = cmpErr(failed, fmt.Errorf("%s: %w", alloc.EscapeText(info.Dir+"/"+e.Path), err))
			}
		}
	}
	rec, _ := json.Marshal(dirRecord{Version: v.ID, Publisher: info.Publisher, Time: info.Time})
	if err := alloc.MarkPublished(alloc.FdPath(top), rec); err != nil {
		failed = cmpErr(failed, err)
	}
	c.mu.Lock()
	c.made[info.Dir] = v
	c.mu.Unlock()
	if failed == nil {
		c.fsys.log.Info("cluster: version made here", "dir", alloc.EscapeText(info.Dir), "version", v.ID, "publisher", info.Publisher, "entries", len(v.Entries))
	}
	return failed
}

// cmpErr keeps the first error.
func cmpErr(first, err error) error {
	if first != nil {
		return first
	}
	return err
}

// openPath opens the backing directory at rel (a clean relative path)
// below the root, one component at a time without following a symbolic
// link, making missing ones (root's, mode 0755) if create is set. It
// returns an O_PATH descriptor.
func (c *clusterFS) openPath(rel string, create bool) (int, error) {
	fd, err := unix.FcntlInt(uintptr(c.fsys.store.RootFd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	done := ""
	for _, part := range strings.Split(rel, "/") {
		if part == "" || part == "." || part == ".." {
			unix.Close(fd)
			return -1, fmt.Errorf("%w: %q is not a clean relative path", alloc.ErrInvalid, rel)
		}
		done = path.Join(done, part)
		if create {
			if err := unix.Mkdirat(fd, part, 0o755); err == nil {
				c.fsys.notifyNewName(done)
			} else if !errors.Is(err, unix.EEXIST) {
				unix.Close(fd)
				return -1, fmt.Errorf("%s: %w", alloc.EscapeText(done), err)
			}
		}
		next, err := unix.Openat(fd, part, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			return -1, fmt.Errorf("%s is not a directory of the backing: %w", alloc.EscapeText(done), err)
		}
		fd = next
	}
	return fd, nil
}

// makeDir makes (or finds) the directory name in dirfd, rel in the
// mount, and returns its O_PATH descriptor.
func (c *clusterFS) makeDir(dirfd int, name, rel string) (int, error) {
	err := unix.Mkdirat(dirfd, name, 0o700) // its mode comes with its attributes
	if err == nil {
		c.fsys.notifyNewName(rel)
	} else if !errors.Is(err, unix.EEXIST) {
		return -1, fmt.Errorf("%s: %w", alloc.EscapeText(rel), err)
	}
	fd, err := unix.Openat(dirfd, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("%s: a published directory, here another object: %w", alloc.EscapeText(rel), err)
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
		c.fsys.log.Warn("cluster: a published file's name holds another object here; left alone", "path", alloc.EscapeText(rel))
		return nil
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
			c.fsys.log.Warn("cluster: a local segment has a published file's name here; it is left alone", "path", alloc.EscapeText(rel))
			return nil
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
// if unknown) that it has not, once they are empty.
func (c *clusterFS) removeStale(top int, dir string, want map[string]bool, prev *cluster.Version) {
	var gone []string
	if prev != nil {
		for _, e := range prev.Entries {
			if e.IsDir() && !want[e.Path] {
				gone = append(gone, e.Path)
			}
		}
	}
	alloc.Walk(top, func(fd int, name, rel string, st *unix.Stat_t) error {
		if want[rel] {
			return nil
		}
		switch st.Mode & syscall.S_IFMT {
		case syscall.S_IFREG:
			p := c.fsys.pulled.get(st.Ino)
			if p == nil {
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
	slices.Sort(gone)
	for i := len(gone) - 1; i >= 0; i-- { // deepest first
		if unix.Unlinkat(top, gone[i], unix.AT_REMOVEDIR) == nil {
			c.fsys.forgetName(dir + "/" + gone[i])
		}
	}
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

// pullItem is one pulled segment to fill, and its backing file open
// read-write (which the pull owns from then on).
type pullItem struct {
	seg *pulled
	f   *os.File
	// cid, size and mtime are the segment's content, size and published
	// modification time, taken when its fill begins.
	cid   string
	size  int64
	mtime unix.Timespec
}

// leader is a content being pulled into one segment's file; the other
// segments of this mount with that content copy it once it is complete.
type leader struct {
	followers []pullItem
}

// fetch fills the incomplete segments of items from the cluster, each
// unless a pull fills it already (whose fill it joins): segments whose
// content this mount has complete are copied from it, the others are
// pulled, each content once. It returns, once the pull has started, the
// fill of each item, and the pull (nil if none started).
func (c *clusterFS) fetch(items []pullItem) ([]*fill, *cluster.Pull) {
	fills := make([]*fill, len(items))
	var jobs, copies []pullItem
	c.mu.Lock()
	for i, it := range items {
		fills[i] = it.begin()
		if fills[i] != nil {
			it.f.Close()
			continue
		}
		fills[i] = it.seg.fill
		var st unix.Stat_t
		unix.Fstat(int(it.f.Fd()), &st)
		it.mtime = st.Mtim
		switch l := c.busy[it.cid]; {
		case l != nil:
			l.followers = append(l.followers, it)
		case c.fsys.pulled.servedFile(it.cid) != nil:
			copies = append(copies, it)
		default:
			c.busy[it.cid] = &leader{}
			jobs = append(jobs, it)
		}
	}
	c.mu.Unlock()
	for _, it := range copies {
		c.finish(it, c.copyLocal(it, c.fsys.pulled.servedFile(it.cid)))
	}
	if len(jobs) == 0 {
		return fills, nil
	}
	return fills, c.pull(jobs)
}

// begin starts the fill of it's segment and takes its content and size,
// unless it is complete (a fill that is done) or being filled (that
// fill): nil when the fill starts.
func (it *pullItem) begin() *fill {
	p := it.seg
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.complete:
		f := &fill{done: make(chan struct{})}
		close(f.done)
		return f
	case p.fill != nil:
		return p.fill
	}
	p.fill = &fill{done: make(chan struct{})}
	it.cid, it.size = p.cid, p.size
	return nil
}

// pull starts pulling jobs, each the leader of its content, and returns
// the pull; each job is finished (with its followers) as it completes.
func (c *clusterFS) pull(jobs []pullItem) *cluster.Pull {
	var cjobs []cluster.Job
	var started []pullItem
	for _, it := range jobs {
		cont, err := c.contentOf(it.cid)
		if err == nil && cont.Size != it.size {
			err = fmt.Errorf("%w: content %.12s has %d bytes, the segment %d", cluster.ErrCorrupt, it.cid, cont.Size, it.size)
		}
		if err == nil {
			err = reserve(it.f, it.size)
		}
		if err != nil {
			c.lead(it, err)
			continue
		}
		c.fsys.pulled.pulling(it.cid, 1)
		cjobs = append(cjobs, cluster.Job{Content: cont, Dst: it.f})
		started = append(started, it)
	}
	if len(started) == 0 {
		return nil
	}
	pl, err := c.node.Pull(c.ctx, cjobs)
	if err != nil {
		for _, it := range started {
			c.lead(it, err)
			c.fsys.pulled.pulling(it.cid, -1)
		}
		return nil
	}
	ended := make(chan struct{})
	var pullErr error
	c.wg.Add(1 + len(started))
	go func() {
		defer c.wg.Done()
		pullErr = pl.Wait()
		close(ended)
	}()
	for i, it := range started {
		go func() {
			defer c.wg.Done()
			var err error
			select {
			case <-pl.Done(i):
			case <-ended:
				select {
				case <-pl.Done(i):
				default:
					err = pullErr
				}
			}
			if err == nil {
				if err = c.complete(it); err != nil {
					c.node.Drop(it.cid) // held whole, but its file is emptied below
				}
			}
			if err == nil {
				c.fsys.pulled.serveFrom(it.cid, it.f) // the cluster serves it from this file
			}
			c.lead(it, err)
			c.fsys.pulled.pulling(it.cid, -1)
		}()
	}
	return pl
}

// lead finishes the leader it of its content with err, then its
// followers: copied from it, or failed with err.
func (c *clusterFS) lead(it pullItem, err error) {
	c.mu.Lock()
	l := c.busy[it.cid]
	delete(c.busy, it.cid)
	c.mu.Unlock()
	if err == nil {
		markDone(it, nil)
	} else {
		c.finish(it, err)
	}
	if l == nil {
		return
	}
	for _, f := range l.followers {
		ferr := err
		if ferr == nil {
			ferr = c.copyLocal(f, it.f)
		}
		c.finish(f, ferr)
	}
}

// finish ends the fill of it with err: on success the segment is
// complete and its file closed; on failure the file is emptied (nothing
// half pulled stays, and its published times are kept) and closed.
func (c *clusterFS) finish(it pullItem, err error) {
	if err != nil {
		it.f.Truncate(0)
		it.restoreTimes()
		c.fsys.log.Warn("cluster: pull failed", "content", it.cid, "err", err)
	}
	it.f.Close()
	markDone(it, err)
}

// restoreTimes gives the segment's file its published times again
// (writing and truncating move them).
func (it pullItem) restoreTimes() error {
	return unix.UtimesNanoAt(unix.AT_FDCWD, alloc.FdPath(int(it.f.Fd())), []unix.Timespec{it.mtime, it.mtime}, 0)
}

// markDone ends the segment's fill with err, complete if err is nil.
func markDone(it pullItem, err error) {
	p := it.seg
	p.mu.Lock()
	f := p.fill
	p.fill = nil
	if err == nil {
		p.complete = true
	}
	p.mu.Unlock()
	if f != nil {
		f.err = err
		close(f.done)
	}
}

// copyLocal fills it from src, a complete copy of its content on this
// node, and marks it complete.
func (c *clusterFS) copyLocal(it pullItem, src *os.File) error {
	if err := reserve(it.f, it.size); err != nil {
		return err
	}
	var off int64
	for off < it.size {
		in, out := off, off
		n, err := unix.CopyFileRange(int(src.Fd()), &in, int(it.f.Fd()), &out, int(min(it.size-off, 1<<30)), 0)
		if err != nil {
			return err
		}
		if n == 0 {
			return fmt.Errorf("%w: the local copy of %.12s ends at byte %d", io.ErrUnexpectedEOF, it.cid, off)
		}
		off += int64(n)
	}
	return c.complete(it)
}

// reserve grows f to size with its pages reserved, so that a full backing
// answers ENOSPC now rather than half way through.
func reserve(f *os.File, size int64) error {
	if err := alloc.Resize(int(f.Fd()), size); err != nil {
		return fmt.Errorf("pulling %d bytes: %w", size, err)
	}
	return nil
}

// complete records that it's file holds its whole content: its
// published times again, then its marker.
func (c *clusterFS) complete(it pullItem) error {
	if err := it.restoreTimes(); err != nil {
		return err
	}
	return alloc.MarkPulled(alloc.FdPath(int(it.f.Fd())), alloc.Marker{Kind: alloc.Pulled, Content: it.cid, Size: it.size, Complete: true})
}

// contentOf returns the published content cid: its size and piece hashes.
func (c *clusterFS) contentOf(cid string) (*cluster.Content, error) {
	c.mu.Lock()
	cont := c.known[cid]
	c.mu.Unlock()
	if cont != nil {
		return cont, nil
	}
	cont, err := c.node.Content(c.ctx, cid)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.known[cid] = cont
	c.mu.Unlock()
	return cont, nil
}

// published is one object of a directory being published.
type published struct {
	entry cluster.LocalEntry
	seg   *pulled // its pulled segment (nil for a directory)
	// frozen is true for a host segment this publish made read-only.
	frozen bool
	node   *segmentNode // its node in the kernel's tree, if any
}

// publish publishes the directory dir (relative to the root) for who:
// every segment and directory below it, with its owner, mode, time and
// attributes, becomes a new version of dir cluster-wide, and its host
// segments become pulled ones here, read-only. who must own dir or may
// write it, and must be able to read and write each host segment (a
// publish freezes it) and read each directory and published segment.
// Refused: segments of other kinds (device, imported, SHARED, one still
// to be pulled), a segment open for writing or with more than one name,
// and objects that are neither segments nor directories. It returns the
// version.
func (c *clusterFS) publish(who ctl.Cred, dir string) (string, error) {
	if err := cluster.CheckDir(dir); err != nil {
		return "", err
	}
	c.nsMu.Lock()
	defer c.nsMu.Unlock()
	var top int
	err := controlBackend{c.fsys}.walk(who, dir, func(parent int, name string) (err error) {
		top, err = unix.Openat(parent, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
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
	if who.Uid != 0 && who.Uid != st.Uid && !permitted(&who, &st, 2|1) {
		return "", fmt.Errorf("%w: publishing a directory needs its ownership or write permission on it", syscall.EACCES)
	}
	objs, err := c.collect(who, top, dir, &st)
	defer func() {
		for _, o := range objs {
			if f, ok := o.entry.Data.(*os.File); ok && f != nil {
				f.Close()
			}
		}
	}()
	if err == nil {
		err = c.freeze(objs, dir)
	}
	if err != nil {
		return "", err
	}
	local := make([]cluster.LocalEntry, len(objs))
	for i, o := range objs {
		local[i] = o.entry
	}
	info, err := c.node.Publish(c.ctx, dir, local)
	var v *cluster.Version
	if err == nil {
		v, err = c.node.Version(c.ctx, info.Version)
	}
	if err != nil {
		c.thaw(objs, dir)
		return "", err
	}
	cids := map[string]string{}
	for _, e := range v.Entries {
		cids[e.Path] = e.Content
	}
	// The cluster reads each content from the first file of its (in the
	// order of their paths, as Publish takes them): those are kept.
	slices.SortFunc(objs, func(a, b published) int { return entryOrder(a.entry.Path, b.entry.Path) })
	seen := map[string]bool{}
	for i := range objs {
		o := &objs[i]
		if o.seg == nil {
			continue
		}
		cid := cids[o.entry.Path]
		if o.frozen {
			p := alloc.FdPath(int(o.entry.Data.(*os.File).Fd()))
			if err := alloc.MarkPulled(p, alloc.Marker{Kind: alloc.Pulled, Content: cid, Size: o.entry.Size, Complete: true}); err != nil {
				c.fsys.log.Error("cluster: a published segment's marker was not written; a restart makes it writable again", "path", alloc.EscapeText(dir+"/"+o.entry.Path), "err", err)
			}
			c.fsys.pulled.identify(o.seg, cid, o.entry.Size)
		}
		if !seen[cid] {
			seen[cid] = true
			c.fsys.pulled.serveFrom(cid, o.entry.Data.(*os.File))
			o.entry.Data = nil
		}
	}
	rec, _ := json.Marshal(dirRecord{Version: info.Version, Publisher: info.Publisher, Time: info.Time})
	if err := alloc.MarkPublished(alloc.FdPath(top), rec); err != nil {
		c.fsys.log.Warn("cluster: the published directory's version is not recorded here", "dir", alloc.EscapeText(dir), "err", err)
	}
	c.mu.Lock()
	maps.Copy(c.known, v.Contents)
	c.made[dir] = v
	c.mu.Unlock()
	c.fsys.log.Info("published", "dir", alloc.EscapeText(dir), "version", info.Version, "entries", len(v.Entries), "bytes", v.Bytes(), "uid", who.Uid)
	return info.Version, nil
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
	err = alloc.Walk(top, func(fd int, name, rel string, st *unix.Stat_t) error {
		where := alloc.EscapeText(dir + "/" + rel)
		switch st.Mode & syscall.S_IFMT {
		case syscall.S_IFDIR:
			if !permitted(&who, st, 4|1) {
				return fmt.Errorf("%w: %s: publishing needs read and search permission on every directory", syscall.EACCES, where)
			}
			var e cluster.Entry
			err := alloc.At(fd, name, st.Ino, func(p string) (err error) {
				e, err = dirEntry(p, rel, st)
				return err
			})
			objs = append(objs, published{entry: cluster.LocalEntry{Entry: e}})
			return err
		case syscall.S_IFREG:
			o, err := c.segmentEntry(who, fd, name, rel, st)
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
// directory) for a publish by who, with its bytes open read-only.
func (c *clusterFS) segmentEntry(who ctl.Cred, fd int, name, rel string, st *unix.Stat_t) (published, error) {
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
	if err := s.stat(m, st); err != nil {
		return o, err
	}
	switch p, _ := s.(*pulled); {
	case s.kind() == alloc.Host:
		if !permitted(&who, st, 4|2) {
			return o, fmt.Errorf("%w: publishing a segment makes it read-only: it needs read and write permission", syscall.EACCES)
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
	l, err := alloc.ReadLayout(path)
	if err != nil {
		return o, err
	}
	e := cluster.Entry{Path: rel, Mode: st.Mode, UID: st.Uid, GID: st.Gid, Mtime: st.Mtim.Nano(), Size: st.Size,
		Dtype: l.Dtype, Shape: l.Shape, Stride: l.Stride, StorageOffset: l.Offset}
	if e.Xattrs, err = userXattrs(path); err != nil {
		return o, err
	}
	rfd, err := m.Open(unix.O_RDONLY)
	if err != nil {
		return o, err
	}
	o.entry = cluster.LocalEntry{Entry: e, Data: os.NewFile(uintptr(rfd), rel)}
	return o, nil
}

// freeze makes the host segments of objs (below dir) read-only before
// they are hashed: each gets a pulled marker without a content ID, joins
// the pulled set, and its node (if the kernel has one) gets the pulled
// storage once no handle has it open for writing. A segment open for
// writing undoes it all.
func (c *clusterFS) freeze(objs []published, dir string) error {
	for i := range objs {
		o := &objs[i]
		if o.seg != nil || o.entry.IsDir() {
			continue
		}
		f := o.entry.Data.(*os.File)
		var st unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &st); err != nil {
			c.thaw(objs, dir)
			return err
		}
		mk := alloc.Marker{Kind: alloc.Pulled, Size: st.Size, Complete: true}
		if err := alloc.MarkPulled(alloc.FdPath(int(f.Fd())), mk); err != nil {
			c.thaw(objs, dir)
			return err
		}
		o.seg, o.frozen = c.fsys.pulled.add(st.Ino, mk), true
		if n := c.fsys.segmentAt(dir + "/" + o.entry.Path); n != nil && n.StableAttr().Ino == st.Ino {
			n.opening.Lock()
			n.mu.Lock()
			writer := slices.ContainsFunc(n.handles, func(h *handle) bool { return h.writable })
			n.mu.Unlock()
			if !writer {
				n.kind.store(o.seg)
				o.node = n
			}
			n.opening.Unlock()
			if writer {
				c.thaw(objs, dir)
				return fmt.Errorf("%w: %s is open for writing; close it, then publish", syscall.EBUSY, alloc.EscapeText(dir+"/"+o.entry.Path))
			}
		}
		// Bytes written before the freeze are what is hashed: the size
		// is read again once no writer is left.
		if err := unix.Fstat(int(f.Fd()), &st); err != nil {
			c.thaw(objs, dir)
			return err
		}
		o.entry.Size = st.Size
	}
	return nil
}

// thaw undoes freeze: the segments it froze are host segments again.
func (c *clusterFS) thaw(objs []published, dir string) {
	for i := range objs {
		o := &objs[i]
		if !o.frozen {
			continue
		}
		if err := alloc.Unmark(alloc.FdPath(int(o.entry.Data.(*os.File).Fd()))); err != nil {
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
	i := fsys.root.EmbeddedInode()
	for _, part := range strings.Split(rel, "/") {
		if i = i.GetChild(part); i == nil {
			return nil
		}
	}
	n, _ := i.Operations().(*segmentNode)
	return n
}

// pullDir pulls, for who, every pulled segment below the directory dir
// that is not complete here, and returns the bytes pulled. who must be
// able to search every directory on the way, read every directory below
// and read every segment pulled.
func (c *clusterFS) pullDir(who ctl.Cred, dir string) (int64, error) {
	var items []pullItem
	var found bool
	err := controlBackend{c.fsys}.walk(who, dir, func(parent int, name string) error {
		top, err := unix.Openat(parent, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(top)
		var st unix.Stat_t
		if err := unix.Fstat(top, &st); err != nil {
			return err
		}
		if !permitted(&who, &st, 4|1) {
			return fmt.Errorf("%w: pulling needs read and search permission on every directory", syscall.EACCES)
		}
		if rec, err := alloc.ReadPublished(alloc.FdPath(top)); err == nil && rec != nil {
			found = true
		}
		return alloc.Walk(top, func(fd int, name, rel string, st *unix.Stat_t) error {
			switch st.Mode & syscall.S_IFMT {
			case syscall.S_IFDIR:
				if !permitted(&who, st, 4|1) {
					return fmt.Errorf("%w: %s: pulling needs read and search permission on every directory", syscall.EACCES, alloc.EscapeText(rel))
				}
			case syscall.S_IFREG:
				if !c.fsys.pulled.has(st.Ino) && st.Size != 0 {
					return nil
				}
				m, err := alloc.OpenRef(fd, name, st.Ino)
				if err != nil {
					return nil // removed or replaced meanwhile
				}
				defer m.Close()
				s, err := c.fsys.classify(m)
				p, ok := s.(*pulled)
				if err != nil || !ok {
					return err
				}
				found = true
				if p.isComplete() {
					return nil
				}
				if !permitted(&who, m.Stat(), 4) {
					return fmt.Errorf("%w: %s: no read permission", syscall.EACCES, alloc.EscapeText(rel))
				}
				rw, err := m.Open(unix.O_RDWR)
				if err != nil {
					return err
				}
				items = append(items, pullItem{seg: p, f: os.NewFile(uintptr(rw), rel)})
			}
			return nil
		})
	})
	if err == nil && !found {
		err = fmt.Errorf("%w: %s has no published segment", cluster.ErrNotPublished, alloc.EscapeText(dir))
	}
	if err != nil {
		for _, it := range items {
			it.f.Close()
		}
		return 0, err
	}
	fills, pl := c.fetch(items)
	if pl != nil {
		c.mu.Lock()
		c.pulls[dir] = pl
		c.mu.Unlock()
		defer func() {
			c.mu.Lock()
			if c.pulls[dir] == pl {
				delete(c.pulls, dir)
			}
			c.mu.Unlock()
		}()
	}
	var bytes int64
	for i, f := range fills {
		<-f.done
		if f.err != nil {
			err = cmpErr(err, f.err)
			continue
		}
		size, _ := items[i].seg.state()
		bytes += size
	}
	if err == nil {
		c.fsys.log.Info("pulled", "dir", alloc.EscapeText(dir), "segments", len(items), "bytes", bytes, "uid", who.Uid)
	}
	return bytes, err
}

// clusterAttr is user.tensorfs.cluster of a published directory: its
// version, publisher and time, how many of its segments and bytes are
// complete here, and the progress of a "tensorfs pull" of it.
func (fsys *filesystem) clusterAttr(d *dirNode) ([]byte, error) {
	var out struct {
		dirRecord
		Segments int64             `json:"segments"`
		Complete int64             `json:"complete"`
		Bytes    int64             `json:"bytes"`
		Local    int64             `json:"local_bytes"`
		Pull     *cluster.Progress `json:"pull,omitempty"`
	}
	err := d.withDir(func(fd int) error {
		rec, err := alloc.ReadPublished(alloc.FdPath(fd))
		if err != nil {
			return err
		}
		if rec == nil {
			return alloc.ErrNoAttr
		}
		if err := json.Unmarshal(rec, &out.dirRecord); err != nil {
			return fmt.Errorf("%w: the directory's published version %q", alloc.ErrInvalid, rec)
		}
		return alloc.Walk(fd, func(dfd int, name, _ string, st *unix.Stat_t) error {
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

// clusterAttrs lists user.tensorfs.cluster for a published directory;
// a mount with no cluster and no pulled segment has none to look for.
func (fsys *filesystem) clusterAttrs(d *dirNode) []string {
	if fsys.cl == nil && fsys.pulled.n.Load() == 0 {
		return nil
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

// clusterStats is the "cluster" member of user.tensorfs.stats: this
// node's name and piece server, and what it has moved since it joined;
// nil without a cluster.
func (fsys *filesystem) clusterStats() map[string]any {
	if fsys.cl == nil {
		return nil
	}
	n := fsys.cl.node
	st := n.Stats()
	return map[string]any{"node": n.Name(), "addr": n.Addr(), "pulled_segments": fsys.pulled.n.Load(),
		"pieces_served": st.PiecesServed, "bytes_served": st.BytesServed, "pieces_fetched": st.PiecesFetched,
		"bytes_fetched": st.BytesFetched, "bad_pieces": st.BadPieces, "failed_fetches": st.FailedFetches}
}
