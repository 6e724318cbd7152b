package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
)

var (
	mSeqWrite = metricDef{"seq write, 1 MiB blocks (fio)", "MiB/s", true}
	mSeqRead  = metricDef{"seq read, 1 MiB blocks (fio)", "MiB/s", true}
	mRandIOPS = metricDef{"rand read 4 KiB, IOPS (fio)", "kIOPS", true}
	mRandLat  = metricDef{"rand read 4 KiB, mean latency", "µs", false}
	mRandP99  = metricDef{"rand read 4 KiB, p99 latency", "µs", false}
)

// fioDir is the read or write half of a fio job's JSON report.
type fioDir struct {
	IOBytes int64   `json:"io_bytes"`
	BW      int64   `json:"bw_bytes"`
	IOPS    float64 `json:"iops"`
	Lat     struct {
		Mean float64 `json:"mean"`
	} `json:"lat_ns"`
	Clat struct {
		Percentile map[string]float64 `json:"percentile"`
	} `json:"clat_ns"`
}

// fioJob is one job of fio's JSON report.
type fioJob struct {
	Read  fioDir `json:"read"`
	Write fioDir `json:"write"`
}

// fio runs one synchronous (psync) fio job on path and returns its report.
// Files are written without fallocate, so writes allocate their pages as
// a program writing a segment would.
func fio(path string, size int64, args ...string) (fioJob, error) {
	cmd := exec.Command("fio", append([]string{
		"--name=bench", "--filename=" + path, "--size=" + strconv.FormatInt(size, 10),
		"--ioengine=psync", "--fallocate=none", "--output-format=json",
	}, args...)...)
	out, err := cmd.Output()
	if err != nil {
		msg := ""
		if ee, ok := err.(*exec.ExitError); ok {
			msg = string(ee.Stderr)
		}
		return fioJob{}, fmt.Errorf("fio %v: %v %s", args, err, msg)
	}
	var rep struct {
		Jobs []fioJob `json:"jobs"`
	}
	if i := bytes.IndexByte(out, '{'); i > 0 {
		out = out[i:] // warnings before the JSON
	}
	if err := json.Unmarshal(out, &rep); err != nil || len(rep.Jobs) != 1 {
		return fioJob{}, fmt.Errorf("fio %v: unreadable report: %v", args, err)
	}
	return rep.Jobs[0], nil
}

// groupIO: sequential write and read of a file in 1 MiB blocks, then
// random 4 KiB reads of it, all with fio.
func (b *bench) groupIO() error {
	cs, err := b.start(tmpfsName, ptName, classicName)
	if err != nil {
		return err
	}
	defer b.stop(cs)
	size := b.cfg.ioSize
	return b.warmRounds(cs, func(c *contender) error {
		path := filepath.Join(c.dir, "fio.seg")
		defer os.Remove(path)
		err := b.observe(c, "seq write", func() (int64, error) {
			j, err := fio(path, size, "--rw=write", "--bs=1M")
			b.res.add(mSeqWrite, c.name, float64(j.Write.BW)/miB)
			return j.Write.IOBytes, err
		})
		if err != nil {
			return err
		}
		err = b.observe(c, "seq read", func() (int64, error) {
			j, err := fio(path, size, "--rw=read", "--bs=1M")
			b.res.add(mSeqRead, c.name, float64(j.Read.BW)/miB)
			return j.Read.IOBytes, err
		})
		if err != nil {
			return err
		}
		return b.observe(c, "rand read 4 KiB", func() (int64, error) {
			j, err := fio(path, size, "--rw=randread", "--bs=4k", "--norandommap",
				"--time_based", "--runtime="+strconv.Itoa(int(b.cfg.randTime.Seconds()))+"s")
			b.res.add(mRandIOPS, c.name, j.Read.IOPS/1000)
			b.res.add(mRandLat, c.name, j.Read.Lat.Mean/1000)
			b.res.add(mRandP99, c.name, j.Read.Clat.Percentile["99.000000"]/1000)
			return j.Read.IOBytes, err
		})
	})
}
