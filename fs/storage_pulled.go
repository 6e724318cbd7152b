package fs

import (
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// pulled is a segment of a published directory (DESIGN.md §10, §11): on
// the node that published it, or made by the daemon on every other node
// from the cluster's namespace and pulled from its peers. Its backing
// file holds its bytes once complete, and its marker (alloc.MarkPulled)
// its content ID, published size and whether it is complete. It is
// read-only through the mount on every node: a published snapshot never
// changes, so writes, truncation and changes to its owner, mode, times
// and attributes are refused. Opening an incomplete one pulls it first
// (cluster.go), and returns once every piece is written and verified;
// from then on it is served as a host segment is.
type pulled struct {
	set *pulledSet
	ino uint64

	mu sync.Mutex
	// cid is its content ID; "" while it is frozen for a publish that
	// has not finished hashing it.
	cid string
	// size is the published size, which stat shows before the bytes come.
	size int64
	// complete is true once the backing file holds every byte, verified.
	complete bool
	// fill is the pull filling it, while one runs.
	fill *fill
}

// fill is one segment's pull: done is closed when it ends, err says why
// it failed; drop, once its pull from the cluster runs, stops it unless
// opens wait for it (openers). The segment's pulled.mu guards drop and
// openers.
type fill struct {
	done    chan struct{}
	err     error
	drop    func()
	openers int
}

// errPublished refuses a change to a published segment.
var errPublished = fmt.Errorf("%w: a published segment is read-only on every node (publish a new version to change it)", alloc.ErrReadOnly)

func (*pulled) kind() alloc.Kind { return alloc.Pulled }

func (*pulled) attrs(m *alloc.Ref, fn func(*alloc.Ref) error) error { return fn(m) }

// overlay is the backing file's stat, with the published size while the
// bytes are still to come.
func (p *pulled) overlay(m *alloc.Ref, st *unix.Stat_t) error {
	if size, complete := p.state(); !complete {
		st.Size = size
	}
	return nil
}

func (p *pulled) open(n *segmentNode, m *alloc.Ref, h handle, flags uint32) (segmentHandle, error) {
	if h.writable || flags&unix.O_TRUNC != 0 {
		return nil, errPublished
	}
	var err error
	if flags&openAdopted != 0 { // a takeover's, outside any request
		err = p.await(m)
	} else {
		n.fs.parked(func() { err = p.await(m) })
	}
	if err != nil {
		return nil, err
	}
	fd, err := m.Open(unix.O_RDONLY)
	if err != nil {
		return nil, err
	}
	_, pt := n.fs.backingFlags(flags)
	return &fileHandle{handle: h, fd: fd, passthrough: pt, attrsHere: true}, nil
}

func (*pulled) resize(*alloc.Ref, int64) error { return errPublished }

func (p *pulled) descriptor(m *alloc.Ref, write bool) (*os.File, error) {
	if write {
		return nil, errPublished
	}
	if err := p.await(m); err != nil {
		return nil, err
	}
	return openFile(m, false)
}

func (*pulled) mapped(m *alloc.Ref) (fileID, uint32, bool) {
	return fileID{m.Stat().Dev, m.Stat().Ino}, anyUID, true
}

func (*pulled) handle(m *alloc.Ref) (string, error) { return os.Readlink(alloc.FdPath(m.Fd())) }

// release forgets the segment, and stops its fill from the cluster if
// one runs (nothing will read what it would write); the cluster stops
// serving its content once no segment of this node has it.
func (p *pulled) release() error {
	p.mu.Lock()
	var drop func()
	if p.fill != nil && p.fill.openers == 0 { // an open of it waits for its bytes
		drop = p.fill.drop
	}
	p.mu.Unlock()
	if drop != nil {
		drop()
	}
	p.set.forget(p)
	return nil
}

// isComplete reports whether the backing file holds every byte.
func (p *pulled) isComplete() bool {
	_, complete := p.state()
	return complete
}

// state returns the published size and whether the segment is complete.
func (p *pulled) state() (int64, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.size, p.complete
}

// content returns the content ID, "" while a publish is hashing it.
func (p *pulled) content() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cid
}

// await returns once the segment is complete: it starts its pull, or
// waits for the one that runs, from the backing file m.
func (p *pulled) await(m *alloc.Ref) error {
	p.mu.Lock()
	complete, f := p.complete, p.fill
	if f != nil {
		f.openers++
	}
	p.mu.Unlock()
	if complete {
		return nil
	}
	if f == nil {
		c := p.set.fsys.cl
		if c == nil {
			return fmt.Errorf("%w: this segment is not pulled yet, and this mount has joined no cluster (mount with --cluster)", errNoCluster)
		}
		fd, err := m.Open(unix.O_RDWR)
		if err != nil {
			return err
		}
		fills, _ := c.fetch([]pullItem{{seg: p, f: os.NewFile(uintptr(fd), "pull"), opener: true}})
		f = fills[0]
	}
	<-f.done
	return f.err
}

// attrsFixed refuses a change to the owner, mode, times or attributes of
// a segment of kind s that is published: they are the published ones.
func attrsFixed(s storage) error {
	if _, ok := s.(*pulled); ok {
		return errPublished
	}
	return nil
}

// pulledSet is the mount's pulled segments by inode: classify takes a
// regular file with bytes for a host segment without reading its marker
// unless its inode is here. It is filled at recovery and whenever a
// segment is published or made from the namespace, and emptied by the
// segments' releases. It also counts, per content, the segments that
// have it, and keeps where the complete ones lie for the cluster to serve
// it from (by path and inode: no descriptor is held per segment); the
// content is dropped from the cluster once none of its files is left.
type pulledSet struct {
	fsys *filesystem
	n    atomic.Int64 // len(segs), read without the lock
	mu   sync.RWMutex
	segs map[uint64]*pulled
	// contents are the contents of the segments, by ID.
	contents map[string]*content
	// fds are the files the cluster reads now.
	fds servedFds
}

// content is what the mount keeps of one content ID.
type content struct {
	segs int // pulled segments with it
	// locs are where complete copies lie that the cluster may serve it
	// from (published, pulled into, recovered), first first.
	locs []loc
	size int64 // its size
	// pulling counts the pulls in flight that fill it.
	pulling int
}

// has reports whether ino is a pulled segment's: no call, and no lock
// while the mount has none.
func (s *pulledSet) has(ino uint64) bool {
	if s.n.Load() == 0 {
		return false
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.segs[ino] != nil
}

// get returns the pulled segment of inode ino, nil if none.
func (s *pulledSet) get(ino uint64) *pulled {
	if s.n.Load() == 0 {
		return nil
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.segs[ino]
}

// classify returns the storage of the backing file st whose marker is mk:
// the pulled segment the set has, or, for one it does not have yet (or
// an inode that was another's), a new one.
func (s *pulledSet) classify(st *unix.Stat_t, mk alloc.Marker) *pulled {
	if p := s.get(st.Ino); p != nil && p.content() == mk.Content {
		return p
	}
	return s.add(st.Ino, mk)
}

// add records the pulled segment of inode ino whose marker is mk, and
// returns it; a segment the set had at ino is forgotten first.
func (s *pulledSet) add(ino uint64, mk alloc.Marker) *pulled {
	p := &pulled{set: s, ino: ino, cid: mk.Content, size: mk.Size, complete: mk.Complete}
	s.mu.Lock()
	if old := s.segs[ino]; old != nil {
		s.forgetLocked(old)
	}
	if s.segs == nil {
		s.segs, s.contents = map[uint64]*pulled{}, map[string]*content{}
	}
	s.segs[ino] = p
	s.n.Store(int64(len(s.segs)))
	if p.cid != "" {
		s.contentLocked(p.cid).segs++
	}
	s.mu.Unlock()
	return p
}

// forget removes p from the set.
func (s *pulledSet) forget(p *pulled) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.segs[p.ino] == p {
		s.forgetLocked(p)
	}
}

func (s *pulledSet) forgetLocked(p *pulled) {
	delete(s.segs, p.ino)
	s.n.Store(int64(len(s.segs)))
	if cid := p.content(); cid != "" {
		c := s.contents[cid]
		c.segs--
		s.unlocateLocked(cid, func(l loc) bool { return l.ino == p.ino })
		if c.segs == 0 && c.pulling == 0 {
			s.unlocateLocked(cid, func(loc) bool { return true })
			delete(s.contents, cid)
		}
	}
}

// identify gives the frozen segment p its content ID and size, once a
// publish has hashed it.
func (s *pulledSet) identify(p *pulled, cid string, size int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p.mu.Lock()
	p.cid, p.size = cid, size
	p.mu.Unlock()
	if s.segs[p.ino] == p {
		s.contentLocked(cid).segs++
	}
}

// contentLocked returns the entry of content cid, made if need be.
func (s *pulledSet) contentLocked(cid string) *content {
	c := s.contents[cid]
	if c == nil {
		c = &content{}
		s.contents[cid] = c
	}
	return c
}

// serveFrom records that a complete copy of content cid (size bytes)
// lies at l, and has the cluster, if it holds the content, read it from
// the mount's copies from then on (not from a file a pull or publish
// handed it). A content no segment has any more is dropped instead.
func (s *pulledSet) serveFrom(cid string, l loc, size int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	cl := s.fsys.cl
	c := s.contents[cid]
	if c == nil || c.segs == 0 {
		if cl != nil {
			cl.node.Drop(cid)
		}
		return
	}
	if !slices.Contains(c.locs, l) {
		c.locs = append(c.locs, l)
	}
	c.size = size
	if cl != nil {
		cl.node.Serve(cid, s.source(cid))
	}
}

// pulling counts a pull of content cid in (delta 1) or out (-1).
func (s *pulledSet) pulling(cid string, delta int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.contentLocked(cid)
	if c.pulling += delta; c.segs == 0 && c.pulling == 0 {
		s.unlocateLocked(cid, func(loc) bool { return true })
		delete(s.contents, cid)
	}
}

// unlocateLocked forgets the locations of content cid that match, and
// closes their files; once none is left (and no pull fills it), the
// cluster serves the content no more.
func (s *pulledSet) unlocateLocked(cid string, match func(loc) bool) {
	c := s.contents[cid]
	had := len(c.locs)
	c.locs = slices.DeleteFunc(c.locs, func(l loc) bool {
		if match(l) {
			s.fds.forget(l)
			return true
		}
		return false
	})
	if had > 0 && len(c.locs) == 0 && c.pulling == 0 {
		if cl := s.fsys.cl; cl != nil {
			cl.node.Drop(cid)
		}
	}
}

// source returns what the cluster reads content cid from.
func (s *pulledSet) source(cid string) contentSource {
	return contentSource{s: s, cid: cid}
}

// contentSource reads a content from a complete copy of it on this
// mount: the first of its locations that opens.
type contentSource struct {
	s   *pulledSet
	cid string
}

func (r contentSource) ReadAt(b []byte, off int64) (int, error) {
	e, err := r.s.open(r.cid)
	if err != nil {
		return 0, err
	}
	defer r.s.fds.release(e)
	return e.f.ReadAt(b, off)
}

// open returns a file holding content cid, open read-only, from the
// cache: the first of its locations that opens, checked to be the inode
// recorded. A location the segment left (removed, renamed, replaced) is
// forgotten and logged: its copy is served no more. errNoLocal when no
// location is left.
func (s *pulledSet) open(cid string) (*servedFd, error) {
	for {
		s.mu.RLock()
		var l loc
		c := s.contents[cid]
		ok := c != nil && len(c.locs) > 0
		if ok {
			l = c.locs[0]
		}
		s.mu.RUnlock()
		if !ok {
			return nil, errNoLocal
		}
		e, err := s.fds.acquire(l)
		if !moved(err) {
			return e, err
		}
		s.fsys.log.Info("cluster: a segment left the path it was published or pulled at; its copy is served no more", "path", alloc.EscapeText(l.rel), "content", cid, "err", err)
		s.unlocate(cid, l)
	}
}

// unlocate forgets location l of content cid.
func (s *pulledSet) unlocate(cid string, l loc) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.contents[cid] != nil {
		s.unlocateLocked(cid, func(x loc) bool { return x == l })
	}
}

// located reports whether the mount has a copy of content cid to copy
// locally.
func (s *pulledSet) located(cid string) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	c := s.contents[cid]
	return c != nil && len(c.locs) > 0
}

// distrust stops serving and copying content cid from l, whose bytes
// failed verification: l is forgotten, and the cluster serves cid no more
// (its pieces are verified as they are served, and this node may hold no
// good copy).
func (s *pulledSet) distrust(cid string, l loc) {
	s.unlocate(cid, l)
	if cl := s.fsys.cl; cl != nil {
		cl.node.Drop(cid)
	}
}

// served returns the size of each content the cluster may serve.
func (s *pulledSet) served() map[string]int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	sizes := map[string]int64{}
	for cid, c := range s.contents {
		if len(c.locs) > 0 {
			sizes[cid] = c.size
		}
	}
	return sizes
}

// restore adds the pulled segments recovery found, and, if serve is set
// (the mount joins a cluster), the locations of complete ones for the
// cluster to serve from.
func (s *pulledSet) restore(found []alloc.PulledFile, serve bool) {
	for _, pf := range found {
		s.add(pf.Ino, pf.Marker)
		if serve && pf.Path != "" && pf.Marker.Content != "" {
			s.serveFrom(pf.Marker.Content, loc{pf.Path, pf.Ino}, pf.Marker.Size)
		}
	}
}
