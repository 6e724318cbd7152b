package gpu

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// CounterDir holds consumer reference counters, one file per segment (in
// the spirit of PyTorch's CudaIPCRefCountersFile): the daemon gives a
// consumer the path of a segment's counter; the consumer maps the file and
// atomically increments the little-endian int64 at offset 0 while it uses
// the segment's memory, and decrements it when done. Counter.Value reads
// it, and a Limbo predicate built on it frees the memory at zero.
//
// A counter file is 8 bytes, belongs to the daemon's user, and is never
// set-id. Who may open it is an access ACL that mirrors the classes of its
// segment (Follow): read and write for each class that may read the
// segment, nothing for the others, so that only those who can open a
// segment can change its counter, and no counter changes through another
// segment's file. Only the daemon's user can change a counter's mode,
// owner or ACL; a reader can change its bytes and its size, reserve
// pages past its end (fallocate with FALLOC_FL_KEEP_SIZE) and set user.*
// attributes. Value puts back 8 bytes in one page; New, when the tmpfs is
// full, puts back that and removes the attributes of every counter
// (trim). The directory belongs to the daemon, mode 0711:
// others reach a counter by its path, but cannot list, add, remove or
// replace counters. It must lie outside the FUSE mount (mapping a file of
// its own mount deadlocks the daemon), on a filesystem with POSIX ACLs.
//
// A daemon running as root mounts a tmpfs of its own on the directory
// (counterFSOptions: 64 MiB and 16384 inodes, nosuid, nodev, noexec), so
// that readers who grow their counter files fill that and nothing else.
// A daemon that is not root cannot mount one: its counters lie in the
// directory as it is (under /dev/shm), where a reader who grows one takes
// room until the next Value or New cuts it back; the segments, and so the
// counters, are that user's own.
//
// A counter file the daemon removed (Remove) lives on while a reader
// holds it open or mapped, taking an inode and what that reader reserves
// through a writable descriptor. So Remove first takes every reader's
// access away (no reopen, no attribute set through a descriptor it
// kept), and keeps such a file open (retired) until Sweep finds nobody
// holds it: trim puts retired files back too, through the daemon's
// descriptor, and Remove reports that it let a file go (released) only
// then, so that a bound on the counters of a user bounds the removed
// files they keep too.
//
// The daemon never maps a counter file: a consumer may truncate its
// counter, which then reads as zero rather than fault the daemon.
type CounterDir struct {
	dir     *os.File
	uid     uint32 // the daemon's user, owner of every counter
	mounted bool   // the directory is a tmpfs the daemon mounted
	last    atomic.Uint64
	log     atomic.Pointer[slog.Logger] // for counters put back; see SetLog

	// mu protects the fields below; trim holds it while it lists the
	// directory and puts counters back.
	mu sync.Mutex
	// retired holds the removed counter files a reader still held.
	retired []retiredCounter
	closed  bool // RemoveAll ran: Remove lets every counter go at once
	// heldWarned is set once held has logged that it cannot tell.
	heldWarned atomic.Bool
}

// retiredCounter is a removed counter file that a reader still held
// (Counter.Remove).
type retiredCounter struct {
	fd       int    // the daemon's read-write descriptor
	name     string // its name before it was removed, for warnings
	released func() // Remove's; nil for none
	// linked is its retired name in the directory, where a successor
	// finds it; "" once unlinked.
	linked string
}

// release closes the retired counter file, unlinking its retired name in
// dir, and reports that it is gone.
func (r retiredCounter) release(dir int) {
	if r.linked != "" {
		unix.Unlinkat(dir, r.linked, 0)
	}
	unix.Close(r.fd)
	if r.released != nil {
		r.released()
	}
}

const (
	// counterSize is the size of a counter file: one int64.
	counterSize = 8
	// counterFSOptions are the mount options of the counters' own tmpfs
	// (root only): 64 MiB and 16384 inodes, so 16383 counters of a 4 KiB
	// page each, and a reader who grows a counter can take no more.
	counterFSOptions = "size=64m,nr_inodes=16384,mode=0711"
	// MaxCounters is how many counters the counters' tmpfs holds: its
	// inodes but its root's. The daemon's ledger bounds them below it, so
	// that users who all reach their share meet ENFILE, never a full tmpfs.
	MaxCounters = 16384 - 1
	// counterFSSource names the tmpfs in /proc/mounts.
	counterFSSource = "tensorfs-counters"
)

// OpenCounterDir makes the directory path for counters, or takes over the
// one an earlier daemon left there, removing the counters in it. An
// existing directory must belong to this process's user. As root it mounts
// the counters' own tmpfs there, in place of one a crashed daemon left.
// Warnings go to slog.Default until SetLog names a logger.
func OpenCounterDir(path string) (*CounterDir, error) {
	path, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	if err := unix.Mkdir(path, 0o700); err != nil && !errors.Is(err, unix.EEXIST) {
		return nil, fmt.Errorf("create counter directory %s: %w", path, err)
	}
	d := &CounterDir{uid: uint32(os.Geteuid())}
	d.log.Store(slog.Default())
	if d.dir, err = openOwnDir(path); err != nil {
		return nil, err
	}
	if d.uid == 0 {
		err = d.mount(path)
	}
	if err == nil {
		if err = unix.Fchmod(int(d.dir.Fd()), 0o711); err == nil {
			err = d.empty()
		}
	}
	if err != nil {
		d.dir.Close()
		if d.mounted {
			unix.Unmount(path, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW)
		}
		return nil, fmt.Errorf("counter directory %s: %w", path, err)
	}
	return d, nil
}

// KeepCounterDir is OpenCounterDir for a daemon that takes a live mount
// over (DESIGN.md §12): the counters' tmpfs a predecessor mounted at path
// stays, counters and all, since consumers hold and map its files; the
// caller adopts those its segments name (Adopt) and removes the rest
// (RemoveUnadopted). Without such a tmpfs (no root, or none mounted) it is
// OpenCounterDir.
func KeepCounterDir(path string) (*CounterDir, error) {
	path, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	if os.Geteuid() != 0 {
		return OpenCounterDir(path)
	}
	dir, err := openOwnDir(path)
	if errors.Is(err, unix.ENOENT) {
		return OpenCounterDir(path)
	}
	if err != nil {
		return nil, err
	}
	var stx unix.Statx_t
	var fs unix.Statfs_t
	if unix.Statx(int(dir.Fd()), "", unix.AT_EMPTY_PATH, unix.STATX_BASIC_STATS, &stx) != nil ||
		stx.Attributes&stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 ||
		unix.Fstatfs(int(dir.Fd()), &fs) != nil || fs.Type != unix.TMPFS_MAGIC {
		dir.Close()
		return OpenCounterDir(path)
	}
	d := &CounterDir{dir: dir, uid: 0, mounted: true}
	d.log.Store(slog.Default())
	return d, nil
}

// Adopt takes over the counter file name that a predecessor made: its
// owner, group, mode and ACL as they are, until Follow changes them.
func (d *CounterDir) Adopt(name string) (*Counter, error) {
	if _, err := strconv.ParseUint(name, 10, 64); err != nil {
		return nil, fmt.Errorf("%w: counter name %q", ErrInvalid, name)
	}
	fd, err := unix.Openat(int(d.dir.Fd()), name, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("adopt counter %s: %w", name, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Uid != d.uid {
		unix.Close(fd)
		return nil, fmt.Errorf("adopt counter %s: not a counter file of the daemon's (%v)", name, err)
	}
	c := &Counter{dir: d, name: name, fd: fd, gid: st.Gid, mode: st.Mode & 0o7777}
	acl := make([]byte, 256)
	if n, err := unix.Fgetxattr(fd, aclXattr, acl); err == nil {
		c.acl = acl[:n]
	}
	return c, nil
}

// RemoveUnadopted removes the counter files a predecessor left that no
// segment of this daemon adopted: nothing they count protects memory any
// more. New counters are numbered after the last it kept. With charge
// (a successor's), a file a reader still holds, open or mapped, is not
// let go but kept retired, as Remove keeps one, under its retired name
// (retiredPrefix), its reader's access taken away, charged (charge) to
// the uid it was made for (Charge) until Sweep finds nobody holds it: the
// predecessor's retired files among them, which it kept by that name. A
// file unlinked while a reader held it would keep what she reserves
// through it (up to the whole tmpfs) where no trim can put it back, and
// charged to nobody.
func (d *CounterDir) RemoveUnadopted(adopted map[string]bool, charge func(uid uint32) (released func())) error {
	names, err := d.names()
	if err != nil {
		return err
	}
	for _, name := range names {
		if n, err := strconv.ParseUint(strings.TrimPrefix(name, retiredPrefix), 10, 64); err == nil && n > d.last.Load() {
			d.last.Store(n) // no new counter takes a kept one's name, or its retired name
		}
		if adopted[name] {
			continue
		}
		if charge != nil && d.keepRetired(name, charge) {
			continue
		}
		if err := unix.Unlinkat(int(d.dir.Fd()), name, 0); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("remove %s: %w", name, err)
		}
	}
	return nil
}

// retiredPrefix starts the name under which a removed counter file that
// a reader still holds stays in the directory (retire), so that a
// successor finds it (RemoveUnadopted).
const retiredPrefix = "r"

// chargeXattr records, on a counter file of a root daemon, the uid whose
// bound of counters it counts against (Charge), for a successor that
// keeps it retired; trusted.*, which no reader can set or remove.
const chargeXattr = "trusted.tensorfs.charge"

// Charge records uid as the user the counter counts against, for a
// successor that finds it retired (RemoveUnadopted). Only a root
// daemon's counters, which a successor keeps, record it.
func (c *Counter) Charge(uid uint32) error {
	if c.dir.uid != 0 {
		return nil
	}
	return unix.Fsetxattr(c.fd, chargeXattr, []byte(strconv.FormatUint(uint64(uid), 10)), 0)
}

// chargedUID returns the uid the counter file open at fd records
// (Charge); the daemon's user (root) for none.
func chargedUID(fd int) uint32 {
	b := make([]byte, 16)
	n, err := unix.Fgetxattr(fd, chargeXattr, b)
	if err != nil {
		return 0
	}
	uid, err := strconv.ParseUint(string(b[:n]), 10, 32)
	if err != nil {
		return 0
	}
	return uint32(uid)
}

// keepRetired keeps the predecessor's counter file name retired if a
// reader still holds it (see RemoveUnadopted) and reports whether it did;
// false, for the caller to remove it, if nobody does or it is not a
// counter file of the daemon's.
func (d *CounterDir) keepRetired(name string, charge func(uid uint32) (released func())) bool {
	fd, err := unix.Openat(int(d.dir.Fd()), name, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Uid != d.uid {
		unix.Close(fd)
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed || !d.held(fd) {
		unix.Close(fd)
		return false
	}
	orig := strings.TrimPrefix(name, retiredPrefix)
	r := retiredCounter{fd: fd, name: orig, linked: name}
	if name == orig {
		r.linked = retiredPrefix + name
		if err := unix.Renameat2(int(d.dir.Fd()), name, int(d.dir.Fd()), r.linked, unix.RENAME_NOREPLACE); err != nil {
			unix.Close(fd)
			return false
		}
	}
	r.released = charge(chargedUID(fd))
	d.retired = append(d.retired, r)
	return true
}

// openOwnDir opens the directory path, which must not be a symbolic link
// and must belong to this process's user.
func openOwnDir(path string) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open counter directory %s: %w", path, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, err
	}
	if int(st.Uid) != os.Geteuid() {
		unix.Close(fd)
		return nil, fmt.Errorf("counter directory %s belongs to uid %d, not to the daemon's user %d: remove it", path, st.Uid, os.Geteuid())
	}
	return os.NewFile(uintptr(fd), path), nil
}

// mount mounts the counters' tmpfs on the directory path, whose
// descriptor d.dir is, and makes d.dir its root. A tmpfs a crashed daemon
// left there is detached first (consumers keep what they mapped), and
// counters left in the directory beneath are removed.
func (d *CounterDir) mount(path string) error {
	var stx unix.Statx_t
	if err := unix.Statx(int(d.dir.Fd()), "", unix.AT_EMPTY_PATH, unix.STATX_BASIC_STATS, &stx); err != nil {
		return err
	}
	if stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT != 0 && stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0 {
		var fs unix.Statfs_t
		if err := unix.Fstatfs(int(d.dir.Fd()), &fs); err != nil {
			return err
		}
		if fs.Type != unix.TMPFS_MAGIC {
			return fmt.Errorf("a filesystem of type %#x is mounted there, not a tmpfs of counters: unmount it", fs.Type)
		}
		if err := unix.Unmount(path, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW); err != nil {
			return fmt.Errorf("detach the counters of an earlier daemon: %w", err)
		}
		if err := d.reopen(path); err != nil {
			return err
		}
	}
	if err := d.empty(); err != nil {
		return err
	}
	opts := fmt.Sprintf("%s,uid=%d,gid=%d", counterFSOptions, os.Geteuid(), os.Getegid())
	if err := unix.Mount(counterFSSource, path, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, opts); err != nil {
		return fmt.Errorf("mount tmpfs: %w", err)
	}
	d.mounted = true
	return d.reopen(path)
}

// reopen makes d.dir the directory now at path.
func (d *CounterDir) reopen(path string) error {
	f, err := openOwnDir(path)
	if err != nil {
		return err
	}
	d.dir.Close()
	d.dir = f
	return nil
}

// SetLog names the logger that warns of counter files put back (Value).
func (d *CounterDir) SetLog(log *slog.Logger) { d.log.Store(log) }

// empty removes every counter in the directory.
func (d *CounterDir) empty() error { return d.RemoveUnadopted(nil, nil) }

// names lists the directory.
func (d *CounterDir) names() ([]string, error) {
	if _, err := d.dir.Seek(0, 0); err != nil {
		return nil, err
	}
	return d.dir.Readdirnames(-1)
}

// New makes a counter set to zero, for the daemon's user alone until
// Follow gives it a segment's access. When the counters' tmpfs is full
// (ENOSPC, of pages or of its inodes' room) it puts back what readers
// took through their counter files (trim) and tries again.
func (d *CounterDir) New() (*Counter, error) {
	name := strconv.FormatUint(d.last.Add(1), 10)
	fd := -1
	create := func() (err error) {
		fd, err = unix.Openat(int(d.dir.Fd()), name, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		return err
	}
	err := create()
	if errors.Is(err, unix.ENOSPC) {
		err = d.trim(create)
	}
	if err != nil {
		return nil, fmt.Errorf("create counter %s: %w", name, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, err
	}
	c := &Counter{dir: d, name: name, fd: fd, gid: st.Gid, mode: 0o600}
	// The mode again, explicitly: the daemon's umask plays no part. The
	// bytes are written, not left a hole, so that the page is there: a
	// consumer of a full tmpfs would fault on its first increment.
	err = unix.Fchmod(fd, c.mode)
	if err == nil {
		err = c.zero()
	}
	if errors.Is(err, unix.ENOSPC) {
		err = d.trim(c.zero)
	}
	if err != nil {
		c.Remove(nil)
		return nil, fmt.Errorf("create counter %s: %w", name, err)
	}
	return c, nil
}

// trim puts back, in every counter file, retired ones too, what a reader
// took of the counters' tmpfs through it (putBack), and reports the files
// in one warning. retry is what failed with ENOSPC; trim calls it again
// right after each file it puts back, until it succeeds, so that a reader
// who refills the tmpfs in a loop cannot take the freed room first. It
// returns retry's last error, ENOSPC if there was nothing to put back.
func (d *CounterDir) trim(retry func() error) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	names, err := d.names()
	if err != nil {
		return fmt.Errorf("%w (and listing the counters to cut back: %v)", unix.ENOSPC, err)
	}
	err = unix.ENOSPC
	var cut, cutRemoved []string
	for _, name := range names {
		if strings.HasPrefix(name, retiredPrefix) {
			continue // retired: through its descriptor, below
		}
		if d.putBack(name) {
			cut = append(cut, name)
			if errors.Is(err, unix.ENOSPC) {
				err = retry()
			}
		}
	}
	for _, r := range d.retired {
		if putBackFile(r.fd) {
			cutRemoved = append(cutRemoved, r.name)
			if errors.Is(err, unix.ENOSPC) {
				err = retry()
			}
		}
	}
	if len(cut)+len(cutRemoved) > 0 {
		args := []any{"dir", d.dir.Name(), "files", strings.Join(cut, ",")}
		if len(cutRemoved) > 0 { // still held by a reader
			args = append(args, "removed", strings.Join(cutRemoved, ","))
		}
		d.log.Load().Warn("counters' tmpfs full; put back what consumers took through their counter files (pages past the counter's, user.* attributes)", args...)
	}
	return err
}

// putBack puts back the counter file name (putBackFile) and reports
// whether it held anything to put back.
func (d *CounterDir) putBack(name string) bool {
	fd, err := unix.Openat(int(d.dir.Fd()), name, unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	return putBackFile(fd)
}

// putBackFile frees what the counter file open for writing at fd holds
// beyond an 8-byte counter, and reports whether it held any: pages past
// its first (cutBack), and user.* extended attributes, which a reader may
// set (write permission is all tmpfs asks) and tmpfs charges to the room
// its inodes share, so that enough of them leave none for a new counter.
func putBackFile(fd int) bool {
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return false
	}
	put := excess(&st) && cutBack(fd, &st) == nil
	return removeUserXattrs(fd) || put
}

// excess reports whether a counter file whose stat is st holds more than
// an 8-byte counter needs: bytes past the 8, or more than one page, such
// as pages that fallocate(FALLOC_FL_KEEP_SIZE) reserved past its end.
func excess(st *unix.Stat_t) bool {
	return st.Size > counterSize || st.Blocks*512 > int64(os.Getpagesize())
}

// cutBack frees every page of the counter file open at fd, whose stat is
// st, past its first 8 bytes, and keeps those: it truncates the file to
// 8 bytes, or to its size if shorter. On tmpfs a truncate frees every
// page past the new size, those past the old size too (a truncate to the
// same size frees just those).
func cutBack(fd int, st *unix.Stat_t) error {
	return unix.Ftruncate(fd, min(st.Size, counterSize))
}

// removeUserXattrs removes every user.* extended attribute of the file
// open at fd and reports whether it removed any.
func removeUserXattrs(fd int) bool {
	var buf []byte
	for range 3 { // a reader may add names meanwhile (ERANGE)
		n, err := unix.Flistxattr(fd, nil)
		if err != nil || n == 0 {
			return false
		}
		buf = make([]byte, n)
		if n, err = unix.Flistxattr(fd, buf); err == nil {
			buf = buf[:n]
			break
		}
		buf = nil
	}
	removed := false
	for name := range strings.SplitSeq(string(buf), "\x00") {
		if strings.HasPrefix(name, "user.") && unix.Fremovexattr(fd, name) == nil {
			removed = true
		}
	}
	return removed
}

// Sweep lets go of the retired counter files (Counter.Remove) that
// nobody holds any more: it closes them and calls their released. The
// daemon calls it now and then.
func (d *CounterDir) Sweep() {
	d.mu.Lock()
	var free []retiredCounter
	kept := d.retired[:0]
	for _, r := range d.retired {
		if d.held(r.fd) {
			kept = append(kept, r)
		} else {
			free = append(free, r)
		}
	}
	clear(d.retired[len(kept):])
	d.retired = kept
	d.mu.Unlock()
	for _, r := range free {
		r.release(int(d.dir.Fd()))
	}
}

// held reports whether a reader still holds the removed counter file
// whose daemon's read-write descriptor is fd, open or mapped. It first
// takes every reader's access away: mode 0600, whose group bits leave the
// ACL's mask, and so its named user and group entries, nothing; so that
// nobody opens the file again (through an O_PATH descriptor or a bind
// mount, which keep it without opening it, and the test below cannot
// see), or sets attributes on it through a descriptor it kept. Then it
// asks for a write lease, which the kernel grants the file's owner only
// when no other file description of it is open (a mapping keeps its
// own), and gives it up at once. A refused lease reads as held, and so
// does one the daemon cannot ask (leases-enable 0), which it logs once.
func (d *CounterDir) held(fd int) bool {
	err := unix.Fchmod(fd, 0o600)
	if err == nil {
		_, err = unix.FcntlInt(uintptr(fd), unix.F_SETLEASE, unix.F_WRLCK)
	}
	if err != nil {
		if !errors.Is(err, unix.EAGAIN) && !d.heldWarned.Swap(true) {
			d.log.Load().Warn("removed reference counter files are kept until the daemon ends: it cannot tell whether a consumer still holds them", "dir", d.dir.Name(), "err", err)
		}
		return true
	}
	unix.FcntlInt(uintptr(fd), unix.F_SETLEASE, unix.F_UNLCK)
	return false
}

// RemoveAll removes the counters and the directory (unmounting the
// counters' tmpfs, if the daemon mounted it), when the daemon is done,
// and lets go of the retired counters. Counters keep working for the
// daemon (their Remove then has nothing left to remove, and lets go at
// once), and consumers keep their mappings.
func (d *CounterDir) RemoveAll() error {
	d.mu.Lock()
	d.closed = true
	free := d.retired
	d.retired = nil
	err := d.empty()
	d.mu.Unlock()
	for _, r := range free {
		r.linked = "" // empty removed it
		r.release(int(d.dir.Fd()))
	}
	if err != nil {
		return err
	}
	if d.mounted {
		if err := unix.Unmount(d.dir.Name(), unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW); err != nil {
			return fmt.Errorf("unmount counters %s: %w", d.dir.Name(), err)
		}
	}
	return os.Remove(d.dir.Name())
}

// Counter is one consumer reference counter, an 8-byte file in a
// CounterDir. Its methods are not safe for concurrent use.
type Counter struct {
	dir  *CounterDir
	name string
	fd   int // -1 once removed

	// What Follow last gave the file, which Value puts back: its group,
	// its permission bits and its access ACL (nil before Follow).
	gid    uint32
	mode   uint32
	acl    []byte
	warned bool // a change behind the daemon's back was logged
}

// Path is the counter file's absolute path, for consumers.
func (c *Counter) Path() string { return filepath.Join(c.dir.dir.Name(), c.name) }

// Value reads the counter. A counter file that a consumer shortened reads
// as zero, as if it had stored zero. A file found at another size than 8
// bytes, or holding pages past its first, is put back to 8 bytes in one
// page (its first 8 bytes kept, or zero), and one whose owner or mode
// changed gets those Follow gave it; the first such repair of each file
// is logged as a warning.
func (c *Counter) Value() int64 {
	var st unix.Stat_t
	if err := unix.Fstat(c.fd, &st); err == nil {
		c.repair(&st)
	}
	var b [counterSize]byte
	if n, err := unix.Pread(c.fd, b[:], 0); err != nil || n < len(b) {
		return 0
	}
	return int64(binary.LittleEndian.Uint64(b[:]))
}

// repair puts back the size, pages, owner and mode of a counter file
// whose stat is st.
func (c *Counter) repair(st *unix.Stat_t) {
	var what []string
	var err error
	if excess(st) || st.Size < counterSize {
		if st.Size != counterSize {
			what = append(what, "size")
		} else {
			what = append(what, "pages")
		}
		err = cutBack(c.fd, st)
		if err == nil && st.Size < counterSize {
			err = c.zero()
		}
	}
	if st.Uid != c.dir.uid || st.Gid != c.gid || st.Mode&0o7777 != c.mode {
		what = append(what, "owner or mode")
		if aerr := c.apply(st); err == nil {
			err = aerr
		}
	}
	if len(what) == 0 || c.warned {
		return
	}
	c.warned = true
	args := []any{"file", c.Path(), "changed", strings.Join(what, ", "), "size", st.Size, "uid", st.Uid, "gid", st.Gid, "mode", fmt.Sprintf("%#o", st.Mode&0o7777)}
	if err != nil {
		args = append(args, "err", err)
	}
	c.dir.log.Load().Warn("reference counter file changed behind the daemon; put back", args...)
}

// zero writes the counter's 8 bytes as zero.
func (c *Counter) zero() error {
	n, err := unix.Pwrite(c.fd, make([]byte, counterSize), 0)
	if err == nil && n < counterSize {
		err = unix.ENOSPC
	}
	return err
}

// Follow gives the counter the access of a segment whose owner is uid,
// whose group is gid and whose mode is mode: read and write to each class
// (owner, group, others) that mode lets read, none to the others, by an
// access ACL on a file that stays the daemon's (see counterACL). The file
// takes the segment's group, so that the ACL's group class is the
// segment's; while the group changes, the counter is closed to all but
// the daemon, so that no class gains access it had neither before nor
// after.
func (c *Counter) Follow(uid, gid, mode uint32) error {
	acl, fileMode := counterACL(c.dir.uid, uid, mode)
	var st unix.Stat_t
	if err := unix.Fstat(c.fd, &st); err != nil {
		return err
	}
	if st.Uid == c.dir.uid && st.Gid == gid && st.Mode&0o7777 == fileMode && bytes.Equal(acl, c.acl) {
		return nil
	}
	c.gid, c.mode, c.acl = gid, fileMode, acl
	return c.apply(&st)
}

// apply gives the file, whose stat is st, the owner, group, mode and ACL
// that c records.
func (c *Counter) apply(st *unix.Stat_t) error {
	if st.Uid != c.dir.uid || st.Gid != c.gid {
		if err := unix.Fchmod(c.fd, 0o600); err != nil {
			return err
		}
		if err := unix.Fchown(c.fd, int(c.dir.uid), int(c.gid)); err != nil {
			return err
		}
	}
	if err := unix.Fchmod(c.fd, c.mode); err != nil || c.acl == nil { // clears set-id bits an ACL keeps
		return err
	}
	if err := unix.Fsetxattr(c.fd, aclXattr, c.acl, 0); err != nil {
		return fmt.Errorf("set the access ACL: %w", err)
	}
	return nil
}

// Remove deletes the counter file, takes every reader's access to it
// away, and calls released (unless nil) once nobody holds it open or
// mapped: at once if nobody does, else from the Sweep that first finds
// so, or from RemoveAll. Until then the CounterDir keeps the file open,
// retired, under its retired name, where a successor finds and keeps it
// (RemoveUnadopted), and trim puts back what a reader reserves through
// it. Readers who mapped it keep their mappings.
func (c *Counter) Remove(released func()) error {
	err := c.dir.retire(retiredCounter{fd: c.fd, name: c.name, released: released})
	c.fd = -1
	return err
}

// retire removes the counter file r and keeps it while a reader holds
// it: under its retired name (retiredPrefix), which a successor finds,
// not unlinked, so that what a reader reserves through it can be put
// back by this daemon and any after it. It lets it go otherwise.
func (d *CounterDir) retire(r retiredCounter) error {
	dir := int(d.dir.Fd())
	d.mu.Lock()
	if !d.closed && d.held(r.fd) { // held took every reader's access away
		r.linked = retiredPrefix + r.name
		err := unix.Renameat2(dir, r.name, dir, r.linked, unix.RENAME_NOREPLACE)
		if err != nil {
			r.linked = ""
			if err = unix.Unlinkat(dir, r.name, 0); errors.Is(err, unix.ENOENT) {
				err = nil // RemoveAll came first
			}
		}
		d.retired = append(d.retired, r)
		d.mu.Unlock()
		return err
	}
	d.mu.Unlock()
	err := unix.Unlinkat(dir, r.name, 0)
	if errors.Is(err, unix.ENOENT) {
		err = nil // RemoveAll came first
	}
	r.release(dir)
	return err
}

// POSIX access ACLs as the kernel takes them in the system.posix_acl_access
// extended attribute (linux/posix_acl_xattr.h): a little-endian uint32
// version, then one entry per class, each a uint16 tag, a uint16 permission
// set and a uint32 user or group id, in the order of the tags, named ones
// by id.
const (
	aclXattr       = "system.posix_acl_access"
	aclVersion     = 2
	aclUserObj     = 0x01 // the file's owner
	aclUser        = 0x02 // a named user
	aclGroupObj    = 0x04 // the file's group
	aclMask        = 0x10 // the most the named entries and the group get
	aclOther       = 0x20 // everyone else
	aclUndefinedID = 0xffffffff
	aclRW          = 0o6 // read and write
)

// aclEntry is one entry of a POSIX ACL.
type aclEntry struct {
	tag, perm uint16
	id        uint32
}

// encodeACL returns the system.posix_acl_access value of entries, which
// must be in the kernel's order (by tag, named ones by id).
func encodeACL(entries []aclEntry) []byte {
	b := binary.LittleEndian.AppendUint32(nil, aclVersion)
	for _, e := range entries {
		b = binary.LittleEndian.AppendUint16(b, e.tag)
		b = binary.LittleEndian.AppendUint16(b, e.perm)
		b = binary.LittleEndian.AppendUint32(b, e.id)
	}
	return b
}

// counterACL returns the access ACL of a counter file owned by owner (the
// daemon's user) whose segment's owner is uid and mode is mode, with the
// file's group the segment's, and the permission bits the file then has.
// Each class gets read and write when mode lets it read the segment, and
// nothing otherwise, as POSIX checks classes: the segment's owner by a
// named user entry (rw- or ---, so that an owner refused the segment is
// refused its counter even where group or others may read), the group by
// the file's own group entry, others by the other entry. The mask lets
// them all be; the daemon's user keeps rw-, as its own file.
func counterACL(owner, uid, mode uint32) (acl []byte, fileMode uint32) {
	class := func(read uint32) uint16 {
		if mode&read != 0 {
			return aclRW
		}
		return 0
	}
	entries := []aclEntry{{aclUserObj, aclRW, aclUndefinedID}}
	if uid != owner { // the daemon's user has its own entry
		entries = append(entries, aclEntry{aclUser, class(0o400), uid})
	}
	entries = append(entries,
		aclEntry{aclGroupObj, class(0o040), aclUndefinedID},
		aclEntry{aclMask, aclRW, aclUndefinedID},
		aclEntry{aclOther, class(0o004), aclUndefinedID})
	return encodeACL(entries), 0o660 | uint32(class(0o004))
}

// Name is the counter file's name in its CounterDir, for Adopt.
func (c *Counter) Name() string { return c.name }
