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
}

// Recover prepares a backing left by an earlier daemon for a new mount.
// Handle counts restart at zero, so an UNLINK segment is removed, as its
// last holder's exit would have removed it, unless mapped reports that a
// live process still maps its backing file (mapped may be nil). Imported
// segments ended with the daemon that held them and their markers are
// removed. SHARED segments whose markers are gone (a purged backing) are
// restored from --disk. Recovery acts only on names below the backing
// root, through descriptors (Walk, Ref): whatever the backing holds,
// nothing outside it is touched. A marker that cannot be read is kept
// and logged.
func (s *Store) Recover(mapped func(st *unix.Stat_t) bool) (*Recovery, error) {
	rec := &Recovery{}
	known := map[string]bool{}
	err := Walk(s.RootFd, func(dirfd int, name, rel string, st *unix.Stat_t) error {
		if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
			return nil
		}
		ref, err := OpenRef(dirfd, name, st.Ino)
		if err != nil {
			s.log.Warn("recover: segment changed while recovering, left alone", "path", rel, "err", err)
			return nil
		}
		defer ref.Close()
		p, _ := ref.Path()
		m, merr := ReadMarker(p, st)
		f, ferr := ReadFlags(p)
		switch {
		case merr != nil:
			s.log.Warn("recover: unreadable marker, keeping segment", "path", rel, "err", merr)
		case m.Kind == Imported:
			s.log.Info("recover: removing imported segment, its descriptor ended with the daemon", "path", rel)
			return unix.Unlinkat(dirfd, name, 0)
		case m.Kind == Disk:
			known[m.ID] = true
			return nil
		case ferr != nil:
			s.log.Warn("recover: unreadable flags, keeping segment", "path", rel, "err", ferr)
		case f&Unlink != 0 && mapped != nil && mapped(st):
			s.log.Info("recover: keeping UNLINK segment that a live process maps", "path", rel)
		case f&Unlink != 0:
			s.log.Info("recover: removing UNLINK segment without holders", "path", rel)
			return unix.Unlinkat(dirfd, name, 0)
		}
		ds, derr := ReadDeviceState(p)
		if m.Kind == Device || derr == nil && ds.Spilled {
			// A spilled device segment's backing file holds its bytes;
			// its marker says so only once it is empty again.
			fd, err := ref.Open(unix.O_RDWR)
			if err != nil {
				s.log.Warn("recover: device segment not reopened, it will not be restored", "path", rel, "err", err)
			} else {
				rec.Devices = append(rec.Devices, os.NewFile(uintptr(fd), filepath.Join(s.Dir, rel)))
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
