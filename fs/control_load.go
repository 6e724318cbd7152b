package fs

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ctl"
	"tensorfs/fdpass"
)

var _ = (ctl.Loader)(controlBackend{})

// Load serves the control socket's load: the segments under a directory,
// each with a descriptor, for a client that maps a whole state dict in one
// request. Permissions are open(2)'s: search on every directory on the
// way, read (to list) on every directory walked, read (and write if asked)
// on every segment; one refusal refuses the request. Each descriptor is a
// new open file description with the access asked for; a device segment
// comes without one (open it through the mount). A request that goes on
// (after) a load of the same directory on the same connection takes the
// directories' names its last request read from the cursor that one left
// (loadCursor) rather than reading and sorting them again.
func (b controlBackend) Load(cred ctl.Cred, dir string, write bool, after string, max int, cursor *any) ([]ctl.Segment, []int, bool, error) {
	dir = filepath.Clean(dir)
	prev, _ := (*cursor).(*loadCursor)
	*cursor = nil
	if cl := b.fsys.cl; cl != nil && !write && b.fsys.pulled.n.Load() > 0 {
		if err := cl.prefetch(cred, dir); err != nil {
			return nil, nil, false, fmt.Errorf("%s: %w", alloc.EscapeText(dir), err)
		}
	}
	l := &loader{b: b, who: cred, write: write, after: strings.Split(after, "/"), max: max, kept: map[string]*loadLevel{}}
	if after == "" {
		l.after = nil
	} else if prev != nil && prev.dir == dir {
		l.prev = prev.levels
	}
	node := b.fsys.inodeAt(dir)
	err := l.b.walk(l.who, dir, func(parent int, name string) error { return l.dir(parent, name, nil, node) })
	if err == errFull {
		l.more, err = true, nil
		*cursor = &loadCursor{dir: dir, levels: l.kept}
	}
	if err != nil {
		fdpass.Close(l.fds)
		return nil, nil, false, fmt.Errorf("%s: %w", alloc.EscapeText(dir), err)
	}
	return l.segs, l.fds, l.more, nil
}

// loadCursor is what a load request that did not reach the end leaves on
// its connection for the next: each directory it returned segments from
// or was in when its reply filled, by its path below the requested
// directory dir, as it found it (loadLevel). The next request walks
// those directories again only if each is still the one found, so that a
// load never lists two directories as one (ESTALE). It holds at most
// what the request held (maxLoadNames), and a connection holds one.
type loadCursor struct {
	dir    string
	levels map[string]*loadLevel
}

// loadLevel is a directory a load request walked: its identity and,
// where the request stopped inside it, its sorted names.
type loadLevel struct {
	id    []byte   // dirIdentity
	names []string // nil unless the reply filled while the walk was in it
	used  bool     // a segment of it is in the reply
}

// dirIdentity returns what tells the directory fd from any other, even
// one made later at the same inode number: its file handle (inode and
// generation), else, where the backing gives none, its inode number.
func dirIdentity(fd int, st *unix.Stat_t) []byte {
	if h, _, err := unix.NameToHandleAt(fd, "", unix.AT_EMPTY_PATH); err == nil {
		return append(binary.LittleEndian.AppendUint32(nil, uint32(h.Type())), h.Bytes()...)
	}
	return binary.LittleEndian.AppendUint64(nil, st.Ino)
}

// loader is one load request's walk: depth first, entries in byte order,
// so that names come in the order of their components and a request can
// resume after the last name of the one before.
type loader struct {
	b     controlBackend
	who   ctl.Cred
	write bool
	after []string // components of the name to resume after; nil from the start
	max   int

	segs []ctl.Segment
	fds  []int // -1 for a segment without a descriptor
	more bool
	held int // bytes of the names of the directories the walk is in

	prev map[string]*loadLevel // the last request's, by path (loadCursor); nil if none
	kept map[string]*loadLevel // this request's, for the next
	cur  *loadLevel            // the directory whose entries the walk is on
}

// maxLoadNames bounds the bytes of names one load holds: the sorted names
// of each directory it is in, down to the deepest. A request's memory so
// grows with what its directories hold only up to this, whoever made
// them (the socket's connections bound the requests).
var maxLoadNames = 16 << 20

// readNames reads the names of the directory f (rel below the requested
// one), charging them to l.held; past maxLoadNames the load fails, E2BIG.
// What it read is returned, charged, in every case.
func (l *loader) readNames(f *os.File, rel []string) ([]string, error) {
	var names []string
	for {
		batch, err := f.Readdirnames(alloc.WalkBatch)
		names = append(names, batch...)
		l.held += namesBytes(batch)
		switch {
		case l.held > maxLoadNames:
			return names, fmt.Errorf("%w: %s: the directories on the way hold more than %d MiB of names; load its subdirectories one at a time", syscall.E2BIG, display(rel), maxLoadNames>>20)
		case errors.Is(err, io.EOF):
			return names, nil
		case err != nil:
			return names, err
		}
	}
}

// namesBytes is what names take in memory, about.
func namesBytes(names []string) int {
	n := 0
	for _, s := range names {
		n += len(s) + 16
	}
	return n
}

// errFull stops the walk once max segments are collected and another follows.
var errFull = errors.New("load: reply full")

// dir walks the directory name in parentfd, whose components below the
// requested directory are rel and whose inode the kernel knows as node
// (nil if it does not). Each directory open on the way down is one of the
// requester's descriptors (fs/budget.go) while the walk is in it.
func (l *loader) dir(parentfd int, name string, rel []string, node *fusefs.Inode) error {
	if len(rel) > alloc.MaxDepth {
		return fmt.Errorf("%w: %s", alloc.ErrTooDeep, display(rel[:8]))
	}
	handles := l.b.fsys.handles
	if err := handles.Take(l.who.Uid, 1); err != nil {
		return err
	}
	defer handles.Give(l.who.Uid, 1)
	fd, err := unix.Openat(parentfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if node != nil && node.StableAttr().Ino != st.Ino {
		node = nil // replaced since the kernel looked it up
	}
	if !permitted(&l.who, &st, 4|1) {
		return fmt.Errorf("%w: %s: listing it needs read and search permission", syscall.EACCES, display(rel))
	}
	lvl := &loadLevel{id: dirIdentity(fd, &st)}
	names, err := l.names(f, rel, lvl.id)
	defer func() { l.held -= namesBytes(names) }()
	if err != nil {
		return err
	}
	err = l.entries(fd, names, rel, node, lvl)
	if err == errFull {
		lvl.names = names
	}
	if err == errFull || lvl.used {
		l.kept[path.Join(rel...)] = lvl
	}
	return err
}

// entries walks the sorted names of the directory fd, rel below the
// requested one, from where the request resumes; node is fd's inode as
// the kernel knows it (nil if it does not), lvl fd's level.
func (l *loader) entries(fd int, names []string, rel []string, node *fusefs.Inode, lvl *loadLevel) error {
	for _, child := range names {
		crel := append(slices.Clip(rel), child)
		if l.before(crel) {
			continue
		}
		l.cur = lvl
		if err := l.entry(fd, child, crel, node); err != nil {
			return err
		}
	}
	return nil
}

// names returns the sorted names of the directory f, rel below the
// requested one, whose identity is id, charged to l.held: those the
// connection's last request of this load kept, if it walked this
// directory there, else read now. A directory there that the last
// request walked and that is another now fails the load, ESTALE.
func (l *loader) names(f *os.File, rel []string, id []byte) ([]string, error) {
	prev := l.prev[path.Join(rel...)]
	switch {
	case prev != nil && !bytes.Equal(prev.id, id):
		return nil, fmt.Errorf("%w: %s was replaced during the load (renamed or removed, another in its place); load again", syscall.ESTALE, display(rel))
	case prev != nil && prev.names != nil:
		l.held += namesBytes(prev.names)
		return prev.names, nil
	}
	names, err := l.readNames(f, rel)
	if err == nil {
		slices.Sort(names)
	}
	return names, err
}

// entry walks or adds the entry name in dirfd, whose components below
// the requested directory are rel, if it is a directory or a segment;
// node is dirfd's inode as the kernel knows it (nil if it does not).
func (l *loader) entry(dirfd int, name string, rel []string, node *fusefs.Inode) error {
	m, err := alloc.OpenRef(dirfd, name, 0)
	if errors.Is(err, unix.ENOENT) {
		return nil // removed meanwhile
	}
	if err != nil {
		return err
	}
	var child *fusefs.Inode
	if node != nil {
		child = node.GetChild(name)
	}
	if mode := m.Stat().Mode & syscall.S_IFMT; mode != syscall.S_IFREG {
		m.Close() // not held (uncharged) while a directory is walked
		if mode == syscall.S_IFDIR {
			return l.dir(dirfd, name, rel, child)
		}
		return nil
	}
	defer m.Close()
	return l.segment(m, dirfd, rel, cachedSegment(child, m.Stat().Ino))
}

// before reports whether the entry rel comes at or before the name to
// resume after, with nothing after it to visit: a directory on the way to
// that name is walked.
func (l *loader) before(rel []string) bool {
	if l.after == nil {
		return false
	}
	for i, c := range rel {
		if i == len(l.after) {
			return false // below the name: a directory's content comes after it
		}
		if c != l.after[i] {
			return c < l.after[i]
		}
	}
	return len(rel) == len(l.after) // the name itself; a prefix is a directory on the way
}

// cachedSegment returns the segment node of the inode i if it is the
// backing inode ino: its cached attributes are ino's. nil otherwise.
func cachedSegment(i *fusefs.Inode, ino uint64) *segmentNode {
	if i == nil || i.StableAttr().Ino != ino {
		return nil
	}
	n, _ := i.Operations().(*segmentNode)
	return n
}

// segment adds the segment m, found in dirfd, whose components below the
// requested directory are rel and whose node the kernel knows as n (nil
// if it does not).
func (l *loader) segment(m *alloc.Ref, dirfd int, rel []string, n *segmentNode) error {
	if len(l.segs) == l.max {
		return errFull
	}
	s, st, err := l.b.segment(l.who, m, l.write, display(rel))
	if err != nil {
		return err
	}
	seg := ctl.Segment{Name: path.Join(rel...), Size: st.Size, Links: uint64(st.Nlink)}
	f, lay, err := l.b.fsys.segmentAttrs(s, m, n, seg.Name)
	if err != nil {
		return fmt.Errorf("%s: %w", display(rel), err)
	}
	if l.write && f&alloc.FromFD != 0 {
		return fmt.Errorf("%w: %s is FROMFD (imported, read-only): load it without write", alloc.ErrReadOnly, display(rel))
	}
	seg.Flags, seg.Dtype, seg.Shape, seg.Stride, seg.Offset = f.String(), lay.Dtype, lay.Shape, lay.Stride, lay.Offset
	fd, err := l.descriptor(s, m, dirfd, rel[len(rel)-1])
	if err == nil && fd >= 0 && l.write {
		err = l.b.fsys.frozen(m.Stat().Ino)
	}
	if err != nil {
		fdpass.Close([]int{fd})
		return fmt.Errorf("%s: %w", display(rel), err)
	}
	l.segs = append(l.segs, seg)
	l.fds = append(l.fds, fd)
	l.cur.used = true
	return nil
}

// descriptor opens the segment m, found as name in dirfd, whose storage
// is s, for the requester: a host segment by that name (alloc.Ref.OpenAt:
// no walk of /proc/self/fd), or, where the name no longer reaches it
// (renamed, replaced), through /proc/self/fd as every other open; another
// kind as its storage hands it out (-1 for none). A raw descriptor, not
// an *os.File: no fcntl or finalizer for each of a load's hundreds.
func (l *loader) descriptor(s storage, m *alloc.Ref, dirfd int, name string) (int, error) {
	if _, ok := s.(host); !ok {
		f, err := s.descriptor(m, l.write)
		if f == nil || err != nil {
			return -1, err
		}
		defer f.Close()
		return fdpass.Dup(f)
	}
	fd, err := m.OpenAt(dirfd, name, accessMode(l.write))
	if err != nil {
		fd, err = m.Open(accessMode(l.write))
	}
	return fd, err
}

// segmentAttrs returns the flags and tensor attributes of the segment m,
// whose storage is s: from the cache of n, its node, where the kernel
// knows one (the first read fills it, as getxattr's does), else, for a
// host segment, from fsys.stored while m's inode has not changed, else
// read from storage. A tensor attribute stored that fails validation is
// left out and logged (alloc.ReadLayout); name names the segment there.
func (fsys *filesystem) segmentAttrs(s storage, m *alloc.Ref, n *segmentNode, name string) (f alloc.Flags, l alloc.Layout, err error) {
	if n != nil {
		if f, err = n.flags(n); err == nil {
			l, err = n.tensorLayout(n)
		}
		return f, l, err
	}
	_, cacheable := s.(host)
	if cacheable {
		if f, l, ok := fsys.stored.get(m.Stat()); ok {
			return f, l, nil
		}
	}
	err = s.attrs(m, func(a *alloc.Ref) error {
		p, err := a.Path()
		if err == nil {
			f, err = alloc.ReadFlags(p)
		}
		if err == nil {
			l, err = fsys.readLayout(p, name)
		}
		return err
	})
	if err == nil && cacheable {
		fsys.stored.put(m.Stat(), f, l)
	}
	return f, l, err
}

// display names a segment or directory of a load in messages.
func display(rel []string) string {
	if len(rel) == 0 {
		return "the directory"
	}
	return alloc.EscapeText(path.Join(rel...))
}
