package alloc

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// Two kinds of segment keep their bytes and attributes outside the
// backing tree, which holds an empty marker file at the segment's name,
// and a third marks a backing file that holds its own bytes:
//
//   - SHARED segments live in a file DISK/<id> on the persistent --disk
//     directory; the marker's attrDisk attribute is the id. The disk file
//     records the segment's path in attrPath, so a purged backing can be
//     rebuilt from the disk alone.
//   - Imported (FROMFD) segments live in a descriptor a client sent over
//     the control socket, held by the daemon; the marker's attrImport
//     attribute names it. Such a segment ends with the daemon.
//
// These attributes are the daemon's own state. A root daemon keeps them
// in the trusted namespace, which only CAP_SYS_ADMIN may read or write;
// a daemon of another user keeps them in its private backing, which no
// one else can reach. Ids are checked (validID) before they name a path.
var (
	attrDisk      = internalAttr("disk")
	attrPath      = internalAttr("path")
	attrImport    = internalAttr("import")
	attrPulled    = internalAttr("pulled")
	attrPublished = internalAttr("published")
	attrMade      = internalAttr("made")
	// attrRemoved+KEY, on the backing's root, records a published
	// directory removed on this node (MarkRemoved).
	attrRemoved = internalAttr("removed.")
)

// internalAttr returns the stored name of the daemon's attribute name.
func internalAttr(name string) string {
	if os.Geteuid() == 0 {
		return "trusted.tensorfs." + name
	}
	return "user.tensorfs." + name
}

// InternalAttr reports whether name is tensorfs's own bookkeeping, which
// clients neither see nor set.
func InternalAttr(name string) bool {
	if strings.HasPrefix(name, attrRemoved) {
		return true
	}
	switch name {
	case attrDisk, attrPath, attrImport, attrDevSize, attrSpilled, attrPulled, attrPublished, attrMade, attrFlags, attrDevice:
		return true
	}
	return false
}

// idLen is the length of the ids NewID makes: 16 lowercase hex digits.
const idLen = 16

// validID reports whether id is one NewID could have made, and so safe
// to join to a directory's path.
func validID(id string) bool {
	if len(id) != idLen {
		return false
	}
	for _, c := range id {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// Kind is where a segment's bytes live (DESIGN.md §11).
type Kind int

// The kinds of segment. A marker (an empty backing file with one of
// tensorfs's internal attributes) redirects the bytes of every kind but
// Host.
const (
	// Host: the backing file itself holds the bytes.
	Host Kind = iota
	// Disk: a file on the --disk directory holds the bytes and the
	// attributes (SHARED).
	Disk
	// Imported: a descriptor a client sent holds the bytes (FROMFD).
	Imported
	// Device: GPU memory holds the bytes; the backing file keeps the
	// attributes and, after a clean unmount, the spilled bytes.
	Device
	// Pulled: a read-only segment of a published directory; the backing
	// file holds its bytes once complete.
	Pulled
)

// String names the kind as logs, stats and tests do.
func (k Kind) String() string {
	switch k {
	case Disk:
		return "shared"
	case Imported:
		return "imported"
	case Device:
		return "device"
	case Pulled:
		return "pulled"
	}
	return "host"
}

// Marker is what a segment's backing file records about where its bytes
// live.
type Marker struct {
	Kind Kind
	// ID is the disk file's id (Disk) or the import's id (Imported).
	ID string
	// Device is the device the bytes live on, "cuda:N" (Device).
	Device string
	// Content is a Pulled segment's content ID, "" while it is being
	// published; Size its published size; Complete is true once its
	// backing file holds all of its bytes, verified.
	Content  string
	Size     int64
	Complete bool
}

// pulledValue is the encoding of a Pulled marker.
type pulledValue struct {
	Content  string `json:"content"`
	Size     int64  `json:"size"`
	Complete bool   `json:"complete"`
}

// ReadMarker is the one classifier of backing objects: it reads the
// marker of the object at path, whose stat is st. Only a regular file can
// be a marker, and only an empty one, except a Pulled segment's; anything
// else is Host. (A caller that knows which files with bytes may be Pulled
// takes the others for Host without this call.) Errors reading the
// attributes are returned, never taken for "no marker"; a marker whose id
// tensorfs cannot have made is ErrInvalid.
func ReadMarker(path string, st *unix.Stat_t) (Marker, error) {
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return Marker{}, nil
	}
	names, err := listNames(path)
	if err != nil {
		return Marker{}, err
	}
	has := map[string]bool{}
	for _, n := range names {
		has[n] = true
	}
	if has[attrPulled] {
		return readPulled(path)
	}
	if st.Size != 0 {
		return Marker{}, nil
	}
	readID := func(attr string, kind Kind) (Marker, error) {
		id, err := readAttr(path, attr)
		if err != nil {
			return Marker{}, err
		}
		if !validID(id) {
			return Marker{}, fmt.Errorf("%w: the %s marker holds %q, not an id tensorfs makes", ErrInvalid, kind, id)
		}
		return Marker{Kind: kind, ID: id}, nil
	}
	switch {
	case has[attrImport]:
		return readID(attrImport, Imported)
	case has[attrDisk]:
		return readID(attrDisk, Disk)
	case has[StoredName(AttrDevice)]:
		v, err := readAttr(path, StoredName(AttrDevice))
		if err != nil {
			return Marker{}, err
		}
		dev, ok := ParseDevice(v)
		if !ok {
			return Marker{}, fmt.Errorf("%w: the device marker holds %q", ErrInvalid, v)
		}
		if dev == "cpu" {
			return Marker{}, nil
		}
		return Marker{Kind: Device, Device: dev}, nil
	}
	return Marker{}, nil
}

// readPulled reads and checks a Pulled marker.
func readPulled(path string) (Marker, error) {
	v, err := readAttr(path, attrPulled)
	if err != nil {
		return Marker{}, err
	}
	var p pulledValue
	if err := json.Unmarshal([]byte(v), &p); err != nil || !validContent(p.Content) || p.Size < 0 || p.Size > MaxSegmentSize {
		return Marker{}, fmt.Errorf("%w: the pulled marker holds %q", ErrInvalid, v)
	}
	return Marker{Kind: Pulled, Content: p.Content, Size: p.Size, Complete: p.Complete}, nil
}

// validContent reports whether id is "" or a content ID: 64 lowercase hex
// digits (a SHA-256).
func validContent(id string) bool {
	if id == "" {
		return true
	}
	if len(id) != 64 {
		return false
	}
	for _, c := range id {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// MarkPulled records on the regular file at path (a FdPath) that it is a
// Pulled segment: m's Content, Size and Complete.
func MarkPulled(path string, m Marker) error {
	if !validContent(m.Content) || m.Size < 0 {
		return fmt.Errorf("%w: pulled marker content %q, size %d", ErrInvalid, m.Content, m.Size)
	}
	b, _ := json.Marshal(pulledValue{m.Content, m.Size, m.Complete})
	return unix.Setxattr(path, attrPulled, b, 0)
}

// Unmark removes a Pulled marker from the file at path, which becomes a
// Host segment again.
func Unmark(path string) error {
	err := unix.Removexattr(path, attrPulled)
	if errors.Is(err, unix.ENODATA) {
		return nil
	}
	return err
}

// ReadPublished returns what the directory at path records of the
// version published there (MarkPublished), nil if none.
func ReadPublished(path string) ([]byte, error) {
	v, _, err := GetXattr(path, attrPublished)
	return v, err
}

// MarkPublished records on the directory at path the version published
// there, as the caller encodes it.
func MarkPublished(path string, v []byte) error {
	return unix.Setxattr(path, attrPublished, v, 0)
}

// MarkMade records on the directory at path that the daemon made it for
// the published directory dir (a cluster's; DESIGN.md §10). No user can
// set it, so a directory without it is a local one.
func MarkMade(path, dir string) error {
	return unix.Setxattr(path, attrMade, []byte(dir), 0)
}

// ReadMade returns the published directory the directory at path was
// made for (MarkMade), "" if the daemon did not make it for one.
func ReadMade(path string) (string, error) {
	v, _, err := GetXattr(path, attrMade)
	return string(v), err
}

// MarkRemoved records on the directory at path (the backing's root),
// under key (a hex digest the caller derives), v: a published directory
// removed here, as the caller encodes it.
func MarkRemoved(path, key string, v []byte) error {
	return unix.Setxattr(path, attrRemoved+key, v, 0)
}

// UnmarkRemoved forgets the record key of MarkRemoved; one that is not
// there is no error.
func UnmarkRemoved(path, key string) error {
	err := unix.Removexattr(path, attrRemoved+key)
	if errors.Is(err, unix.ENODATA) {
		return nil
	}
	return err
}

// ReadRemoved returns every record MarkRemoved left on the directory at
// path, by key.
func ReadRemoved(path string) (map[string][]byte, error) {
	names, err := listNames(path)
	if err != nil {
		return nil, err
	}
	out := map[string][]byte{}
	for _, name := range names {
		if key, ok := strings.CutPrefix(name, attrRemoved); ok {
			v, found, err := GetXattr(path, name)
			if err != nil {
				return nil, err
			}
			if found {
				out[key] = v
			}
		}
	}
	return out, nil
}

// UnmarkPublished removes the version record MarkPublished left on the
// directory at path; none there is no error.
func UnmarkPublished(path string) error {
	err := unix.Removexattr(path, attrPublished)
	if errors.Is(err, unix.ENODATA) {
		return nil
	}
	return err
}

// MarkImport makes the empty file at path the marker of imported segment id.
func MarkImport(path, id string) error {
	return unix.Setxattr(path, attrImport, []byte(id), 0)
}

// CreateShared makes the disk file of a new SHARED segment whose marker is
// the file at markerPath (a FdPath of the open marker) and whose name in
// the mount is rel, and returns an open descriptor of it (opened with
// flags) and its id.
func (s *Store) CreateShared(markerPath, rel string, flags int, mode uint32) (fd int, id string, err error) {
	id = NewID()
	fd, err = unix.Openat(s.DiskFd, id, flags|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, mode)
	if err != nil {
		return -1, "", fmt.Errorf("create SHARED segment on disk: %w", err)
	}
	if err = unix.Setxattr(FdPath(fd), attrPath, []byte(rel), 0); err == nil {
		err = unix.Setxattr(markerPath, attrDisk, []byte(id), 0)
	}
	if err != nil {
		unix.Close(fd)
		unix.Unlinkat(s.DiskFd, id, 0)
		return -1, "", err
	}
	return fd, id, nil
}

// recoverShared gives every disk file that no marker names a marker at the
// path it recorded, so SHARED segments outlive a purged backing. A path
// that several disk files record is given to none of them: recovery
// cannot tell which is right (one may record a path its segment left
// while a rename's records failed), so each goes beside it,
// name.shared-<id>, for their owners to sort out.
func (s *Store) recoverShared(known map[string]bool) error {
	entries, err := os.ReadDir(FdPath(s.DiskFd))
	if err != nil {
		return err
	}
	type claim struct{ id, rel string }
	var claims []claim
	claimed := map[string]int{}
	for _, e := range entries {
		id := e.Name()
		if known[id] || !e.Type().IsRegular() || !validID(id) {
			continue
		}
		var rel string
		At(s.DiskFd, id, 0, func(p string) error {
			rel, err = readAttr(p, attrPath)
			return err
		})
		claims = append(claims, claim{id, rel})
		claimed[path.Clean("/"+rel)]++
	}
	for _, c := range claims {
		dir, name, ok := splitRel(c.rel)
		if !ok {
			s.log.Warn("recover: disk file without a valid recorded path, left alone", "file", s.DiskPath(c.id), "path", c.rel)
			continue
		}
		aside := claimed[path.Clean("/"+c.rel)] > 1
		if aside {
			s.log.Warn("recover: several disk files record this path; none gets it, each goes beside it", "path", c.rel, "file", s.DiskPath(c.id), "name", name+".shared-"+c.id)
		}
		if err := s.restoreMarker(dir, name, c.id, aside); err != nil {
			s.log.Warn("recover: could not restore SHARED segment", "path", c.rel, "file", s.DiskPath(c.id), "err", err)
			continue
		}
		s.log.Info("recover: restored SHARED segment from disk", "path", c.rel, "file", s.DiskPath(c.id))
	}
	return nil
}

// splitRel splits a recorded segment path into its directories and its
// name, refusing anything that could leave the backing.
func splitRel(rel string) (dirs []string, name string, ok bool) {
	clean := path.Clean("/" + rel)[1:]
	if clean == "" || clean != strings.TrimPrefix(rel, "/") || strings.ContainsRune(rel, 0) {
		return nil, "", false
	}
	parts := strings.Split(clean, "/")
	return parts[:len(parts)-1], parts[len(parts)-1], true
}

// restoreMarker makes the marker of disk file id at dirs/name below the
// backing root, making the directories on the way; nothing on the way is
// followed if it is a symbolic link. A name already taken, or any name
// when aside, gets the marker beside it, name.shared-<id>. A directory made here is the
// daemon's, mode 0711 and without flags: the disk records no directory's
// owner, mode or flags, so no user may list or create in it, and each
// segment is reachable by its path as its own mode allows.
func (s *Store) restoreMarker(dirs []string, name, id string, aside bool) error {
	dirfd, err := unix.Dup(s.RootFd)
	if err != nil {
		return err
	}
	defer func() { unix.Close(dirfd) }()
	for _, d := range dirs {
		if err := unix.Mkdirat(dirfd, d, 0o711); err != nil && !errors.Is(err, unix.EEXIST) {
			return err
		}
		next, err := unix.Openat(dirfd, d, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		unix.Close(dirfd)
		dirfd = next
	}
	if aside {
		name += ".shared-" + id
	}
	fd, err := unix.Openat(dirfd, name, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if errors.Is(err, unix.EEXIST) && !aside {
		name += ".shared-" + id
		fd, err = unix.Openat(dirfd, name, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	}
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Fsetxattr(fd, attrDisk, []byte(id), 0); err != nil {
		unix.Unlinkat(dirfd, name, 0)
		return err
	}
	return nil
}

// DiskPath returns the path of a SHARED segment's disk file, for logs.
func (s *Store) DiskPath(id string) string {
	return s.Disk + "/" + id
}

// RemoveShared deletes a SHARED segment's disk file.
func (s *Store) RemoveShared(id string) error {
	if !validID(id) {
		return fmt.Errorf("%w: disk id %q", ErrInvalid, id)
	}
	err := unix.Unlinkat(s.DiskFd, id, 0)
	if errors.Is(err, syscall.ENOENT) {
		return nil
	}
	return err
}

// RecordSharedPath notes on a SHARED segment's disk file the path rel its
// marker, at markerPath (a FdPath), now has; a no-op for other segments.
func (s *Store) RecordSharedPath(markerPath, rel string) error {
	if s.Disk == "" {
		return nil
	}
	var st unix.Stat_t
	if err := unix.Stat(markerPath, &st); err != nil || st.Size != 0 {
		return err // a disk marker is empty
	}
	m, err := ReadMarker(markerPath, &st)
	if err != nil || m.Kind != Disk {
		return err
	}
	return At(s.DiskFd, m.ID, 0, func(p string) error {
		return unix.Setxattr(p, attrPath, []byte(rel), 0)
	})
}

// NewID returns a random id for a marker.
func NewID() string {
	var b [idLen / 2]byte
	rand.Read(b[:]) // never fails on Linux
	return hex.EncodeToString(b[:])
}
