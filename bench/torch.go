package main

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// pythonBin is the interpreter with torch that the PyTorch case runs.
const pythonBin = "/usr/bin/python3"

//go:embed torch_case.py
var torchCase []byte

var (
	mTorchReady  = metricDef{"PyTorch: time to ready, 4 workers", "s", false}
	mTorchMem    = metricDef{"PyTorch: PSS of launcher + workers above baseline", "MiB", false}
	mTorchCopies = metricDef{"PyTorch: copies of the weights in memory, stored one included", "copies", false}
	mTorchLoose  = metricDef{"PyTorch: stored copy in pages no process maps", "MiB", false}
	// mTorchPss is the raw PSS; baselineName's is taken off it.
	mTorchPss = metricDef{"PyTorch: PSS", "MiB", false}
)

// baselineName is the PyTorch run whose workers hold no weights.
const baselineName = "baseline"

// torchVariant is how the workers of one PyTorch contender get the weights.
type torchVariant struct {
	mode string // torch_case.py's MODE
	path string
	// store is the file holding the stored copy: path, or the backing
	// file of a segment.
	store string
}

// groupTorch: 4 worker processes each need the same weight tensor. The
// weights are stored once, in the tmpfs for share_memory_() and the own
// copies, as a segment in each tensorfs mount. Copies are counted the
// same way for all: the PSS of the launcher and workers above the
// baseline's, plus the stored copy's pages that none of them maps, over
// the size of the weights.
func (b *bench) groupTorch() error {
	mounts, err := b.start(ptName, classicName)
	if err != nil {
		return err
	}
	defer b.stop(mounts)
	size := b.cfg.torchSize
	script := filepath.Join(b.work, "torch_case.py")
	if err := os.WriteFile(script, torchCase, 0o644); err != nil {
		return err
	}
	source := filepath.Join(b.tmpfs, "weights.bin")
	defer os.Remove(source)
	variants := map[string]torchVariant{
		baselineName: {"none", source, ""},
		shmName:      {"share_memory", source, source},
		copyName:     {"copy", source, source},
	}
	cs := []*contender{{name: baselineName}, {name: shmName}, {name: copyName}}
	for _, path := range append([]string{source}, mounts[0].dir, mounts[1].dir) {
		if path != source {
			path = filepath.Join(path, "weights.seg")
		}
		if err := writeFile(path, size); err != nil {
			return err
		}
	}
	for _, c := range mounts {
		seg := filepath.Join(c.dir, "weights.seg")
		backing, err := getxattr(seg, "user.tensorfs.handle")
		if err != nil {
			return err
		}
		variants[c.name] = torchVariant{"from_file", seg, backing}
		cs = append(cs, c)
	}
	loose := map[string][]float64{}
	err = b.rounds(cs, func(c *contender) error {
		v := variants[c.name]
		return b.observe(c, "PyTorch from_file", func() (int64, error) {
			args := []string{script, v.mode, v.path, strconv.FormatInt(size/4, 10)}
			if v.store != "" {
				args = append(args, v.store)
			}
			out, err := exec.Command(pythonBin, args...).Output()
			if err != nil {
				msg := ""
				if ee, ok := err.(*exec.ExitError); ok {
					msg = string(ee.Stderr)
				}
				return 0, fmt.Errorf("torch_case.py %s: %v\n%s", v.mode, err, msg)
			}
			var r struct {
				Ready float64 `json:"ready_s"`
				Pss   int64   `json:"pss_bytes"`
				Loose int64   `json:"store_unmapped_bytes"`
				Torch string  `json:"torch"`
			}
			if err := json.Unmarshal(out, &r); err != nil {
				return 0, fmt.Errorf("torch_case.py %s: %v: %q", v.mode, err, out)
			}
			b.torchVersion = r.Torch
			b.res.add(mTorchReady, c.name, r.Ready)
			b.res.add(mTorchPss, c.name, float64(r.Pss)/miB)
			loose[c.name] = append(loose[c.name], float64(r.Loose)/miB)
			return size, nil
		})
	})
	if err != nil {
		return err
	}
	base := b.res.vals[mTorchPss][baselineName]
	for name := range variants {
		if name == baselineName {
			continue
		}
		for r, pss := range b.res.vals[mTorchPss][name] {
			mem := pss - base[r]
			b.res.add(mTorchMem, name, mem)
			b.res.add(mTorchLoose, name, loose[name][r])
			b.res.add(mTorchCopies, name, (mem+loose[name][r])/(float64(size)/miB))
		}
	}
	b.res.facts = append(b.res.facts, "PyTorch: copies of the weights = (PSS of the launcher and workers above "+
		"the baseline run's, whose workers hold no weights + the bytes of the stored copy, weights.bin on the bench's "+
		"tmpfs or the segment's backing file, in pages that no tensor of theirs maps: page frame numbers from "+
		"/proc/PID/pagemap compared) / the size of the weights, the same rule for every contender")
	return nil
}

// copiesNote says what the copies of the weights are made of for c.
func (b *bench) copiesNote(c string) string {
	mem, ok1 := b.res.median(mTorchMem, c)
	loose, ok2 := b.res.median(mTorchLoose, c)
	if !ok1 || !ok2 {
		return ""
	}
	return fmt.Sprintf("PSS above the baseline %s MiB and the stored copy's pages that no process maps %s MiB, "+
		"over %s of weights", fmtNum(mem), fmtNum(loose), fmtSize(b.cfg.torchSize))
}

// getxattr returns the value of an extended attribute of path.
func getxattr(path, name string) (string, error) {
	buf := make([]byte, 4*kiB)
	n, err := unix.Getxattr(path, name, buf)
	if err != nil {
		return "", fmt.Errorf("getxattr %s %s: %w", path, name, err)
	}
	return string(buf[:n]), nil
}
