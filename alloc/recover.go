package alloc

import (
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// Recovery is what Recover found in the backing.
type Recovery struct {
	// Segments and Bytes count the segments kept and the bytes their
	// backing files hold.
	Segments, Bytes int64
	// Devices are the backing files of device segments, open read-write
	// and named by their path, for the mount to restore
	// into device memory (or close, without a GPU).
	Devices []*os.File
	// Pulled are the Pulled segments: complete ones with their path (to
	// serve to peers), incomplete ones emptied.
	Pulled []PulledFile
	// Imports are the markers of imported segments kept for a successor
	// (Recover's successor).
	Imports []ImportMarker
	// Unlinked are the inodes of the UNLINK segments no process maps
	// that a successor keeps until it knows their handles.
	Unlinked []uint64
}

// ImportMarker is the marker of an imported segment that recovery kept.
type ImportMarker struct {
	// Rel is its path relative to the backing's root, Ino its inode and
	// ID the import's id; Unlink whether its flags carry UNLINK.
	Rel    string
	Ino    uint64
	ID     string
	Unlink bool
}

// PulledFile is a Pulled segment recovery found.
type PulledFile struct {
	// Ino is the backing file's inode; Marker its marker.
	Ino    uint64
	Marker Marker
	// Path is the backing file's path relative to the backing's root
	// when the segment is complete; "" otherwise.
	Path string
}

// Recover prepares a backing left by an earlier daemon for a new mount.
// Handle counts restart at zero, so an UNLINK segment is removed, as its
// last holder's exit would have removed it, unless mapped reports that a
// live process still maps its backing file (mapped may be nil). Imported
// segments ended with the daemon that held them and their markers are
// removed. A successor (a daemon that takes a live mount over, whose
// handles and imports' descriptors it inherits) keeps both and lists them
// (Recovery.Unlinked, Recovery.Imports), for it to remove what it did not
// inherit. SHARED segments whose markers are gone (a purged backing) are
// restored from --disk. Pulled segments are kept: a complete one as it
// is, an incomplete one emptied (its pull starts again from zero), and
// one frozen for a publish that never finished becomes a Host segment
// again. Recovery acts only on names below the backing
// root, through descriptors (Tree, Ref), at any depth: whatever the backing holds,
// nothing outside it is touched. A marker that cannot be read is kept
// and logged. Only the daemon's own attributes decide (markers, device
// state, and the flags and device through StoredName): no value a user
// can store on a backing file, through a descriptor the control socket
// handed out, makes recovery delete or change a segment.
func (s *Store) Recover(mapped func(st *unix.Stat_t) bool, successor bool) (*Recovery, error) {
	rec := &Recovery{}
	known := map[string]bool{}
	err := Tree(s.RootFd, func(e *Entry) error {
		dirfd, name, st := e.Dirfd, e.Name, &e.Stat
		if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
			return nil
		}
		ref, err := OpenRef(dirfd, name, st.Ino)
		if err != nil {
			s.log.Warn("recover: segment changed while recovering, left alone", "path", e.Tail(), "err", err)
			return nil
		}
		defer ref.Close()
		p, _ := ref.Path()
		m, merr := ReadMarker(p, st)
		f, ferr := ReadFlags(p)
		switch {
		case merr != nil:
			s.log.Warn("recover: unreadable marker, keeping segment", "path", e.Tail(), "err", merr)
		case m.Kind == Imported && successor:
			rec.Imports = append(rec.Imports, importMarker(e, m, f, ferr))
			return nil
		case m.Kind == Imported:
			s.log.Info("recover: removing imported segment, its descriptor ended with the daemon", "path", e.Tail())
			return unix.Unlinkat(dirfd, name, 0)
		case m.Kind == Disk:
			known[m.ID] = true
			return nil
		case ferr != nil:
			s.log.Warn("recover: unreadable flags, keeping segment", "path", e.Tail(), "err", ferr)
		case f&Unlink != 0 && mapped != nil && mapped(st):
			s.log.Info("recover: keeping UNLINK segment that a live process maps", "path", e.Tail())
		case f&Unlink != 0 && successor:
			rec.Unlinked = append(rec.Unlinked, st.Ino)
		case f&Unlink != 0:
			s.log.Info("recover: removing UNLINK segment without holders", "path", e.Tail())
			return unix.Unlinkat(dirfd, name, 0)
		}
		if merr == nil && m.Kind == Pulled {
			if pf, ok := s.recoverPulled(ref, e, m); ok {
				rec.Pulled = append(rec.Pulled, pf)
				rec.Segments++
				if pf.Path != "" {
					rec.Bytes += st.Size
				}
				return nil
			}
		}
		if m.Kind == Device || spilled(p) {
			// A spilled device segment's backing file holds its bytes;
			// its marker says so only once it is empty again.
			fd, err := ref.Open(unix.O_RDWR)
			if err != nil {
				s.log.Warn("recover: device segment not reopened, it will not be restored", "path", e.Tail(), "err", err)
			} else {
				rec.Devices = append(rec.Devices, os.NewFile(uintptr(fd), filepath.Join(s.Dir, e.Rel())))
			}
		}
		rec.Segments++
		rec.Bytes += st.Size
		return nil
	})
	if err == nil && s.Disk != "" {
		err = s.recoverShared(known)
	}
	if err != nil {
		for _, f := range rec.Devices {
			f.Close()
		}
		return nil, err
	}
	return rec, nil
}

// importMarker is the marker m of the imported segment e, whose flags
// are f (ferr: unreadable).
func importMarker(e *Entry, m Marker, f Flags, ferr error) ImportMarker {
	return ImportMarker{Rel: e.Rel(), Ino: e.Stat.Ino, ID: m.ID, Unlink: ferr == nil && f&Unlink != 0}
}

// ImportMarkers lists the markers of the imported segments below the
// backing root whose ids are in ids, with a walk of the backing as
// Recover's: a successor's, for those its predecessor made after its
// recovery (fs.filesystem.lateImports).
func (s *Store) ImportMarkers(ids map[string]bool) []ImportMarker {
	var out []ImportMarker
	err := Tree(s.RootFd, func(e *Entry) error {
		if e.Stat.Mode&syscall.S_IFMT != syscall.S_IFREG {
			return nil
		}
		ref, err := OpenRef(e.Dirfd, e.Name, e.Stat.Ino)
		if err != nil {
			return nil // gone since: no marker to watch
		}
		defer ref.Close()
		p, _ := ref.Path()
		if m, err := ReadMarker(p, &e.Stat); err == nil && m.Kind == Imported && ids[m.ID] {
			f, ferr := ReadFlags(p)
			out = append(out, importMarker(e, m, f, ferr))
		}
		return nil
	})
	if err != nil {
		s.log.Warn("takeover: the walk for imports made during the handover stopped; an UNLINK one it did not reach stays until opened and closed again", "err", err)
	}
	return out
}

// spilled reports whether the backing file at path holds the bytes of a
// device segment spilled at a clean unmount: its device state says so, and
// its device is stored (a backing of an older daemon, which stored the
// device as a user.* attribute, has none: its segment stays a host one,
// with its bytes).
func spilled(path string) bool {
	ds, err := ReadDeviceState(path)
	if err != nil || !ds.Spilled {
		return false
	}
	dev, err := ReadDevice(path)
	return err == nil && dev != "cpu"
}

// recoverPulled recovers the Pulled segment at ref (e in the backing)
// whose marker is m; ok is false when it is a Host segment again (a
// publish that never finished). A complete one keeps its path, where the
// cluster opens it to serve it to peers.
func (s *Store) recoverPulled(ref *Ref, e *Entry, m Marker) (PulledFile, bool) {
	p, _ := ref.Path()
	pf := PulledFile{Ino: ref.Stat().Ino, Marker: m}
	switch {
	case m.Content == "":
		if err := Unmark(p); err != nil {
			s.log.Warn("recover: a segment frozen for a publish that never finished keeps its marker", "path", e.Tail(), "err", err)
			return pf, true
		}
		s.log.Info("recover: a publish never finished; the segment is writable again", "path", e.Tail())
		return pf, false
	case !m.Complete:
		fd, err := ref.Open(unix.O_WRONLY)
		if err == nil {
			err = unix.Ftruncate(fd, 0)
			unix.Close(fd)
		}
		if err != nil {
			s.log.Warn("recover: an incomplete pull could not be emptied", "path", e.Tail(), "err", err)
		}
		return pf, true
	}
	pf.Path = e.Rel()
	return pf, true
}
