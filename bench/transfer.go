package main

import (
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/safetensors"
)

var (
	mImport     = metricDef{"tensorfs import of a safetensors file (cp: of the file)", "s", false}
	mImportRate = metricDef{"tensorfs import, rate", "GiB/s", true}
	mExport     = metricDef{"tensorfs export to a file on tmpfs (cp: of the copy)", "s", false}
	mExportRate = metricDef{"tensorfs export, rate", "GiB/s", true}
)

// cpName is the import case's reference: cp of the file into a directory
// on the bench's tmpfs, and back.
const cpName = "cp"

// importTensors is how many tensors the safetensors file holds: one
// small, the rest of equal size, filling importSize.
const importTensors = 81

// groupImport: `tensorfs import FILE DIR` of a safetensors file into each
// tensorfs mount, then `tensorfs export DIR OUT` to a file on the bench's
// tmpfs, against cp of the file into a directory on that tmpfs and cp of
// the copy to OUT; and the same into a cuda:0 directory of a mount with a
// simulated GPU, against cp of the file into that directory (one
// segment on the device) and back. The file lives in the work directory and is read
// before every run, so that its pages are cached; DIR and OUT are
// removed after every run.
func (b *bench) groupImport() error {
	mounts, err := b.start(ptName, classicName, simName)
	if err != nil {
		return err
	}
	defer b.stop(mounts)
	sim := named(mounts, simName)
	sim.dir = filepath.Join(sim.mp, "gpu")
	if err := os.Mkdir(sim.dir, 0o755); err != nil {
		return err
	}
	if err := unix.Setxattr(sim.dir, "user.tensorfs.device", []byte("cuda:0"), 0); err != nil {
		return err
	}
	src := filepath.Join(b.work, "model.safetensors")
	size, err := writeSafetensors(src, b.cfg.importSize)
	if err != nil {
		return err
	}
	defer os.Remove(src)
	cs := append([]*contender{{name: cpName, dir: filepath.Join(b.tmpfs, "cp")}, {name: simCpName, dir: sim.dir}}, mounts...)
	out := filepath.Join(b.tmpfs, "exported.safetensors")
	gib := float64(size) / giB
	return b.warmRounds(cs, func(c *contender) error {
		dir := filepath.Join(c.dir, "model")
		defer os.RemoveAll(dir)
		defer os.Remove(out)
		if _, err := readFile(src); err != nil {
			return err
		}
		imp := []string{b.bin, "import", src, dir}
		exp := []string{b.bin, "export", dir, out}
		if c.name == cpName || c.name == simCpName {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return err
			}
			imp = []string{"cp", src, dir}
			exp = []string{"cp", filepath.Join(dir, filepath.Base(src)), out}
		}
		for _, step := range []struct {
			name    string
			args    []string
			secs, r metricDef
		}{{"tensorfs import", imp, mImport, mImportRate}, {"tensorfs export", exp, mExport, mExportRate}} {
			err := b.observe(c, step.name, func() (int64, error) {
				d, err := timeCommand(step.args)
				b.res.add(step.secs, c.name, d)
				b.res.add(step.r, c.name, gib/d)
				return size, err
			})
			if err != nil {
				return err
			}
		}
		return nil
	})
}

// timeCommand runs a command and returns its wall time in seconds.
func timeCommand(args []string) (float64, error) {
	t := time.Now()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("%v: %v\n%s", args, err, out)
	}
	return time.Since(t).Seconds(), nil
}

// safetensorsShapes returns the shapes of the tensors writeSafetensors
// writes for size bytes: importTensors-1 of big (rows of 1024 float32),
// then one of rest, the bytes left.
func safetensorsShapes(size int64) (big, rest []int64) {
	const row = 4 * kiB // 1024 float32
	b := size / (importTensors - 1) / row * row
	r := size - b*(importTensors-1)
	if r == 0 {
		b -= row
		r = size - b*(importTensors-1)
	}
	return []int64{b / row, row / 4}, []int64{r / 4}
}

// writeSafetensors writes a safetensors file of importTensors float32
// tensors whose data fills about size bytes, and returns the file's size.
func writeSafetensors(path string, size int64) (int64, error) {
	big, rest := safetensorsShapes(size)
	var h safetensors.Header
	for i := range importTensors - 1 {
		h.Tensors = append(h.Tensors, safetensors.Tensor{Name: fmt.Sprintf("layers.%d.weight", i), Dtype: "F32", Shape: big})
	}
	h.Tensors = append(h.Tensors, safetensors.Tensor{Name: "norm.weight", Dtype: "F32", Shape: rest})
	if err := h.Pack(); err != nil {
		return 0, err
	}
	raw := h.Encode()
	f, err := os.Create(path)
	if err != nil {
		return 0, err
	}
	if _, err := f.Write(safetensors.AppendPrefix(nil, raw)); err == nil {
		_, err = f.Write(raw)
	}
	if err != nil {
		f.Close()
		return 0, err
	}
	// Every 8 bytes differ from every other's: no two tensors are equal
	// (a cluster pull fetches equal ones once).
	buf := make([]byte, miB)
	for left := size; left > 0; left -= int64(len(buf)) {
		for i := 0; i < len(buf); i += 8 {
			binary.LittleEndian.PutUint64(buf[i:], uint64(size-left+int64(i))|1<<62)
		}
		if _, err := f.Write(buf[:min(int64(len(buf)), left)]); err != nil {
			f.Close()
			return 0, err
		}
	}
	if err := f.Close(); err != nil {
		return 0, err
	}
	return safetensors.PrefixSize + int64(len(raw)) + size, nil
}
