package fs

// Published directories that leave this node (DESIGN.md §10): one a
// user removed here (rm -r), which stays removed here until a new
// version is published, and one unpublished, which every node removes.

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/cluster"
	"tensorfs/ctl"
)

// removedRecord is what the backing's root records of a published
// directory removed here: its path and the version removed, charged to
// its publisher (one inode of the node's cluster row) until it is
// forgotten.
type removedRecord struct {
	Dir     string `json:"dir"`
	Version string `json:"version"`
	UID     uint32 `json:"uid"`
}

// removedKey is the attribute key of dir's removedRecord.
func removedKey(dir string) string {
	sum := sha256.Sum256([]byte(dir))
	return hex.EncodeToString(sum[:16])
}

// loadRemoved reads the removed-here records of the backing and charges
// each to its publisher, whatever the bounds (as recount does); one of a
// directory the backing holds a version of again is stale, and goes.
// recount has run.
func (c *clusterFS) loadRemoved() {
	recs, err := alloc.ReadRemoved(alloc.FdPath(c.fsys.store.RootFd))
	if err != nil {
		c.fsys.log.Warn("cluster: the records of published directories removed here are not readable; they may be made again", "err", err)
		return
	}
	for key, b := range recs {
		var r removedRecord
		if json.Unmarshal(b, &r) != nil || cluster.CheckDir(r.Dir) != nil || removedKey(r.Dir) != key {
			c.fsys.log.Warn("cluster: dropping a corrupt record of a directory removed here", "key", key)
			alloc.UnmarkRemoved(alloc.FdPath(c.fsys.store.RootFd), key)
			continue
		}
		if _, ok := c.charges[r.Dir]; ok {
			alloc.UnmarkRemoved(alloc.FdPath(c.fsys.store.RootFd), key)
			continue
		}
		c.removed[r.Dir] = r
		if c.madePathHere(r.Dir) { // as removedHere keeps it
			c.mu.Lock()
			c.placed[r.Dir] = true
			c.mu.Unlock()
		}
		ch := newCharge(r.Dir, r.UID, 1, 0)
		c.charges[r.Dir] = ch
		c.bounds.inodes.Add(ch.uid, ch.inodes)
	}
}

// knownDirs returns the published directories this node holds or removed:
// the watch reports those unpublished meanwhile.
func (c *clusterFS) knownDirs() []string {
	c.nsMu.Lock()
	defer c.nsMu.Unlock()
	var dirs []string
	for dir := range c.charges {
		dirs = append(dirs, dir)
	}
	return dirs
}

// publishedAt returns the version record of the directory name in the
// directory open at fd if it is a published directory, nil otherwise or
// without a cluster.
func (fsys *filesystem) publishedAt(fd int, name string) *dirRecord {
	if fsys.cl == nil {
		return nil
	}
	dfd, err := unix.Openat(fd, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil
	}
	defer unix.Close(dfd)
	var rec dirRecord
	b, err := alloc.ReadPublished(alloc.FdPath(dfd))
	if err != nil || b == nil || json.Unmarshal(b, &rec) != nil || rec.Version == "" {
		return nil
	}
	return &rec
}

// removedHere records, off the request that removed it, that the
// published directory whose version record was rec was removed on this
// node, at the path at: its version is not made here again, and what it
// was charged is given back. The record names the directory as published
// (rec.Dir), whatever it was moved to; at only where rec is older than
// that. One made again meanwhile (by a pull) is not removed.
func (c *clusterFS) removedHere(at string, rec *dirRecord) {
	if c.ctx.Err() != nil {
		return
	}
	dir := rec.Dir
	if dir == "" {
		dir = at
	}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		c.nsMu.Lock()
		defer c.nsMu.Unlock()
		if fd, err := openBeneath(c.fsys.store.RootFd, dir); err == nil {
			unix.Close(fd)
			return
		}
		// Directories made on its path for it stay (a rm -r may be
		// removing them now), charged with the record (below) and renamed
		// by no one (clusterStays, placed) until its version goes, which
		// removes them (withdraw): moved, nothing would find them again.
		c.forgetMadeLocked(dir, c.madePathHere(dir))
		r := removedRecord{Dir: dir, Version: rec.Version, UID: rec.UID}
		err := c.chargeLocked(dir, newCharge(r.Dir, r.UID, 1, 0))
		if err == nil {
			b, _ := json.Marshal(r)
			err = alloc.MarkRemoved(alloc.FdPath(c.fsys.store.RootFd), removedKey(dir), b)
		}
		if err != nil {
			c.chargeLocked(dir, charge{})
			c.fsys.log.Warn("cluster: a published directory removed here is not recorded; it is made again at the next mount", "dir", alloc.EscapeText(dir), "version", r.Version, "err", err)
			return
		}
		c.removed[dir] = r
		c.fsys.log.Info("cluster: published directory removed here; its version is not made here again", "dir", alloc.EscapeText(dir), "version", r.Version, "uid", r.UID)
	}()
}

// placedBelow reports whether a published directory made here (or
// being made) lies below the directory rel, a path in the mount.
func (c *clusterFS) placedBelow(rel string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for dir := range c.placed {
		if strings.HasPrefix(dir, rel+"/") {
			return true
		}
	}
	return false
}

// forgetMadeLocked forgets what this node knew of the version of dir it
// made, keeping dir placed (its path renamed by no one) if keepPlaced.
// nsMu is held.
func (c *clusterFS) forgetMadeLocked(dir string, keepPlaced bool) {
	c.mu.Lock()
	delete(c.made, dir)
	delete(c.tried, dir)
	if !keepPlaced {
		delete(c.placed, dir)
	}
	delete(c.conflicts, dir)
	c.mu.Unlock()
}

// skipRemovedLocked reports whether version vid of dir was removed here
// (it is not made again); a record of another version is forgotten, as
// that version is new. nsMu is held.
func (c *clusterFS) skipRemovedLocked(dir, vid string) bool {
	r, ok := c.removed[dir]
	if !ok {
		return false
	}
	if r.Version == vid {
		return true
	}
	c.forgetRemovedLocked(dir)
	return false
}

// forgetRemovedLocked forgets that dir was removed here; its charge
// stays for the caller to replace. nsMu is held.
func (c *clusterFS) forgetRemovedLocked(dir string) {
	if _, ok := c.removed[dir]; !ok {
		return
	}
	if err := alloc.UnmarkRemoved(alloc.FdPath(c.fsys.store.RootFd), removedKey(dir)); err != nil {
		c.fsys.log.Warn("cluster: the record of a directory removed here stays", "dir", alloc.EscapeText(dir), "err", err)
	}
	delete(c.removed, dir)
}

// withdraw removes the published directory dir, unpublished, from this
// node: its pulled segments (an open one keeps its bytes for whoever
// holds it), then the directories the cluster made for it, once empty,
// the published directory itself and those made on its path for it. A
// local object below (a user's, made at a name the cluster did not
// take) is left alone, with the directories that hold it, which are no
// longer published. What dir was charged, and any removed-here record,
// are given back. A directory published from this node whose deletion
// was missed (found missing in etcd, not seen unpublished) stays as it
// is, logged: etcd may have lost it, and it may be the only copy.
func (c *clusterFS) withdraw(dir string, missed bool) {
	c.nsMu.Lock()
	defer c.nsMu.Unlock()
	if missed && c.publishedHere(dir) {
		c.fsys.log.Warn("cluster: a directory published from this node is missing from the cluster's namespace; it stays here as it is (remove it, or publish it again)", "dir", alloc.EscapeText(dir))
		return
	}
	c.forgetRemovedLocked(dir)
	c.chargeLocked(dir, charge{})
	c.forgetMadeLocked(dir, false)
	top, err := openBeneath(c.fsys.store.RootFd, dir)
	if err != nil {
		if !errors.Is(err, unix.ENOENT) {
			c.fsys.log.Warn("cluster: an unpublished directory is not reachable here; it stays", "dir", alloc.EscapeText(dir), "err", err)
		} else {
			c.removeMadePath(dir) // removed here before: what was made on its path for it goes now
		}
		return
	}
	defer unix.Close(top)
	if own, err := clusterDir(top); err != nil || !own {
		return // a local directory at its name was left alone, and stays
	}
	dirs := c.removePulled(top, dir, map[string]bool{})
	slices.Sort(dirs)
	for i := len(dirs) - 1; i >= 0; i-- { // deepest first
		if removeClusterDir(top, dirs[i]) == nil {
			c.fsys.forgetName(dir + "/" + dirs[i])
		}
	}
	if err := removeClusterDir(c.fsys.store.RootFd, dir); err != nil {
		c.fsys.log.Info("cluster: an unpublished directory holds local names; they stay, in a directory no longer published", "dir", alloc.EscapeText(dir), "err", err)
		if err := alloc.UnmarkPublished(alloc.FdPath(top)); err != nil {
			c.fsys.log.Warn("cluster: an unpublished directory keeps its version record", "dir", alloc.EscapeText(dir), "err", err)
		}
		return
	}
	c.fsys.forgetName(dir)
	c.removeMadePath(dir)
	c.fsys.log.Info("cluster: unpublished directory removed here", "dir", alloc.EscapeText(dir))
}

// madePathHere reports whether this node made the directory above the
// published directory dir for it.
func (c *clusterFS) madePathHere(dir string) bool {
	p := path.Dir(dir)
	return p != "." && c.madeFor(p, dir)
}

// removeMadePath removes the directories this node made on the path to
// the published directory dir for it (alloc.MarkMade names dir), from the
// deepest up, once empty: dir itself is gone. nsMu is held.
func (c *clusterFS) removeMadePath(dir string) {
	for p := path.Dir(dir); p != "." && c.madeFor(p, dir); p = path.Dir(p) {
		if removeClusterDir(c.fsys.store.RootFd, p) != nil {
			return
		}
		c.fsys.forgetName(p)
	}
}

// publishedHere reports whether dir may be a directory published from
// this node: one with a version record that the cluster did not make, or
// one whose marks cannot be read.
func (c *clusterFS) publishedHere(dir string) bool {
	fd, err := openBeneath(c.fsys.store.RootFd, dir)
	if err != nil {
		return !errors.Is(err, unix.ENOENT)
	}
	defer unix.Close(fd)
	made, err := alloc.ReadMade(alloc.FdPath(fd))
	if err != nil || made != "" {
		return err != nil
	}
	rec, err := alloc.ReadPublished(alloc.FdPath(fd))
	return err != nil || rec != nil
}

// madeFor reports whether the directory rel was made for the published
// directory dir, on its path (alloc.MarkMade), and is not published.
func (c *clusterFS) madeFor(rel, dir string) bool {
	fd, err := openBeneath(c.fsys.store.RootFd, rel)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	made, err := alloc.ReadMade(alloc.FdPath(fd))
	rec, err2 := alloc.ReadPublished(alloc.FdPath(fd))
	return err == nil && err2 == nil && made == dir && rec == nil
}

// unpublish withdraws the published directory dir from the cluster for
// who (its publisher's uid or root: EPERM otherwise, naming that uid),
// and from this node at once; every other node removes it as its watch
// reports it.
func (c *clusterFS) unpublish(who ctl.Cred, dir string) error {
	if err := cluster.CheckDir(dir); err != nil {
		return err
	}
	if err := c.node.Unpublish(c.ctx, dir, who.Uid); err != nil {
		return err
	}
	c.withdraw(dir, false)
	return nil
}

// Unpublish serves the control socket's unpublish (clusterFS.unpublish).
func (b controlBackend) Unpublish(cred ctl.Cred, dir string) error {
	if b.fsys.cl == nil {
		return errNoCluster
	}
	if err := b.fsys.cl.unpublish(cred, dir); err != nil {
		return fmt.Errorf("%s: %w", alloc.EscapeText(dir), err)
	}
	return nil
}
