package main

import (
	"fmt"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

var (
	mCreate   = metricDef{"create + write 4 KiB + close + stat + unlink", "k files/s", true}
	mOpen     = metricDef{"open + close", "k ops/s", true}
	mStat     = metricDef{"stat of an unchanged segment", "k ops/s", true}
	mSetxattr = metricDef{"setxattr user.tensor.shape", "k ops/s", true}
	mGetxattr = metricDef{"getxattr user.tensor.shape", "k ops/s", true}
	mReaddir  = metricDef{"readdir of the large directory", "ms", false}
	// mFloor is the round-trip floor: a getxattr that tensorfs answers
	// from memory, with no system call.
	mFloor   = metricDef{"getxattr user.tensorfs.flags, the round-trip floor", "µs", false}
	mRSSDir  = metricDef{"daemon RSS with the directory's segments", "MiB", false}
	mPeakDir = metricDef{"daemon peak RSS (VmHWM) by then", "MiB", false}
	mHeapDir = metricDef{"daemon live heap after its last GC (gctrace)", "MiB", false}
)

const (
	shapeXattr = "user.tensor.shape"
	// flagsXattr is virtual on tensorfs, cached in the node; absent
	// (ENODATA) on tmpfs and loopback.
	flagsXattr = "user.tensorfs.flags"
)

// metaLoop is one metadata loop: op is its i-th iteration.
type metaLoop struct {
	m    metricDef
	name string
	op   func(i int) error
}

// run runs the loop n times and returns how long it took.
func (l metaLoop) run(n int) (time.Duration, error) {
	t := time.Now()
	for i := 0; i < n; i++ {
		if err := l.op(i); err != nil {
			return 0, fmt.Errorf("%s #%d: %w", l.name, i, err)
		}
	}
	return time.Since(t), nil
}

// metaLoops are the metadata loops in c's directory, over the segment
// "seg" and, for creation, over names.
func metaLoops(c *contender, names []string) []metaLoop {
	seg := filepath.Join(c.dir, "seg")
	data := make([]byte, 4*kiB)
	shapes := [][]byte{[]byte("[32, 32]"), []byte("[64, 16]")}
	val := make([]byte, 64)
	var st unix.Stat_t
	return []metaLoop{
		{mCreate, "create+write+stat+unlink", func(i int) error {
			p := filepath.Join(c.dir, names[i])
			fd, err := unix.Open(p, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
			if err != nil {
				return err
			}
			if _, err := unix.Write(fd, data); err != nil {
				unix.Close(fd)
				return err
			}
			if err := unix.Close(fd); err != nil {
				return err
			}
			if err := unix.Stat(p, &st); err != nil {
				return err
			}
			return unix.Unlink(p)
		}},
		{mOpen, "open+close", func(int) error {
			fd, err := unix.Open(seg, unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				return err
			}
			return unix.Close(fd)
		}},
		{mStat, "stat", func(int) error { return unix.Stat(seg, &st) }},
		{mSetxattr, "setxattr", func(i int) error { return unix.Setxattr(seg, shapeXattr, shapes[i%2], 0) }},
		{mGetxattr, "getxattr", func(int) error {
			_, err := unix.Getxattr(seg, shapeXattr, val)
			return err
		}},
		{mFloor, "getxattr from memory", func(int) error { return getFloor(c, seg, val) }},
	}
}

// groupMeta runs the metadata loops, each metaN times per round, then
// once more on passthrough tensorfs under perf.
func (b *bench) groupMeta() error {
	cs, err := b.start(tmpfsName, ptName, classicName, loopName)
	if err != nil {
		return err
	}
	defer b.stop(cs)
	n := b.cfg.metaN
	names := make([]string, n)
	for i := range names {
		names[i] = "f" + strconv.Itoa(i)
	}
	for _, c := range cs {
		if err := writeFile(filepath.Join(c.dir, "seg"), 4*kiB); err != nil {
			return err
		}
	}
	err = b.rounds(cs, func(c *contender) error {
		for _, l := range metaLoops(c, names) {
			b.res.opsPerRun[l.name] = n
			err := b.observe(c, l.name, func() (int64, error) {
				d, err := l.run(n)
				if l.m.unit == "µs" {
					b.res.add(l.m, c.name, d.Seconds()*1e6/float64(n))
				} else {
					b.res.add(l.m, c.name, float64(n)/d.Seconds()/1e3)
				}
				return 0, err
			})
			if err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	pt := named(cs, ptName)
	for _, l := range metaLoops(pt, names) {
		if l.m == mStat || l.m == mFloor {
			continue // served by the kernel; no handler to profile
		}
		if err := b.profile(pt, l.name, func() error { _, err := l.run(n); return err }); err != nil {
			return err
		}
	}
	return nil
}

// groupReaddir lists a directory of dirN empty segments in every round,
// then stats each of them and reads the daemon's RSS. Loopback runs
// twice: with tensorfs's mount options and with go-fuse's.
func (b *bench) groupReaddir() error {
	cs, err := b.start(tmpfsName, ptName, classicName, loopName, loopStockName)
	if err != nil {
		return err
	}
	defer b.stop(cs)
	n := b.cfg.dirN
	for _, c := range cs {
		dir := filepath.Join(c.dir, "many")
		if err := unix.Mkdir(dir, 0o755); err != nil {
			return err
		}
		for i := 0; i < n; i++ {
			fd, err := unix.Open(filepath.Join(dir, "s"+strconv.Itoa(i)), unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
			if err != nil {
				return fmt.Errorf("%s: create segment %d: %w", c.name, i, err)
			}
			unix.Close(fd)
		}
	}
	err = b.warmRounds(cs, func(c *contender) error {
		return b.observe(c, "readdir", func() (int64, error) {
			t := time.Now()
			got, err := countEntries(filepath.Join(c.dir, "many"))
			b.res.add(mReaddir, c.name, float64(time.Since(t).Microseconds())/1e3)
			if err == nil && got != n {
				err = fmt.Errorf("readdir listed %d segments, want %d", got, n)
			}
			return 0, err
		})
	})
	if err != nil {
		return err
	}
	pt := named(cs, ptName)
	err = b.profile(pt, "readdir", func() error {
		_, err := countEntries(filepath.Join(pt.dir, "many"))
		return err
	})
	if err != nil {
		return err
	}
	for _, c := range cs {
		if c.pid == 0 || c.name == loopStockName {
			continue
		}
		var st unix.Stat_t
		for i := 0; i < n; i++ {
			if err := unix.Stat(filepath.Join(c.dir, "many", "s"+strconv.Itoa(i)), &st); err != nil {
				return err
			}
		}
		rss, peak, err := c.rss()
		if err != nil {
			return err
		}
		b.res.add(mRSSDir, c.name, float64(rss)/miB)
		b.res.add(mPeakDir, c.name, float64(peak)/miB)
		if heap, err := c.liveHeap(); err == nil {
			b.res.add(mHeapDir, c.name, heap)
		}
	}
	return nil
}

// countEntries lists dir with getdents64 and returns how many entries
// other than . and .. it has.
func countEntries(dir string) (int, error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	buf := make([]byte, 64*kiB)
	names := make([]string, 0, 512)
	total := 0
	for {
		k, err := unix.Getdents(fd, buf)
		if err != nil {
			return total, err
		}
		if k == 0 {
			return total, nil
		}
		_, c, _ := unix.ParseDirent(buf[:k], -1, names[:0])
		total += c
	}
}
