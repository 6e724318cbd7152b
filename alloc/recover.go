package alloc

import (
	"io/fs"
	"os"
	"path/filepath"
)

// Recover prepares a backing left by an earlier daemon for a new mount.
// Reference counts restart at zero, so every UNLINK segment has no holder
// and is removed, as its last holder's exit would have removed it. It
// returns the number of segments and bytes kept. Imported segments ended
// with the daemon that held them and their markers are removed. SHARED
// segments whose markers are gone (a purged backing) are restored from
// --disk.
func (s *Store) Recover() (segments, bytes int64, err error) {
	known := map[string]bool{}
	err = filepath.WalkDir(s.Dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		if ImportID(p) != "" {
			s.log.Info("recover: removing imported segment, its descriptor ended with the daemon", "path", p)
			return os.Remove(p)
		}
		if id := SharedID(p); id != "" && s.Disk != "" {
			known[id] = true
			return nil
		}
		f, err := ReadFlags(p)
		if err != nil {
			s.log.Warn("recover: unreadable flags, keeping segment", "path", p, "err", err)
		}
		if f&Unlink != 0 {
			s.log.Info("recover: removing UNLINK segment without holders", "path", p)
			return os.Remove(p)
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		segments++
		bytes += info.Size()
		return nil
	})
	if err == nil && s.Disk != "" {
		err = s.recoverShared(known)
	}
	return segments, bytes, err
}
