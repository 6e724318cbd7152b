package alloc

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Two kinds of segment keep their bytes and attributes outside the
// backing tree, which holds an empty marker file at the segment's name:
//
//   - SHARED segments live in a file DISK/<id> on the persistent --disk
//     directory; the marker's attrDisk attribute is the id. The disk file
//     records the segment's path in attrPath, so a purged backing can be
//     rebuilt from the disk alone.
//   - Imported (FROMFD) segments live in a descriptor a client sent over
//     the control socket, held by the daemon; the marker's attrImport
//     attribute names it. Such a segment ends with the daemon.
const (
	attrDisk   = "user.tensorfs.disk"
	attrPath   = "user.tensorfs.path"
	attrImport = "user.tensorfs.import"
)

// InternalAttr reports whether name is tensorfs's own bookkeeping, which
// clients neither see nor set.
func InternalAttr(name string) bool {
	switch name {
	case attrDisk, attrPath, attrImport, attrDevSize, attrSpilled:
		return true
	}
	return false
}

// ImportID returns the import id of the marker at path, "" if it is not
// an imported segment.
func ImportID(path string) string {
	id, err := readAttr(path, attrImport)
	if err != nil {
		return ""
	}
	return id
}

// MarkImport makes the empty file at path the marker of imported segment id.
func MarkImport(path, id string) error {
	return unix.Setxattr(path, attrImport, []byte(id), 0)
}

// SharedID returns the disk id of the marker at path, "" if it is an
// ordinary segment.
func SharedID(path string) string {
	id, err := readAttr(path, attrDisk)
	if err != nil {
		return ""
	}
	return id
}

// CreateShared makes the disk file of a new SHARED segment whose marker is
// at markerPath and whose name in the mount is rel, and returns an open
// descriptor of it (opened with flags) and its id.
func (s *Store) CreateShared(markerPath, rel string, flags int, mode uint32) (fd int, id string, err error) {
	id = NewID()
	fd, err = unix.Open(s.DiskPath(id), flags|unix.O_CREAT|unix.O_EXCL, mode)
	if err != nil {
		return -1, "", fmt.Errorf("create SHARED segment on disk: %w", err)
	}
	p := "/proc/self/fd/" + fmt.Sprint(fd)
	if err = unix.Setxattr(p, attrPath, []byte(rel), 0); err == nil {
		err = unix.Setxattr(markerPath, attrDisk, []byte(id), 0)
	}
	if err != nil {
		unix.Close(fd)
		os.Remove(s.DiskPath(id))
		return -1, "", err
	}
	return fd, id, nil
}

// DiskPath returns the path of a SHARED segment's disk file.
func (s *Store) DiskPath(id string) string {
	return filepath.Join(s.Disk, id)
}

// recoverShared gives every disk file that no marker names a marker at the
// path it recorded, so SHARED segments outlive a purged backing.
func (s *Store) recoverShared(known map[string]bool) error {
	entries, err := os.ReadDir(s.Disk)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if known[e.Name()] || !e.Type().IsRegular() {
			continue
		}
		rel, err := readAttr(s.DiskPath(e.Name()), attrPath)
		if err != nil || rel == "" {
			s.log.Warn("recover: disk file without a recorded path, left alone", "file", s.DiskPath(e.Name()))
			continue
		}
		marker := filepath.Join(s.Dir, filepath.Clean("/"+rel))
		if _, err := os.Lstat(marker); err == nil {
			marker += ".shared-" + e.Name()
		}
		if err := os.MkdirAll(filepath.Dir(marker), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(marker, nil, 0o600); err != nil {
			return err
		}
		if err := unix.Setxattr(marker, attrDisk, []byte(e.Name()), 0); err != nil {
			return err
		}
		s.log.Info("recover: restored SHARED segment from disk", "path", rel, "file", s.DiskPath(e.Name()))
	}
	return nil
}

// RemoveShared deletes a SHARED segment's disk file.
func (s *Store) RemoveShared(id string) error {
	err := os.Remove(s.DiskPath(id))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}

// RecordSharedPath notes on a SHARED segment's disk file the path rel its
// marker now has; a no-op for other segments.
func (s *Store) RecordSharedPath(markerPath, rel string) {
	if s.Disk == "" {
		return
	}
	if id := SharedID(markerPath); id != "" {
		unix.Setxattr(s.DiskPath(id), attrPath, []byte(rel), 0)
	}
}

// NewID returns a random id for a marker.
func NewID() string {
	var b [8]byte
	rand.Read(b[:]) // never fails on Linux
	return hex.EncodeToString(b[:])
}
