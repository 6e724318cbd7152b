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
// it failed.
type fill struct {
	done chan struct{}
	err  error
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
	if err := p.await(m); err != nil {
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

// release forgets the segment; the cluster stops serving its content
// once no segment of this node has it.
func (p *pulled) release() error {
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
		fills, _ := c.fetch([]pullItem{{seg: p, f: os.NewFile(uintptr(fd), "pull")}})
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
// have it and the files the cluster serves it from, which are closed
// (and the content dropped from the cluster) once none has it.
type pulledSet struct {
	fsys *filesystem
	n    atomic.Int64 // len(segs), read without the lock
	mu   sync.RWMutex
	segs map[uint64]*pulled
	// contents are the contents of the segments, by ID.
	contents map[string]*content
}

// content is what the mount keeps of one content ID.
type content struct {
	segs int // pulled segments with it
	// files are the backing files handed to the cluster to serve it from
	// (published, pulled into, offered): kept open while it may read them.
	files []*os.File
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
		s.contents[cid].segs--
		s.dropIfUnusedLocked(cid)
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

// serveFrom records that the cluster may read content cid from f, which
// stays open until no segment has the content.
func (s *pulledSet) serveFrom(cid string, f *os.File) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.contentLocked(cid)
	c.files = append(c.files, f)
	s.dropIfUnusedLocked(cid)
}

// pulling counts a pull of content cid in (delta 1) or out (-1).
func (s *pulledSet) pulling(cid string, delta int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.contentLocked(cid).pulling += delta
	s.dropIfUnusedLocked(cid)
}

// dropIfUnusedLocked drops content cid from the cluster and closes its
// files once no segment has it and no pull fills it.
func (s *pulledSet) dropIfUnusedLocked(cid string) {
	c := s.contents[cid]
	if c == nil || c.segs > 0 || c.pulling > 0 {
		return
	}
	delete(s.contents, cid)
	if len(c.files) == 0 {
		return
	}
	if cl := s.fsys.cl; cl != nil {
		cl.node.Drop(cid)
	}
	closeFiles(c.files)
}

// distrust stops serving and copying content cid from f, whose bytes
// failed verification: f is closed, and the cluster serves cid no more
// (its pieces are verified as they are served, and this node may hold no
// good copy).
func (s *pulledSet) distrust(cid string, f *os.File) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.contents[cid]
	if c == nil {
		return
	}
	if i := slices.Index(c.files, f); i >= 0 {
		c.files = slices.Delete(c.files, i, i+1)
		f.Close()
	}
	if cl := s.fsys.cl; cl != nil {
		cl.node.Drop(cid)
	}
}

// servedFiles returns, for each content the cluster may serve, a file
// that holds it.
func (s *pulledSet) servedFiles() map[string]*os.File {
	s.mu.RLock()
	defer s.mu.RUnlock()
	files := map[string]*os.File{}
	for cid, c := range s.contents {
		if len(c.files) > 0 {
			files[cid] = c.files[0]
		}
	}
	return files
}

// servedFile returns a file the cluster serves content cid from, if the
// mount has one: a complete copy to copy locally.
func (s *pulledSet) servedFile(cid string) *os.File {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if c := s.contents[cid]; c != nil && len(c.files) > 0 {
		return c.files[0]
	}
	return nil
}

// closeAll closes every file the cluster was handed, at unmount once the
// cluster node is closed.
func (s *pulledSet) closeAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range s.contents {
		closeFiles(c.files)
		c.files = nil
	}
}

// restore adds the pulled segments recovery found; the files of complete
// ones are kept for the cluster to serve from if serve is set (the mount
// joins one), else closed.
func (s *pulledSet) restore(found []alloc.PulledFile, serve bool) {
	for _, pf := range found {
		s.add(pf.Ino, pf.Marker)
		if pf.File == nil {
			continue
		}
		if serve && pf.Marker.Content != "" {
			s.serveFrom(pf.Marker.Content, pf.File)
		} else {
			pf.File.Close()
		}
	}
}
