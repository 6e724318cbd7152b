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

//go:embed model_case.py
var modelCase []byte

var (
	mModelReady = metricDef{"model: time to ready, 4 workers", "s", false}
	mModelMem   = metricDef{"model: PSS of launcher + workers above baseline", "MiB", false}
	// mModelPss is the raw PSS; the baseline's is taken off it.
	mModelPss = metricDef{"model: PSS", "MiB", false}
)

// Contenders of the model case: the same model as a safetensors file on
// the bench's tmpfs read through mmap views, and as a torch.save file
// read with torch.load; tensorfs is the passthrough mount, load_into.
const (
	modelMmapName = "safetensors mmap"
	modelLoadName = "torch.load"
)

// modelShape is the model's layers and vocabulary: GPT-2 small's (124M
// parameters), or a smaller one with -quick.
func (b *bench) modelShape() (layers, vocab int) {
	if b.cfg.torchSize < giB {
		return 4, 16384
	}
	return 12, 50257
}

// groupModel: 4 worker processes each load a GPT-style model whose
// lm_head is tied to its embedding, built on the meta device: tensorfs
// load_into from a directory of segments, against safetensors' way (one
// mmap of a file on tmpfs, a view per tensor) and torch.load of a
// torch.save file on tmpfs. Memory is the PSS of the launcher and the
// workers above a baseline run whose workers load nothing.
func (b *bench) groupModel() error {
	mounts, err := b.start(ptName)
	if err != nil {
		return err
	}
	defer b.stop(mounts)
	script := filepath.Join(b.work, "model_case.py")
	if err := os.WriteFile(script, modelCase, 0o644); err != nil {
		return err
	}
	pydir, err := filepath.Abs("python")
	if err != nil {
		return err
	}
	layers, vocab := b.modelShape()
	dir := filepath.Join(mounts[0].dir, "gpt")
	st, pt := filepath.Join(b.tmpfs, "gpt.safetensors"), filepath.Join(b.tmpfs, "gpt.pt")
	defer os.Remove(st)
	defer os.Remove(pt)
	python := func(args ...string) ([]byte, error) {
		cmd := exec.Command(pythonBin, append([]string{script}, args...)...)
		cmd.Env = append(os.Environ(), "PYTHONPATH="+pydir)
		out, err := cmd.Output()
		if ee, ok := err.(*exec.ExitError); ok {
			err = fmt.Errorf("model_case.py %s: %v\n%s", args[0], err, ee.Stderr)
		}
		return out, err
	}
	shape := []string{strconv.Itoa(layers), strconv.Itoa(vocab)}
	out, err := python(append(append([]string{"setup"}, shape...), dir, st, pt)...)
	if err != nil {
		return err
	}
	var model struct {
		Params  int64 `json:"params"`
		Entries int   `json:"entries"`
		Bytes   int64 `json:"bytes"`
	}
	if err := json.Unmarshal(out, &model); err != nil {
		return fmt.Errorf("model_case.py setup: %v: %q", err, out)
	}
	modes := map[string][2]string{
		baselineName:  {"none", dir},
		ptName:        {"load_into", dir},
		modelMmapName: {"mmap", st},
		modelLoadName: {"torch_load", pt},
	}
	cs := []*contender{{name: baselineName}, mounts[0], {name: modelMmapName}, {name: modelLoadName}}
	err = b.rounds(cs, func(c *contender) error {
		mode := modes[c.name]
		return b.observe(c, "model load_into", func() (int64, error) {
			out, err := python(append([]string{"run", mode[0], mode[1]}, shape...)...)
			if err != nil {
				return 0, err
			}
			var r struct {
				Ready float64 `json:"ready_s"`
				Pss   int64   `json:"pss_bytes"`
				Torch string  `json:"torch"`
			}
			if err := json.Unmarshal(out, &r); err != nil {
				return 0, fmt.Errorf("model_case.py run %s: %v: %q", mode[0], err, out)
			}
			b.torchVersion = r.Torch
			b.res.add(mModelReady, c.name, r.Ready)
			b.res.add(mModelPss, c.name, float64(r.Pss)/miB)
			return 0, nil
		})
	})
	if err != nil {
		return err
	}
	base := b.res.vals[mModelPss][baselineName]
	for name := range modes {
		if name == baselineName {
			continue
		}
		for r, pss := range b.res.vals[mModelPss][name] {
			b.res.add(mModelMem, name, pss-base[r])
		}
	}
	b.res.facts = append(b.res.facts, fmt.Sprintf("model: GPT-style, %d layers, %.1fM parameters in %d state-dict "+
		"entries (lm_head tied to the embedding, an int64 and a bool buffer per layer, a scalar), %.0f MiB of tensor data "+
		"stored once; each of 4 workers builds it on the meta device and loads it: tensorfs.load_into of a "+
		"save_state_dict directory (passthrough), views of one mmap of the safetensors file (on the bench's tmpfs), "+
		"torch.load of a torch.save file (tmpfs); ready once every page of every tensor was read",
		layers, float64(model.Params)/1e6, model.Entries, float64(model.Bytes)/miB))
	return nil
}
