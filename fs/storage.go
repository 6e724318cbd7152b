package fs

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// storage is where one segment's bytes and attributes live: one
// implementation per kind of segment, each in a file of its own
// (storage_host.go, storage_shared.go, storage_imported.go,
// storage_device.go, storage_pulled.go; DESIGN.md §11). Every method gets the segment's
// backing object (its marker, for kinds whose bytes live elsewhere) as a
// Ref already checked to be the segment's inode, so no kind ever reaches
// a backing object by name.
//
// The kind of a segment is decided once, by classify, and kept in the
// segment's node (segmentNode.kind); it changes only when an empty
// segment changes device (moveDevice).
type storage interface {
	// kind names the kind, for logs, stats and tests.
	kind() alloc.Kind
	// attrs runs fn with the object that holds the segment's owner,
	// mode, times, flags and attributes.
	attrs(m *alloc.Ref, fn func(a *alloc.Ref) error) error
	// overlay turns st, a fresh fstat of the segment's backing object m
	// (statOf fills it), into what stat(2) shows of the segment: the
	// marker's identity (inode, links) with the owner, mode, size and
	// times of where they live, read now. Only statOf calls it.
	overlay(m *alloc.Ref, st *unix.Stat_t) error
	// open opens the segment's bytes for a FUSE open with flags (the
	// O_ACCMODE of the request; O_TRUNC is done by the caller), as the
	// handle that serves them.
	open(n *segmentNode, m *alloc.Ref, h handle, flags uint32) (segmentHandle, error)
	// resize sets the segment's size; growth reserves its memory.
	resize(m *alloc.Ref, size int64) error
	// descriptor opens, for a control-socket peer, a new open file
	// description of the segment's bytes with exactly the access asked
	// for; nil with no error when this kind hands none out (the peer
	// opens it through the mount).
	descriptor(m *alloc.Ref, write bool) (*os.File, error)
	// mapped returns the file whose mappings outside the mount map the
	// segment's bytes, and the only uid whose processes count through it
	// (anyUID for every process); ok is false when there is none.
	mapped(m *alloc.Ref) (id fileID, uid uint32, ok bool)
	// handle returns the path of the file that holds the segment's bytes
	// outside the mount (user.tensorfs.handle, for the daemon's user).
	handle(m *alloc.Ref) (string, error)
	// release frees what the segment holds once its last name is gone.
	release() error
}

// anyUID, as storage.mapped's uid, lets every process's mappings count.
const anyUID = ^uint32(0)

// kindBox holds a segment's storage, so that it can be swapped whole.
type kindBox struct{ s storage }

// kindRef is a segment's current storage.
type kindRef struct{ p atomic.Pointer[kindBox] }

func (k *kindRef) load() storage   { return k.p.Load().s }
func (k *kindRef) store(s storage) { k.p.Store(&kindBox{s}) }

// classify is the one place that decides a segment's kind, from the
// marker its backing object m holds (alloc.ReadMarker), which is read
// for an empty file or a pulled segment's (hostBySize). An error reading
// the marker is returned, never taken for another kind. A marker this
// mount cannot serve (a SHARED segment without --disk, a device segment
// without a GPU, an import that ended, an id tensorfs cannot have made)
// gives an unavailable segment: it can be seen, renamed and removed, and
// every access to its bytes says why not.
func (fsys *filesystem) classify(m *alloc.Ref) (storage, error) {
	st := m.Stat()
	if why := fsys.unrestored.get(st.Ino); why != nil {
		return unavailable{k: alloc.Device, why: why, forget: func() { fsys.unrestored.drop(st.Ino) }}, nil
	}
	if st.Size != 0 && !fsys.pulled.has(st.Ino) {
		return host{}, nil // markers are empty but pulled ones: the common case costs nothing more
	}
	p, err := m.Path()
	if err != nil {
		return nil, err
	}
	mk, err := alloc.ReadMarker(p, st)
	if errors.Is(err, alloc.ErrInvalid) {
		return unavailable{k: alloc.Host, why: err}, nil
	}
	if err != nil {
		return nil, err
	}
	switch mk.Kind {
	case alloc.Pulled:
		return fsys.pulled.classify(st, mk), nil
	case alloc.Disk:
		if fsys.store.Disk == "" {
			return unavailable{k: mk.Kind, why: fmt.Errorf("%w: this SHARED segment lives on the --disk directory, and this mount has none", alloc.ErrNoDisk)}, nil
		}
		return shared{fsys.store, mk.ID}, nil
	case alloc.Imported:
		in, ok := fsys.imports.get(mk.ID)
		if !ok {
			return unavailable{k: mk.Kind, why: fmt.Errorf("%w: the descriptor this segment was imported from is gone", syscall.ENOENT)}, nil
		}
		return in, nil
	case alloc.Device:
		if fsys.gpu == nil || fsys.gpu.dev.Name() != mk.Device {
			return unavailable{k: mk.Kind, why: fmt.Errorf("%w: this segment lives on %s, which this mount does not serve (mount with --gpu)", alloc.ErrNoDevice, mk.Device)}, nil
		}
		seg, err := fsys.gpu.segment(m)
		if err != nil {
			return nil, err
		}
		return device{seg}, nil
	}
	return host{}, nil
}

// statOf fills st with what stat(2) on the mount shows of the backing
// object m at this moment: a fresh fstat of m's descriptor, which the
// segment's storage s overlays where its bytes or attributes live
// elsewhere (s is nil for an object that is not a segment). It is the one
// stat of a backing object that every reply carrying attributes (entry
// and attr replies), permission check and policy reads: the stat a Ref
// took when it was opened (alloc.Ref.Stat) is the object's identity, and
// its owner, mode and size may have changed since (the daemon gives a new
// object to its caller after it opened it).
func statOf(m *alloc.Ref, s storage, st *unix.Stat_t) error {
	if err := unix.Fstat(m.Fd(), st); err != nil {
		return err
	}
	if s == nil {
		return nil
	}
	return s.overlay(m, st)
}

// hostBySize reports whether the regular file st is a host segment
// without reading its marker: it has bytes, and no segment with bytes but
// a marker (a pulled one, a device one not restored) is its inode. No
// call is made.
func (fsys *filesystem) hostBySize(st *unix.Stat_t) bool {
	return st.Size != 0 && !fsys.unrestored.has() && !fsys.pulled.has(st.Ino)
}

// unavailable is a segment whose bytes this mount cannot reach; why says
// so to every access. Its marker keeps its name, owner and attributes.
type unavailable struct {
	k   alloc.Kind
	why error
	// forget, if set, is called when the segment's last name goes.
	forget func()
}

func (u unavailable) kind() alloc.Kind { return u.k }

func (u unavailable) attrs(m *alloc.Ref, fn func(*alloc.Ref) error) error { return fn(m) }

func (u unavailable) overlay(*alloc.Ref, *unix.Stat_t) error { return nil }

func (u unavailable) open(*segmentNode, *alloc.Ref, handle, uint32) (segmentHandle, error) {
	return nil, u.why
}

func (u unavailable) resize(*alloc.Ref, int64) error { return u.why }

func (u unavailable) descriptor(*alloc.Ref, bool) (*os.File, error) { return nil, u.why }

func (u unavailable) mapped(*alloc.Ref) (fileID, uint32, bool) { return fileID{}, 0, false }

func (u unavailable) handle(*alloc.Ref) (string, error) { return "", u.why }

func (u unavailable) release() error {
	if u.forget != nil {
		u.forget()
	}
	return nil
}

// inoErrors is a set of inodes with the reason each is unavailable.
type inoErrors struct {
	mu sync.RWMutex
	m  map[uint64]error
}

func (s *inoErrors) get(ino uint64) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.m[ino]
}

func (s *inoErrors) add(ino uint64, why error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[uint64]error{}
	}
	s.m[ino] = why
}

// has reports whether the set holds any inode.
func (s *inoErrors) has() bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.m) > 0
}

func (s *inoErrors) drop(ino uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, ino)
}
