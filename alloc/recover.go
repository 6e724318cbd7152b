package alloc

import (
	"syscall"

	"golang.org/x/sys/unix"
)

// Recover prepares a backing left by an earlier daemon for a new mount.
// Handle counts restart at zero, so an UNLINK segment is removed, as its
// last holder's exit would have removed it, unless mapped reports that a
// live process still maps its backing file (mapped may be nil). It
// returns the number of segments and bytes kept. Imported segments ended
// with the daemon that held them and their markers are removed. SHARED
// segments whose markers are gone (a purged backing) are restored from
// --disk. Recovery acts only on names below the backing root, through
// descriptors (Walk, At): whatever the backing holds, nothing outside it
// is touched.
func (s *Store) Recover(mapped func(st *unix.Stat_t) bool) (segments, bytes int64, err error) {
	known := map[string]bool{}
	err = Walk(s.RootFd, func(dirfd int, name, rel string, st *unix.Stat_t) error {
		if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
			return nil
		}
		var imported, shared string
		var f Flags
		var ferr error
		At(dirfd, name, st.Ino, func(p string) error {
			imported, shared = ImportID(p), SharedID(p)
			f, ferr = ReadFlags(p)
			return nil
		})
		switch {
		case imported != "":
			s.log.Info("recover: removing imported segment, its descriptor ended with the daemon", "path", rel)
			return unix.Unlinkat(dirfd, name, 0)
		case shared != "" && s.Disk != "":
			known[shared] = true
			return nil
		case ferr != nil:
			s.log.Warn("recover: unreadable flags, keeping segment", "path", rel, "err", ferr)
		case f&Unlink != 0 && mapped != nil && mapped(st):
			s.log.Info("recover: keeping UNLINK segment that a live process maps", "path", rel)
		case f&Unlink != 0:
			s.log.Info("recover: removing UNLINK segment without holders", "path", rel)
			return unix.Unlinkat(dirfd, name, 0)
		}
		segments++
		bytes += st.Size
		return nil
	})
	if err == nil && s.Disk != "" {
		err = s.recoverShared(known)
	}
	return segments, bytes, err
}
