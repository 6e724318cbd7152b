package alloc

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// MaxSegmentSize is the largest size a segment may be truncated to (1 TiB);
// past it a resize fails with ErrTooBig.
const MaxSegmentSize = 1 << 40

// Config says where a store keeps its segments.
type Config struct {
	// Mountpoint is the absolute path the store is mounted at; it names
	// the private backing when Backing is empty.
	Mountpoint string
	// Backing is the backing directory. Empty: a private tmpfs (root) or
	// a directory under /dev/shm (not root), chosen from Mountpoint.
	Backing string
	// Capacity sizes the private tmpfs in bytes; 0 keeps the kernel default.
	Capacity int64
	// Inodes is the private tmpfs's inodes (nr_inodes); 0 keeps the
	// kernel default.
	Inodes int64
	// HugePages mounts the private tmpfs huge=within_size (DESIGN.md §2).
	HugePages bool
	// Disk is where SHARED segments live; empty disables SHARED.
	Disk string
}

// Store is an open backing directory.
type Store struct {
	// Dir is the absolute path of the backing directory.
	Dir string
	// RootFd is an O_PATH descriptor of Dir, valid until Close.
	RootFd int
	// Disk is the directory of SHARED segments, "" if none.
	Disk string
	// DiskFd is an O_PATH descriptor of Disk, -1 if none.
	DiskFd int
	// Private is true when the store mounted its own tmpfs at Dir.
	Private bool
	// HugePages is true when that tmpfs is in huge pages (Config.HugePages,
	// and the kernel has them).
	HugePages bool
	log       *slog.Logger
}

// Open prepares the backing directory described by cfg, mounting a private
// tmpfs when that is the default and we are root, and returns the store.
// The backing belongs to the daemon: it is made in, or must be in, a
// directory that only the daemon's user can enter (a backing's root is
// the mount's root, whose mode users choose). The disk directory is made
// mode 0700. Directories of other users are refused.
func Open(cfg Config, log *slog.Logger) (*Store, error) {
	s := &Store{Dir: cfg.Backing, Disk: cfg.Disk, DiskFd: -1, log: log}
	if s.Dir == "" {
		s.Dir = PrivateBacking(cfg.Mountpoint)
		if err := MakeStateDir(); err != nil {
			return nil, err
		}
		if err := os.Mkdir(s.Dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return nil, fmt.Errorf("create backing %s: %w", s.Dir, err)
		}
		if os.Geteuid() == 0 {
			huge, err := mountTmpfs(s.Dir, cfg.Capacity, cfg.Inodes, cfg.HugePages)
			if err != nil {
				return nil, err
			}
			if cfg.HugePages && !huge {
				log.Warn("--huge-pages: the kernel has no transparent huge pages for tmpfs; segments use 4 KiB pages", "backing", s.Dir)
			}
			s.Private, s.HugePages = true, huge
		} else if cfg.Capacity > 0 {
			log.Warn("--capacity needs root to mount a private tmpfs; segments share /dev/shm's limit", "backing", s.Dir)
		}
	}
	var err error
	if s.Dir, err = filepath.Abs(s.Dir); err != nil {
		return nil, err
	}
	if err := checkPrivateParent(s.Dir); err != nil {
		return nil, err
	}
	if s.RootFd, err = unix.Open(s.Dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0); err != nil {
		return nil, fmt.Errorf("open backing %s: %w", s.Dir, err)
	}
	if err := checkTmpfs(s.RootFd, s.Dir); err != nil {
		unix.Close(s.RootFd)
		return nil, err
	}
	if s.Disk != "" {
		if err := os.MkdirAll(s.Disk, 0o700); err != nil {
			unix.Close(s.RootFd)
			return nil, fmt.Errorf("create disk directory %s: %w", s.Disk, err)
		}
		if s.DiskFd, err = openPrivateDir(s.Disk, "disk directory", log); err == nil {
			s.Disk, err = filepath.Abs(s.Disk)
		}
		if err != nil {
			s.Close()
			return nil, err
		}
	}
	return s, nil
}

// checkPrivateParent refuses a backing directory that a user other than
// the daemon's could reach: it and its parent must belong to the daemon's
// user, and the parent must grant nothing to group or others.
func checkPrivateParent(dir string) error {
	var st, parent unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return fmt.Errorf("backing %s: %w", dir, err)
	}
	if err := unix.Stat(filepath.Dir(dir), &parent); err != nil {
		return fmt.Errorf("backing %s: %w", dir, err)
	}
	euid := uint32(os.Geteuid())
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return fmt.Errorf("backing %s is not a directory", dir)
	case st.Uid != euid:
		return fmt.Errorf("backing %s belongs to uid %d, not to the daemon's user %d", dir, st.Uid, euid)
	case parent.Uid != euid || parent.Mode&0o077 != 0:
		return fmt.Errorf("backing %s: its parent directory (uid %d, mode %#o) lets other users reach the backing; put it in a directory only uid %d can enter (mkdir -m 700)",
			dir, parent.Uid, parent.Mode&0o7777, euid)
	}
	return nil
}

// checkTmpfs refuses a backing, open at fd, that is not on a tmpfs. The
// kernel knows each file by its backing inode's number (fs, ExternalNodeID),
// which a tmpfs never gives out twice; ext4, xfs and most others give a
// removed file's number to the next new one, which a kernel still holding
// the removed one would take for it. SHAREDMEM is shared memory, too.
func checkTmpfs(fd int, dir string) error {
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil {
		return fmt.Errorf("backing %s: %w", dir, err)
	}
	if st.Type == unix.TMPFS_MAGIC {
		return nil
	}
	name := fmt.Sprintf("a filesystem of type %#x", st.Type)
	switch st.Type {
	case unix.EXT4_SUPER_MAGIC:
		name = "ext2/3/4"
	case unix.XFS_SUPER_MAGIC:
		name = "xfs"
	case unix.BTRFS_SUPER_MAGIC:
		name = "btrfs"
	case unix.OVERLAYFS_SUPER_MAGIC:
		name = "overlayfs"
	}
	return fmt.Errorf("backing %s is on %s, not a tmpfs: the kernel knows each segment by its backing inode's number, which only a tmpfs never reuses (and SHAREDMEM is shared memory); give a directory on a tmpfs, or no --backing for a private one", dir, name)
}

// openPrivateDir opens the directory dir for the daemon's use alone: it
// must belong to the daemon's user and is made mode 0700, so that no one
// else can read, plant or replace anything in it. It returns an O_PATH
// descriptor of dir.
func openPrivateDir(dir, what string, log *slog.Logger) (int, error) {
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open %s %s: %w", what, dir, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if int(st.Uid) != os.Geteuid() {
		unix.Close(fd)
		return -1, fmt.Errorf("%s %s belongs to uid %d, not to the daemon's user %d: choose a directory of the daemon's own", what, dir, st.Uid, os.Geteuid())
	}
	if st.Mode&0o7777 != 0o700 {
		if err := unix.Chmod(FdPath(fd), 0o700); err != nil {
			unix.Close(fd)
			return -1, fmt.Errorf("make %s %s private: %w", what, dir, err)
		}
		log.Info("made the directory private to the daemon", "dir", dir, "was", fmt.Sprintf("%#o", st.Mode&0o7777), "now", "0700")
	}
	return fd, nil
}

// Close releases the store's descriptor. The backing keeps its contents.
func (s *Store) Close() error {
	if s.DiskFd >= 0 {
		unix.Close(s.DiskFd)
	}
	return unix.Close(s.RootFd)
}

// MakeStateDir makes the directory of per-mount state (logs, pid files,
// control sockets), mode 0711: others may pass through it to a socket but
// not list it; and in it the directory of private backings, mode 0700.
func MakeStateDir() error {
	for dir, mode := range map[string]os.FileMode{stateDir(): 0o711, backingsDir(): 0o700} {
		if err := os.MkdirAll(dir, mode); err != nil {
			return fmt.Errorf("create %s: %w", dir, err)
		}
		if err := os.Chmod(dir, mode); err != nil {
			return err
		}
	}
	return nil
}

// stateDir is where tensorfs keeps per-mount state.
func stateDir() string {
	if os.Geteuid() == 0 {
		return "/run/tensorfs"
	}
	return filepath.Join("/dev/shm", "tensorfs-"+strconv.Itoa(os.Geteuid()))
}

// backingsDir holds the private backings; only the daemon's user enters it.
func backingsDir() string {
	return filepath.Join(stateDir(), "backing")
}

// mountName names a mountpoint's state: the same mountpoint always maps to
// the same name, so mounting again after a crash finds what it left.
func mountName(mountpoint string) string {
	sum := sha256.Sum256([]byte(mountpoint))
	name := strings.ReplaceAll(strings.Trim(mountpoint, "/"), "/", "-")
	if len(name) > 64 {
		name = name[len(name)-64:]
	}
	return name + "-" + hex.EncodeToString(sum[:4])
}

// PrivateBacking returns the default backing directory for a mountpoint.
func PrivateBacking(mountpoint string) string {
	return filepath.Join(backingsDir(), mountName(mountpoint))
}

// StatePath returns the path of the daemon's state file of mountpoint with
// the extension ext (".sock", ".log", ".pid", ...).
func StatePath(mountpoint, ext string) string {
	return filepath.Join(stateDir(), mountName(mountpoint)+ext)
}

// mountTmpfs mounts a tmpfs of the given size at dir, or resizes the one
// already there (left by an earlier daemon). Either way it is nosuid and
// nodev, and with huge huge=within_size, else huge=never: a segment's whole
// 2 MiB ranges (its size set first, as truncate, save and import do) are
// then huge pages, which a mapping faults in 512 times fewer, and never a
// page past a file's size (DESIGN.md §2). It returns whether the tmpfs is
// in huge pages: a kernel without them for tmpfs gets it mounted without.
func mountTmpfs(dir string, capacity, inodes int64, huge bool) (bool, error) {
	opts := []string{"huge=never"}
	if huge {
		opts[0] = "huge=within_size"
	}
	if capacity > 0 {
		opts = append(opts, "size="+strconv.FormatInt(capacity, 10))
	}
	if inodes > 0 {
		opts = append(opts, "nr_inodes="+strconv.FormatInt(inodes, 10))
	}
	flags, source, what := uintptr(unix.MS_NOSUID|unix.MS_NODEV), "tensorfs-backing", "mount"
	if isMountpoint(dir) {
		flags, source, what = flags|unix.MS_REMOUNT, "tmpfs", "remount"
	} else {
		opts = append(opts, "mode=0755")
	}
	mount := func(opts []string) error { return unix.Mount(source, dir, "tmpfs", flags, strings.Join(opts, ",")) }
	err := mount(opts)
	if err == unix.EINVAL && huge { // a kernel without transparent huge pages
		huge, err = false, mount(opts[1:])
	}
	if err != nil {
		return false, fmt.Errorf("%s backing tmpfs at %s: %w", what, dir, err)
	}
	return huge, nil
}

// isMountpoint reports whether dir is the root of a mount.
func isMountpoint(dir string) bool {
	var st, parent unix.Stat_t
	if unix.Lstat(dir, &st) != nil || unix.Lstat(filepath.Dir(dir), &parent) != nil {
		return false
	}
	return st.Dev != parent.Dev
}

// Purge releases the private backing of mountpoint: the tmpfs is unmounted
// (root) or the directory removed (RemoveTree: however deep its users
// nested directories), with the daemon's reference counter and pid files.
// SHARED segments on disk are kept.
func Purge(mountpoint string) error {
	dir := PrivateBacking(mountpoint)
	if isMountpoint(dir) {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("unmount backing %s: %w", dir, err)
		}
	}
	if err := RemoveTree(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	// The daemon's state beside the backing goes too (a crashed daemon's
	// control socket, and its and its keeper's handover sockets, with
	// it); its log stays.
	for _, ext := range []string{".refcounters", ".pid", ".sock", ".handover", ".keeper"} {
		p := StatePath(mountpoint, ext)
		if isMountpoint(p) { // the counters' own tmpfs, left by a crashed daemon
			if err := unix.Unmount(p, unix.MNT_DETACH); err != nil {
				return fmt.Errorf("unmount %s: %w", p, err)
			}
		}
		if err := RemoveTree(p); err != nil {
			return err
		}
	}
	return nil
}

// Statfs reports the backing's capacity and use.
func (s *Store) Statfs(st *unix.Statfs_t) error {
	return unix.Fstatfs(s.RootFd, st)
}

// Resize sets the size of the open regular file fd. Growth reserves every
// page (fallocate), so a full backing answers ErrNoSpace here rather than
// SIGBUS at first touch of an mmap; on failure the size is unchanged.
func Resize(fd int, size int64) error {
	if size < 0 {
		return fmt.Errorf("%w: negative size %d", ErrInvalid, size)
	}
	if size > MaxSegmentSize {
		return fmt.Errorf("%w: %d bytes is past the maximum of %d", ErrTooBig, size, int64(MaxSegmentSize))
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if size <= st.Size {
		return unix.Ftruncate(fd, size)
	}
	err := unix.Fallocate(fd, 0, 0, size)
	if errors.Is(err, unix.ENOSPC) {
		return fmt.Errorf("%w: cannot reserve %d bytes", ErrNoSpace, size)
	}
	if errors.Is(err, unix.EOPNOTSUPP) {
		// A backing that cannot reserve (not tmpfs): grow sparsely.
		return unix.Ftruncate(fd, size)
	}
	return err
}

// RelPath returns the path within the backing of the object open at fd,
// as the kernel names it now ("" for the backing's root): unlike a path
// kept by the caller, it cannot lag behind a rename. An object no longer
// linked is ENOENT.
func (s *Store) RelPath(fd int) (string, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return "", err
	}
	if st.Nlink == 0 {
		return "", fmt.Errorf("%w: the object is no longer linked", unix.ENOENT)
	}
	root, err := os.Readlink(FdPath(s.RootFd))
	if err != nil {
		return "", err
	}
	p, err := os.Readlink(FdPath(fd))
	if err != nil || p == root {
		return "", err
	}
	rel, ok := strings.CutPrefix(p, root+"/")
	if !ok {
		return "", fmt.Errorf("%w: %s is not below the backing %s", ErrInvalid, p, root)
	}
	return rel, nil
}
