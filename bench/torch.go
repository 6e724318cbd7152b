package main

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
)

// pythonBin is the interpreter with torch that the PyTorch case runs.
const pythonBin = "/usr/bin/python3"

//go:embed torch_case.py
var torchCase []byte

var (
	mTorchReady  = metricDef{"PyTorch: time to ready, 4 workers", "s", false}
	mTorchMem    = metricDef{"PyTorch: PSS of launcher + workers above baseline", "MiB", false}
	mTorchCopies = metricDef{"PyTorch: copies of the weights in memory, stored one included", "copies", false}
	// mTorchPss is the raw PSS; baselineName's is taken off it.
	mTorchPss = metricDef{"PyTorch: PSS", "MiB", false}
)

// baselineName is the PyTorch run whose workers hold no weights.
const baselineName = "baseline"

// torchVariant is how the workers of one PyTorch contender get the weights.
type torchVariant struct {
	mode string // torch_case.py's MODE
	path string
	// storedMapped is true when the workers map the stored weights
	// themselves, so that they are no extra copy.
	storedMapped bool
}

// groupTorch: 4 worker processes each need the same weight tensor. The
// weights are stored once, in the tmpfs for share_memory_() and the own
// copies, as a segment in each tensorfs mount.
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
		baselineName: {"none", source, false},
		shmName:      {"share_memory", source, false},
		copyName:     {"copy", source, false},
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
		variants[c.name] = torchVariant{"from_file", filepath.Join(c.dir, "weights.seg"), c.name == ptName}
		cs = append(cs, c)
	}
	err = b.rounds(cs, func(c *contender) error {
		v := variants[c.name]
		return b.observe(c, "PyTorch from_file", func() (int64, error) {
			out, err := exec.Command(pythonBin, script, v.mode, v.path, strconv.FormatInt(size/4, 10)).Output()
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
				Torch string  `json:"torch"`
			}
			if err := json.Unmarshal(out, &r); err != nil {
				return 0, fmt.Errorf("torch_case.py %s: %v: %q", v.mode, err, out)
			}
			b.torchVersion = r.Torch
			b.res.add(mTorchReady, c.name, r.Ready)
			b.res.add(mTorchPss, c.name, float64(r.Pss)/miB)
			return size, nil
		})
	})
	if err != nil {
		return err
	}
	base := b.res.vals[mTorchPss][baselineName]
	for name, v := range variants {
		if name == baselineName {
			continue
		}
		for r, pss := range b.res.vals[mTorchPss][name] {
			mem := pss - base[r]
			b.res.add(mTorchMem, name, mem)
			stored := float64(size) / miB
			if v.storedMapped {
				stored = 0
			}
			b.res.add(mTorchCopies, name, (mem+stored)/(float64(size)/miB))
		}
	}
	return nil
}
