package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

var (
	mMmapCold  = metricDef{"mmap cold touch, one byte per page", "GiB/s", true}
	mMmapWarm  = metricDef{"mmap warm sum, every byte", "GiB/s", true}
	mMmapSet   = metricDef{"mmap memset + msync", "GiB/s", true}
	mOpenBig   = metricDef{"open() of the cached mmap segment", "µs", false}
	mOpenSmall = metricDef{"open() of a cached 4 KiB segment", "µs", false}
	// mOpenFloor is the round-trip floor for the open() cases: one
	// getxattr that tensorfs answers from memory, timed alone after the
	// same reads as an open().
	mOpenFloor = metricDef{"getxattr user.tensorfs.flags after the same reads, the floor", "µs", false}
)

const pageSize = 4096

// openSamples is how many open() timings each round takes per segment,
// each right after reading both segments.
const openSamples = 3

// sink keeps the sums of the mmap cases alive.
var sink uint64

// groupMmap maps one large segment per contender: first touch of every
// page of a fresh mapping, a sum over the now mapped bytes, memset and
// msync; then open() of it and of a 4 KiB segment right after both were
// read into the cache: open() must not cost in proportion to size. The
// large segments are written side by side, 1 MiB to each in turn, so
// that their pages are allocated at the same times: written one after
// the other, the one written first faulted in more slowly.
func (b *bench) groupMmap() error {
	cs, err := b.start(tmpfsName, ptName, classicName)
	if err != nil {
		return err
	}
	defer b.stop(cs)
	size := b.cfg.mmapSize
	var bigs []string
	for _, c := range cs {
		bigs = append(bigs, filepath.Join(c.dir, "big.seg"))
		if err := writeFile(filepath.Join(c.dir, "small.seg"), 4*kiB); err != nil {
			return err
		}
	}
	if err := writeFiles(bigs, size); err != nil {
		return err
	}
	if err := b.tmpfsFact(filepath.Join(named(cs, tmpfsName).dir, "big.seg"), filepath.Join(named(cs, ptName).dir, "big.seg")); err != nil {
		return err
	}
	return b.warmRounds(cs, func(c *contender) error {
		big := filepath.Join(c.dir, "big.seg")
		if err := b.mmapRound(c, big, size); err != nil {
			return err
		}
		small := filepath.Join(c.dir, "small.seg")
		for range openSamples {
			for _, o := range []struct {
				m    metricDef
				path string
				op   func(string) (time.Duration, error)
			}{{mOpenBig, big, timeOpen}, {mOpenSmall, small, timeOpen}, {mOpenFloor, small, timeFloor(c)}} {
				// Both cached, and the same work before either open.
				for _, p := range []string{small, big} {
					if _, err := readFile(p); err != nil {
						return err
					}
				}
				err := b.observe(c, caseOf[o.m], func() (int64, error) {
					d, err := o.op(o.path)
					b.res.add(o.m, c.name, float64(d.Nanoseconds())/1e3)
					return 0, err
				})
				if err != nil {
					return err
				}
			}
		}
		return nil
	})
}

// tmpfsFact records the mount options of the two tmpfs that hold the
// mmap case's pages, the bench's (the file at plain) and passthrough's
// backing (the file behind seg), the kernel's huge page setting for
// shared memory and the NUMA nodes: a difference would favour one of them.
func (b *bench) tmpfsFact(plain, seg string) error {
	backing, err := getxattr(seg, "user.tensorfs.handle")
	if err != nil {
		return err
	}
	ours, err := mountOf(plain)
	if err != nil {
		return err
	}
	theirs, err := mountOf(backing)
	if err != nil {
		return err
	}
	huge, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
	if err != nil {
		huge = []byte("unreadable")
	}
	nodes, err := os.ReadFile("/sys/devices/system/node/online")
	if err != nil {
		nodes = []byte("unreadable")
	}
	set := "neither mount sets huge="
	if strings.Contains(ours+theirs, "huge=") {
		set = "see their huge= options"
	}
	b.res.facts = append(b.res.facts, fmt.Sprintf("mmap: the segments are written side by side, 1 MiB to each in "+
		"turn; the tmpfs contender's pages are on %s, passthrough's on "+
		"its backing %s; /sys/kernel/mm/transparent_hugepage/shmem_enabled: %s; %s; NUMA nodes online: %s",
		ours, theirs, strings.TrimSpace(string(huge)), set, strings.TrimSpace(string(nodes))))
	return nil
}

// mmapRound maps path afresh and runs the three mmap cases on it. The
// FUSE page cache of the classic mount is dropped first, so that its
// touch is cold too (on tmpfs and in passthrough the pages are the file).
func (b *bench) mmapRound(c *contender, path string, size int64) error {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Fadvise(fd, 0, 0, unix.FADV_DONTNEED); err != nil {
		return err
	}
	var m []byte
	gib := float64(size) / giB
	err = b.observe(c, "mmap cold touch", func() (int64, error) {
		var err error
		if m, err = unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err != nil {
			return 0, err
		}
		t := time.Now()
		var s uint64
		for i := 0; i < len(m); i += pageSize {
			s += uint64(m[i])
		}
		b.res.add(mMmapCold, c.name, gib/time.Since(t).Seconds())
		sink += s
		return size, nil
	})
	if err != nil {
		return err
	}
	defer unix.Munmap(m)
	err = b.observe(c, "mmap warm sum", func() (int64, error) {
		t := time.Now()
		var s uint64
		for _, w := range unsafe.Slice((*uint64)(unsafe.Pointer(&m[0])), len(m)/8) {
			s += w
		}
		b.res.add(mMmapWarm, c.name, gib/time.Since(t).Seconds())
		sink += s
		return size, nil
	})
	if err != nil {
		return err
	}
	return b.observe(c, "mmap memset + msync", func() (int64, error) {
		t := time.Now()
		fill(m, byte(sink|1))
		if err := unix.Msync(m, unix.MS_SYNC); err != nil {
			return 0, err
		}
		b.res.add(mMmapSet, c.name, gib/time.Since(t).Seconds())
		return size, nil
	})
}

// fill sets every byte of m to v at memmove speed.
func fill(m []byte, v byte) {
	if len(m) == 0 {
		return
	}
	m[0] = v
	for n := 1; n < len(m); n *= 2 {
		copy(m[n:], m[:n])
	}
}

// timeOpen times one open() of path.
func timeOpen(path string) (time.Duration, error) {
	t := time.Now()
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	d := time.Since(t)
	if err != nil {
		return 0, err
	}
	return d, unix.Close(fd)
}

// timeFloor returns a timer of one getFloor.
func timeFloor(c *contender) func(string) (time.Duration, error) {
	val := make([]byte, 64)
	return func(path string) (time.Duration, error) {
		t := time.Now()
		err := getFloor(c, path, val)
		return time.Since(t), err
	}
}

// getFloor reads user.tensorfs.flags of path into val: tensorfs answers
// it from memory; on the other contenders the name is absent and ENODATA
// is the answer.
func getFloor(c *contender, path string, val []byte) error {
	_, err := unix.Getxattr(path, flagsXattr, val)
	if err == unix.ENODATA && !c.tensorfs {
		return nil
	}
	return err
}

// writeFile writes size non-zero bytes to a new file at path, 1 MiB at a
// time.
func writeFile(path string, size int64) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	buf := make([]byte, min(size, miB))
	for i := range buf {
		buf[i] = byte(i%251 + 1)
	}
	for off := int64(0); off < size; off += int64(len(buf)) {
		if _, err := f.Write(buf[:min(int64(len(buf)), size-off)]); err != nil {
			f.Close()
			return err
		}
	}
	return f.Close()
}

// writeFiles writes size non-zero bytes to a new file at each of paths,
// 1 MiB to each in turn.
func writeFiles(paths []string, size int64) error {
	var fs []*os.File
	defer func() {
		for _, f := range fs {
			f.Close()
		}
	}()
	for _, p := range paths {
		f, err := os.OpenFile(p, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o644)
		if err != nil {
			return err
		}
		fs = append(fs, f)
	}
	buf := make([]byte, min(size, miB))
	for i := range buf {
		buf[i] = byte(i%251 + 1)
	}
	for off := int64(0); off < size; off += int64(len(buf)) {
		for _, f := range fs {
			if _, err := f.Write(buf[:min(int64(len(buf)), size-off)]); err != nil {
				return err
			}
		}
	}
	for _, f := range fs {
		if err := f.Close(); err != nil {
			return err
		}
	}
	fs = nil
	return nil
}

// readFile reads path to the end, 1 MiB at a time, and returns the bytes
// read.
func readFile(path string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf := make([]byte, miB)
	var n int64
	for {
		k, err := f.Read(buf)
		n += int64(k)
		if errors.Is(err, io.EOF) {
			return n, nil
		}
		if err != nil {
			return n, err
		}
	}
}
