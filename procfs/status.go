// Package procfs reads what tensorfs uses of /proc/PID/status: a task's
// process, credentials and memory use. It is the one parser of that file,
// and ReadFile reads any file of /proc without waiting on a lease.
package procfs

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
)

// Status is what tensorfs reads of /proc/PID/status.
type Status struct {
	// Tgid is the task's thread group: its process.
	Tgid int
	// Uid and Gid are the real, effective, saved set and filesystem ids.
	Uid, Gid [4]uint32
	// Groups are the supplementary groups.
	Groups []uint32
	// VmRSS and VmHWM are the resident set size and its peak in bytes;
	// 0 for a kernel thread, which has no memory of its own.
	VmRSS, VmHWM int64
}

// ReadFile reads the file of /proc at path (/proc/PID/status, maps,
// comm...) without waiting on a lease. A process's files there belong to
// its owner, who may take a lease on them (fcntl F_SETLEASE), and an open
// that conflicts sleeps until the owner lets go or lease-break-time (45 s)
// passes. The open is made with O_NONBLOCK, so the kernel answers
// EWOULDBLOCK at once: an error wrapping EAGAIN. Reads of /proc files do
// not look at the flag. A process that has exited is an error wrapping
// fs.ErrNotExist.
func ReadFile(path string) ([]byte, error) {
	fd, err := syscall.Open(path, syscall.O_RDONLY|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		if err == syscall.EWOULDBLOCK {
			err = errLeased
		}
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer syscall.Close(fd)
	var b []byte
	for {
		b = slices.Grow(b, 4096)
		n, err := syscall.Read(fd, b[len(b):cap(b)])
		switch {
		case err == syscall.EINTR:
		case err != nil:
			return nil, &os.PathError{Op: "read", Path: path, Err: err}
		case n == 0:
			return b, nil
		default:
			b = b[:len(b)+n]
		}
	}
}

// errLeased is ReadFile's answer when a lease on the file stands in the way.
var errLeased = fmt.Errorf("a lease on the file stands in the way; the daemon does not wait for it to break: %w", syscall.EAGAIN)

// ReadStatus reads /proc/PID/status of pid, a process or a thread of one.
// A process that has exited is an error wrapping fs.ErrNotExist.
func ReadStatus(pid int) (Status, error) {
	b, err := ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return Status{}, err
	}
	s, err := ParseStatus(b)
	if err != nil {
		return Status{}, fmt.Errorf("/proc/%d/status: %w", pid, err)
	}
	return s, nil
}

// errMissing reports a status without a field every task has.
var errMissing = errors.New("missing field")

// ParseStatus parses the text of a /proc/PID/status: lines "Name:\tvalue".
// Lines of other fields are skipped. A malformed value of a field Status
// holds, or a status without Tgid, Uid or Gid, is an error.
func ParseStatus(b []byte) (Status, error) {
	var s Status
	var seen int
	const tgid, uid, gid = 1, 2, 4
	for len(b) > 0 {
		var line []byte
		line, b, _ = bytes.Cut(b, []byte("\n"))
		key, value, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			continue
		}
		var err error
		fields := strings.Fields(string(value))
		switch string(key) {
		case "Tgid":
			seen |= tgid
			s.Tgid, err = parseTgid(fields)
		case "Uid":
			seen |= uid
			err = parseIDs(s.Uid[:], fields)
		case "Gid":
			seen |= gid
			err = parseIDs(s.Gid[:], fields)
		case "Groups":
			s.Groups = nil
			if len(fields) > 0 {
				s.Groups = make([]uint32, len(fields))
				err = parseIDs(s.Groups, fields)
			}
		case "VmRSS":
			s.VmRSS, err = parseKB(fields)
		case "VmHWM":
			s.VmHWM, err = parseKB(fields)
		default:
			continue
		}
		if err != nil {
			return Status{}, fmt.Errorf("%s: %q: %w", key, value, err)
		}
	}
	for _, f := range []struct {
		bit  int
		name string
	}{{tgid, "Tgid"}, {uid, "Uid"}, {gid, "Gid"}} {
		if seen&f.bit == 0 {
			return Status{}, fmt.Errorf("%w %s", errMissing, f.name)
		}
	}
	return s, nil
}

// parseTgid parses a process id: one positive decimal.
func parseTgid(fields []string) (int, error) {
	if len(fields) != 1 {
		return 0, errors.New("want one process id")
	}
	pid, err := strconv.ParseInt(fields[0], 10, 32)
	if err == nil && pid <= 0 {
		err = errors.New("not positive")
	}
	return int(pid), err
}

// parseIDs parses exactly len(ids) user or group ids.
func parseIDs(ids []uint32, fields []string) error {
	if len(fields) != len(ids) {
		return fmt.Errorf("want %d ids, got %d", len(ids), len(fields))
	}
	for i, f := range fields {
		id, err := strconv.ParseUint(f, 10, 32)
		if err != nil {
			return err
		}
		ids[i] = uint32(id)
	}
	return nil
}

// parseKB parses "N kB" into bytes.
func parseKB(fields []string) (int64, error) {
	if len(fields) != 2 || fields[1] != "kB" {
		return 0, errors.New(`want "N kB"`)
	}
	kb, err := strconv.ParseInt(fields[0], 10, 64)
	switch {
	case err != nil:
		return 0, err
	case kb < 0 || kb > math.MaxInt64/1024:
		return 0, errors.New("out of range")
	}
	return kb * 1024, nil
}
