package main

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

var (
	mRSSEmpty = metricDef{"daemon RSS, empty mount", "MiB", false}
	mRSSData  = metricDef{"daemon RSS, highest while writing and reading the data", "MiB", false}
)

// groupScale writes scaleSize bytes through a fresh tensorfs mount in
// eight segments and reads them back, sampling the daemon's RSS after
// each; it must stay flat. One contender at a time, so that only one
// copy of the data exists. The classic mount's page cache is dropped
// after each segment, for the same reason.
func (b *bench) groupScale() error {
	chunk := b.cfg.scaleSize / 8
	for _, name := range []string{ptName, classicName} {
		cs, err := b.start(name)
		if err != nil {
			return err
		}
		err = b.scaleOne(cs[0], chunk)
		b.stop(cs)
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	}
	return nil
}

func (b *bench) scaleOne(c *contender, chunk int64) error {
	rss, _, err := c.rss()
	if err != nil {
		return err
	}
	b.res.add(mRSSEmpty, c.name, float64(rss)/miB)
	curve := []string{fmtMiB(rss)}
	var highest int64
	for _, phase := range []string{"scale write", "scale read"} {
		err := b.observe(c, phase, func() (int64, error) {
			for i := 0; i < 8; i++ {
				path := filepath.Join(c.dir, "d"+strconv.Itoa(i))
				var err error
				if phase == "scale write" {
					err = writeFile(path, chunk)
				} else {
					_, err = readFile(path)
				}
				if err == nil {
					err = dropCache(path)
				}
				if err != nil {
					return 0, err
				}
				rss, _, err := c.rss()
				if err != nil {
					return 0, err
				}
				curve = append(curve, fmtMiB(rss))
				highest = max(highest, rss)
			}
			return 8 * chunk, nil
		})
		if err != nil {
			return err
		}
	}
	b.res.add(mRSSData, c.name, float64(highest)/miB)
	_, peak, err := c.rss()
	if err != nil {
		return err
	}
	b.res.facts = append(b.res.facts, fmt.Sprintf(
		"%s: daemon RSS (MiB) empty, then after each %s written, then read back: %s; peak (VmHWM) %s MiB",
		c.name, fmtSize(chunk), strings.Join(curve, " "), fmtMiB(peak)))
	return nil
}

// dropCache drops path's clean pages from the page cache: those of a
// classic FUSE file; on tmpfs and in passthrough they are the file and
// stay.
func dropCache(path string) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Fadvise(fd, 0, 0, unix.FADV_DONTNEED)
}

func fmtMiB(n int64) string { return strconv.FormatFloat(float64(n)/miB, 'f', 1, 64) }

// fmtSize writes a byte count in the largest binary unit that divides it.
func fmtSize(n int64) string {
	switch {
	case n >= giB && n%giB == 0:
		return strconv.FormatInt(n/giB, 10) + " GiB"
	case n >= miB && n%miB == 0:
		return strconv.FormatInt(n/miB, 10) + " MiB"
	case n >= kiB && n%kiB == 0:
		return strconv.FormatInt(n/kiB, 10) + " KiB"
	}
	return strconv.FormatInt(n, 10) + " B"
}
