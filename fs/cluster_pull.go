package fs

// Pulls: the segments of a published directory filled from the cluster,
// straight into their backing files (DESIGN.md §10).

import (
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/cluster"
	"tensorfs/ctl"
)

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
	// led is its content's leader, while it leads it (clusterFS.busy).
	led *leader
	// opener is set where an open waits for the segment (pulled.await).
	opener bool
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
		var started bool
		if fills[i], started = it.begin(); !started {
			it.f.Close()
			continue
		}
		var st unix.Stat_t
		unix.Fstat(int(it.f.Fd()), &st)
		it.mtime = st.Mtim
		switch l := c.busy[it.cid]; {
		case l != nil:
			l.followers = append(l.followers, it)
		case c.fsys.pulled.located(it.cid):
			copies = append(copies, it)
		default:
			it.led = &leader{}
			c.busy[it.cid] = it.led
			jobs = append(jobs, it)
		}
	}
	c.mu.Unlock()
	for _, it := range copies {
		err := c.copyLocal(it)
		if !errors.Is(err, errNoLocal) {
			c.finish(it, err)
			continue
		}
		c.mu.Lock() // pulled from peers instead
		if l := c.busy[it.cid]; l != nil {
			l.followers = append(l.followers, it)
		} else {
			it.led = &leader{}
			c.busy[it.cid] = it.led
			jobs = append(jobs, it)
		}
		c.mu.Unlock()
	}
	if len(jobs) == 0 {
		return fills, nil
	}
	return fills, c.pull(jobs)
}

// begin returns the fill of it's segment: a new one, started, which takes
// the segment's content and size; else the one that fills it, or, for a
// complete segment, one that is done.
func (it *pullItem) begin() (*fill, bool) {
	p := it.seg
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.complete:
		f := &fill{done: make(chan struct{})}
		close(f.done)
		return f, false
	case p.fill != nil:
		if it.opener {
			p.fill.openers++
		}
		return p.fill, false
	}
	p.fill = &fill{done: make(chan struct{})}
	if it.opener {
		p.fill.openers = 1
	}
	it.cid, it.size = p.cid, p.size
	return p.fill, true
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
		it.seg.mu.Lock()
		if it.seg.fill != nil {
			it.seg.fill.drop = func() { c.dropFill(it, pl, i) }
		}
		it.seg.mu.Unlock()
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
			if err == nil && !isDone(pl.Done(i)) {
				// Dropped (dropFill): no longer its content's leader.
				c.finish(it, errDropped)
				c.fsys.pulled.pulling(it.cid, -1)
				return
			}
			if err == nil {
				if err = c.complete(it); err != nil {
					c.node.Drop(it.cid) // held whole, but its file is emptied below
				}
			}
			if err == nil {
				c.serveFilled(it)
			}
			c.lead(it, err)
			c.fsys.pulled.pulling(it.cid, -1)
		}()
	}
	return pl
}

// errDropped ends the fill of a segment released during its pull.
var errDropped = errors.New("the segment was replaced or removed during its pull")

// dropFill stops pulling it, job i of pl, whose segment was released (a
// new version replaced it, or it was removed), unless other segments wait
// for its content: from then on another pull of the content leads it.
func (c *clusterFS) dropFill(it pullItem, pl *cluster.Pull, i int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.busy[it.cid] != it.led || len(it.led.followers) > 0 || !pl.Drop(i) {
		return
	}
	delete(c.busy, it.cid)
	c.fsys.log.Info("cluster: a segment replaced or removed is pulled no more", "content", it.cid)
}

// isDone reports whether ch is closed.
func isDone(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// serveFilled has the cluster serve the content it filled from where its
// segment lies (not from the file the pull wrote), and copy it from there.
func (c *clusterFS) serveFilled(it pullItem) {
	rel, err := c.fsys.store.RelPath(int(it.f.Fd()))
	if err != nil {
		c.fsys.log.Warn("cluster: a pulled segment is not served to peers: where it lies is not known", "content", it.cid, "err", err)
		c.node.Drop(it.cid)
		return
	}
	c.fsys.pulled.serveFrom(it.cid, loc{rel, it.seg.ino}, it.size)
}

// lead finishes the leader it of its content with err, then its
// followers: copied from a copy this mount holds, or failed with err. One
// dropped meanwhile (dropFill) has none.
func (c *clusterFS) lead(it pullItem, err error) {
	c.mu.Lock()
	l := c.busy[it.cid]
	if l == it.led {
		delete(c.busy, it.cid)
	} else {
		l = nil // another pull leads the content now
	}
	c.mu.Unlock()
	c.finish(it, err)
	if l == nil {
		return
	}
	for _, f := range l.followers {
		ferr := err
		if ferr == nil {
			ferr = c.copyLocal(f)
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
		if err != errDropped {
			c.fsys.log.Warn("cluster: pull failed", "content", it.cid, "err", err)
		}
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

// errNoLocal says that this node holds no good copy of a content: it is
// pulled from peers.
var errNoLocal = errors.New("no verified copy of the content here")

// copyLocal fills it from a complete copy of its content on this node
// (errNoLocal if none is left), verifies what it copied against the
// published hashes and marks it complete. A copy that fails verification
// is logged, emptied, and no longer served or copied from (its bytes were
// changed under the node): errNoLocal.
func (c *clusterFS) copyLocal(it pullItem) error {
	e, err := c.fsys.pulled.open(it.cid)
	if err != nil {
		return err
	}
	defer c.fsys.pulled.fds.release(e)
	src := e.f
	cont, err := c.contentOf(it.cid)
	if err != nil {
		return err
	}
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
	if err := cont.Verify(it.f); err != nil {
		c.fsys.log.Warn("cluster: a copy held here fails verification; it is no longer served, and the content is pulled from peers", "content", it.cid, "err", err)
		c.fsys.pulled.distrust(it.cid, e.l)
		it.f.Truncate(0)
		return errNoLocal
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

// pullDir pulls, for who, every pulled segment below the directory dir
// that is not complete here, maxPullOpen at a time, and returns the bytes
// pulled. who must be able to search every directory on the way, read
// every directory below and read every segment pulled, and is charged
// the backing files a batch holds open (EMFILE past its share). A
// directory published that the watch has not made here yet (a pull
// right after a publish elsewhere) is made first. A version made here
// meanwhile at, above or below dir (a publish that raced the pull) is
// pulled too, its segments walked again, and what failed of the one it
// replaced is no failure: the pull ends with dir's current version here.
func (c *clusterFS) pullDir(who ctl.Cred, dir string) (int64, error) {
	var bytes int64
	for round := 1; ; round++ {
		was := c.versionsAt(dir)
		n, err := c.pullOnce(who, dir)
		bytes += n
		now := c.versionsAt(dir)
		if maps.Equal(was, now) {
			if err == nil {
				c.fsys.log.Info("pulled", "dir", alloc.EscapeText(dir), "bytes", bytes, "uid", who.Uid)
			}
			return bytes, err
		}
		if round == maxPullRounds {
			return bytes, fmt.Errorf("%w: %s got a new version in each of %d rounds of its pull; pull it again", unix.EAGAIN, alloc.EscapeText(dir), round)
		}
		c.fsys.log.Info("cluster: a new version was made here during a pull; pulling it", "dir", alloc.EscapeText(dir), "versions", now, "err", err)
	}
}

// maxPullRounds bounds how often a pull walks its directory again for a
// version made here while it ran.
const maxPullRounds = 3

// pullOnce pulls, for who, the pulled segments below dir not complete
// here (pullDir).
func (c *clusterFS) pullOnce(who ctl.Cred, dir string) (int64, error) {
	targets, err := c.madeTargets(who, dir)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, cluster.ErrNotPublished) {
		if err = c.catchUp(dir); err == nil {
			targets, err = c.madeTargets(who, dir)
		}
	}
	if err != nil {
		return 0, err
	}
	return c.pullAll(who, dir, targets)
}

// versionsAt returns the versions made here of the published directories
// at, above or below the directory dir, by directory.
func (c *clusterFS) versionsAt(dir string) map[string]string {
	c.mu.Lock()
	defer c.mu.Unlock()
	at := map[string]string{}
	for d, v := range c.made {
		if d == dir || strings.HasPrefix(d, dir+"/") || strings.HasPrefix(dir, d+"/") {
			at[d] = v.ID
		}
	}
	return at
}

// prefetch pulls, for who, every pulled segment below the directory dir
// that is not complete here, as pullDir does: all at once, from all
// their holders, rather than one segment after the other as a load's
// walk would open them. A directory the walk cannot read, or one without
// published segments, is left for the caller's own walk to answer.
func (c *clusterFS) prefetch(who ctl.Cred, dir string) error {
	targets, err := c.madeTargets(who, dir)
	if err != nil {
		return nil
	}
	_, err = c.pullAll(who, dir, targets)
	return err
}

// pullAll fills the segments targets of the published directory dir,
// maxPullOpen at a time, and returns the bytes filled. who is charged
// the backing files a batch holds open (EMFILE past its share).
func (c *clusterFS) pullAll(who ctl.Cred, dir string, targets []pullTarget) (int64, error) {
	var bytes int64
	for len(targets) > 0 {
		batch := targets[:min(len(targets), maxPullOpen)]
		targets = targets[len(batch):]
		if err := c.fsys.handles.Take(who.Uid, int64(len(batch))); err != nil {
			return bytes, err
		}
		n, err := c.pullBatch(dir, batch)
		c.fsys.handles.Give(who.Uid, int64(len(batch)))
		bytes += n
		if err != nil {
			return bytes, err
		}
	}
	return bytes, nil
}

// catchUp makes the current version of the published directory dir
// here now, unless this node made it already: the watch may not have
// reported it yet. A version removed here, or one this node set out to
// make and did not (a conflict, a refusal: making it again, with its
// whole manifest read, for every pull by anyone, would find the same),
// is ENOENT, saying so.
func (c *clusterFS) catchUp(dir string) error {
	info, err := c.node.Lookup(c.ctx, dir)
	if err != nil {
		return err
	}
	c.nsMu.Lock()
	removed := c.removed[dir].Version == info.Version
	c.nsMu.Unlock()
	if removed {
		return fmt.Errorf("%w: %s was removed on this node (rm -r); a new version of it is made here again", unix.ENOENT, alloc.EscapeText(dir))
	}
	c.mu.Lock()
	made, tried := c.made[dir], c.tried[dir]
	c.mu.Unlock()
	if made != nil && made.ID == info.Version {
		return nil
	}
	if tried == info.Version {
		return fmt.Errorf("%w: this node did not make %s's version %s (the daemon's log says why)", unix.ENOENT, alloc.EscapeText(dir), info.Version)
	}
	v, err := c.node.Version(c.ctx, info.Version)
	if err == nil {
		err = c.materialize(info, v)
	}
	return err
}

// madeTargets is pullTargets once a version that the watch is making
// here is complete (it holds nsMu meanwhile): a pull right after a publish
// read the half-made directory and pulled what was made of it. The walk
// itself holds no nsMu (a user's walk of her directory held every
// publish and version of the node meanwhile); a uid's walks run one at a
// time (usageWalks), as rbytes's do.
func (c *clusterFS) madeTargets(who ctl.Cred, dir string) ([]pullTarget, error) {
	c.nsMu.Lock()
	c.nsMu.Unlock() // the version being made here, if any, is complete
	defer c.fsys.usageWalks.lock(who.Uid)()
	return c.pullTargets(who, dir)
}

// pullTargets returns, for who, the pulled segments below dir that are
// not complete here; ErrNotPublished if dir holds none.
func (c *clusterFS) pullTargets(who ctl.Cred, dir string) ([]pullTarget, error) {
	var targets []pullTarget
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
		return c.fsys.walkFor(who.Uid, top, func(fd int, name, rel string, st *unix.Stat_t) error {
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
				targets = append(targets, pullTarget{p, loc{path.Join(dir, rel), st.Ino}})
			}
			return nil
		})
	})
	if err == nil && !found {
		err = fmt.Errorf("%w: %s has no published segment", cluster.ErrNotPublished, alloc.EscapeText(dir))
	}
	return targets, err
}

// maxPullOpen bounds the backing files one pull holds open at once (one
// per segment being filled): a directory of more segments is pulled that
// many at a time, so that no pull takes the daemon's descriptors.
const maxPullOpen = 256

// pullTarget is a segment a pull is to fill, and where it lies.
type pullTarget struct {
	seg *pulled
	at  loc
}

// pullBatch fills the segments of batch, of the published directory
// dir, from the cluster: each one's backing file is opened read-write,
// found again where the walk saw it (one moved meanwhile is left out), and
// owned by the pull until its fill ends. It returns the bytes filled.
func (c *clusterFS) pullBatch(dir string, batch []pullTarget) (int64, error) {
	items := make([]pullItem, 0, len(batch))
	for _, t := range batch {
		err := refAt(c.fsys.store.RootFd, t.at, func(r *alloc.Ref) error {
			rw, err := r.Open(unix.O_RDWR)
			if err == nil {
				items = append(items, pullItem{seg: t.seg, f: os.NewFile(uintptr(rw), t.at.rel)})
			}
			return err
		})
		if err != nil && !moved(err) {
			for _, it := range items {
				it.f.Close()
			}
			return 0, err
		}
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
	var err error
	for i, f := range fills {
		<-f.done
		if f.err == errDropped {
			continue // no longer below dir: nothing to pull
		}
		if f.err != nil {
			err = cmpErr(err, f.err)
			continue
		}
		size, _ := items[i].seg.state()
		bytes += size
	}
	return bytes, err
}
