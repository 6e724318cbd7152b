package gpu

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
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
// A counter file has the owner and group of its segment and gives read
// and write to exactly the classes that may read the segment (Follow):
// only those who can open a segment can change its counter, and no counter
// changes through another segment's file. The directory belongs to the
// daemon, mode 0711: others reach a counter by its path, but cannot list,
// add, remove or replace counters. It must lie outside the FUSE mount
// (mapping a file of its own mount deadlocks the daemon).
//
// The daemon never maps a counter file: a consumer may truncate its
// counter, which then reads as zero rather than fault the daemon.
type CounterDir struct {
	dir  *os.File
	last atomic.Uint64 // the last counter number handed out
}

// OpenCounterDir makes the directory path for counters, or takes over the
// one an earlier daemon left there, removing the counters in it. An
// existing directory must belong to this process's user.
func OpenCounterDir(path string) (*CounterDir, error) {
	path, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	if err := unix.Mkdir(path, 0o700); err != nil && !errors.Is(err, unix.EEXIST) {
		return nil, fmt.Errorf("create counter directory %s: %w", path, err)
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open counter directory %s: %w", path, err)
	}
	dir := os.NewFile(uintptr(fd), path)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		dir.Close()
		return nil, err
	}
	if int(st.Uid) != os.Geteuid() {
		dir.Close()
		return nil, fmt.Errorf("counter directory %s belongs to uid %d, not to the daemon's user %d: remove it", path, st.Uid, os.Geteuid())
	}
	d := &CounterDir{dir: dir}
	if err := unix.Fchmod(fd, 0o711); err == nil {
		err = d.empty()
	}
	if err != nil {
		dir.Close()
		return nil, fmt.Errorf("counter directory %s: %w", path, err)
	}
	return d, nil
}

// empty removes every counter in the directory.
func (d *CounterDir) empty() error {
	if _, err := d.dir.Seek(0, 0); err != nil {
		return err
	}
	names, err := d.dir.Readdirnames(-1)
	if err != nil {
		return err
	}
	for _, name := range names {
		if err := unix.Unlinkat(int(d.dir.Fd()), name, 0); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("remove %s: %w", name, err)
		}
	}
	return nil
}

// New makes a counter set to zero, for the daemon's user alone until
// Follow gives it a segment's access.
func (d *CounterDir) New() (*Counter, error) {
	name := strconv.FormatUint(d.last.Add(1), 10)
	fd, err := unix.Openat(int(d.dir.Fd()), name, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("create counter %s: %w", name, err)
	}
	c := &Counter{dir: d, name: name, fd: fd}
	// The mode again, explicitly: the daemon's umask plays no part.
	if err := unix.Fchmod(fd, 0o600); err == nil {
		err = unix.Ftruncate(fd, 8)
	}
	if err != nil {
		c.Remove()
		return nil, fmt.Errorf("create counter %s: %w", name, err)
	}
	return c, nil
}

// RemoveAll removes the directory and the counters in it, when the
// daemon is done. Counters keep working for the daemon (their Remove then
// has nothing left to remove), and consumers keep their mappings.
func (d *CounterDir) RemoveAll() error {
	if err := d.empty(); err != nil {
		return err
	}
	return os.Remove(d.dir.Name())
}

// Counter is one consumer reference counter, an 8-byte file in a
// CounterDir. Its methods are not safe for concurrent use.
type Counter struct {
	dir  *CounterDir
	name string
	fd   int // -1 once removed
}

// Path is the counter file's absolute path, for consumers.
func (c *Counter) Path() string { return filepath.Join(c.dir.dir.Name(), c.name) }

// Value reads the counter. A counter file that a consumer shortened reads
// as zero, as if it had stored zero.
func (c *Counter) Value() int64 {
	var b [8]byte
	if n, err := unix.Pread(c.fd, b[:], 0); err != nil || n < len(b) {
		return 0
	}
	return int64(binary.LittleEndian.Uint64(b[:]))
}

// Follow gives the counter the owner and group of a segment whose mode is
// mode, and read and write permission for each class (owner, group,
// others) that mode lets read. While the owner or group changes, the
// counter is closed to all but root, so that no class gains access it
// had neither before nor after.
func (c *Counter) Follow(uid, gid, mode uint32) error {
	var want uint32
	for _, r := range []uint32{0o400, 0o040, 0o004} {
		if mode&r != 0 {
			want |= r | r>>1 // read and write
		}
	}
	var st unix.Stat_t
	if err := unix.Fstat(c.fd, &st); err != nil {
		return err
	}
	if st.Uid != uid || st.Gid != gid {
		if err := unix.Fchmod(c.fd, 0); err != nil {
			return err
		}
		if err := unix.Fchown(c.fd, int(uid), int(gid)); err != nil {
			return err
		}
	} else if st.Mode&0o7777 == want {
		return nil
	}
	return unix.Fchmod(c.fd, want)
}

// Remove deletes the counter file. Consumers that have it open or mapped
// keep it; the daemon no longer reads it.
func (c *Counter) Remove() error {
	err := unix.Unlinkat(int(c.dir.dir.Fd()), c.name, 0)
	if errors.Is(err, unix.ENOENT) {
		err = nil // RemoveAll came first
	}
	if cerr := unix.Close(c.fd); err == nil {
		err = cerr
	}
	c.fd = -1
	return err
}
