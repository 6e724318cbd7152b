package transfer

import (
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"tensorfs/alloc"
	"tensorfs/safetensors"
)

// Export writes the tensors under dir, every regular file with a dtype
// and a shape, to the safetensors file out, through a temporary file in
// out's directory renamed into place once complete and synced. Files with
// only one of dtype and shape are skipped, each with a line to opt.Warn.
// Once ctx is done it stops, removes the temporary file and returns an
// error saying it was interrupted.
func Export(ctx context.Context, dir, out string, opt Options) (*safetensors.Header, error) {
	fi, err := os.Stat(dir)
	if err != nil {
		return nil, err
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("%s is not a directory", dir)
	}
	segs, err := scanSegments(dir, opt.Warn)
	if err != nil {
		return nil, err
	}
	orderRaw, recorded, err := getChunks(dir, attrSTOrder)
	if err != nil {
		return nil, err
	}
	if len(segs) == 0 && !recorded {
		return nil, fmt.Errorf("no tensors under %s: a segment needs %s and %s to be exported",
			dir, alloc.AttrDtype, alloc.AttrShape)
	}
	var order []string
	if recorded {
		if err := json.Unmarshal(orderRaw, &order); err != nil {
			return nil, fmt.Errorf("%s on %s is not a JSON list of names: %v", attrSTOrder, dir, err)
		}
	}
	meta, err := readMetadata(dir)
	if err != nil {
		return nil, err
	}
	tensors := orderTensors(segs, order)

	h, err := rebuildHeader(tensors, meta)
	if err != nil {
		return nil, err
	}
	var header []byte
	if raw, ok, err := getChunks(dir, attrSTHeader); err != nil {
		return nil, err
	} else if ok {
		if orig, err := safetensors.ParseHeader(raw, h.DataSize()); err == nil && sameTensors(orig, tensors, meta) {
			h, header = orig, raw
		}
	}
	if header == nil {
		header = h.Encode()
	}

	err = writeFile(out, func(f *os.File) error {
		if _, err := f.Write(append(safetensors.AppendPrefix(nil, header), header...)); err != nil {
			return err
		}
		dataAt := safetensors.PrefixSize + int64(len(header))
		c := newCopier(ctx, h.DataSize(), opt.Progress)
		for _, i := range h.DataOrder() {
			if c.failed() != nil {
				break
			}
			t := h.Tensors[i]
			s := segs[t.Name]
			src, err := openRegular(s.path)
			if err != nil {
				c.fail(fmt.Errorf("tensor %q: %w", t.Name, err))
				break
			}
			c.add(f, dataAt+t.Begin, src, s.offset, t.Size(), func(err error) error {
				src.Close()
				if err != nil {
					return fmt.Errorf("tensor %q: %w", t.Name, err)
				}
				return nil
			})
		}
		return c.wait()
	})
	if err != nil {
		return nil, err
	}
	return h, nil
}

// segment is one exportable segment found under the export directory.
type segment struct {
	path   string
	tensor safetensors.Tensor // name, dtype and shape; no offsets
	offset int64              // byte offset of the tensor in the segment
}

// scanSegments finds every regular file under dir that has a dtype and a
// shape, keyed by its path relative to dir, with '/' separators. Temporary
// directories of imports are skipped.
func scanSegments(dir string, warn func(string)) (map[string]*segment, error) {
	segs := map[string]*segment{}
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil {
			return err
		}
		if d.IsDir() && rel != "." && !strings.Contains(rel, "/") && strings.HasPrefix(rel, importPrefix) {
			return fs.SkipDir
		}
		if !d.Type().IsRegular() {
			return nil
		}
		dt, hasDtype, err := alloc.GetXattr(path, alloc.AttrDtype)
		if err != nil {
			return err
		}
		shape, hasShape, err := alloc.GetXattr(path, alloc.AttrShape)
		if err != nil {
			return err
		}
		if !hasDtype || !hasShape {
			if warn != nil {
				warn(fmt.Sprintf("skipping %s: it needs both %s and %s", alloc.Escape(path), alloc.AttrDtype, alloc.AttrShape))
			}
			return nil
		}
		s, err := readSegment(path, string(dt), string(shape))
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		s.tensor.Name = filepath.ToSlash(rel)
		segs[s.tensor.Name] = s
		return nil
	})
	return segs, err
}

// readSegment checks that a segment holds a contiguous tensor the format
// can describe, and where in the segment it starts.
func readSegment(path, dtype, shape string) (*segment, error) {
	d, err := alloc.ParseDtype(dtype)
	if err != nil {
		return nil, err
	}
	st, ok := safetensors.FromTensorfsDtype(d.Name)
	if !ok {
		return nil, fmt.Errorf("dtype %s has no safetensors equivalent", d.Name)
	}
	dims, err := alloc.ParseShape(shape)
	if err != nil {
		return nil, err
	}
	n, err := safetensors.NBytes(st, dims)
	if err != nil {
		return nil, err
	}
	if v, ok, err := alloc.GetXattr(path, alloc.AttrStride); err != nil {
		return nil, err
	} else if ok {
		stride, err := alloc.ParseShape(string(v))
		if err != nil {
			return nil, err
		}
		if !contiguous(dims, stride) {
			return nil, fmt.Errorf("stride %s of shape %s is not contiguous; safetensors holds only contiguous tensors",
				alloc.FormatShape(stride), alloc.FormatShape(dims))
		}
	}
	var off int64
	if v, ok, err := alloc.GetXattr(path, alloc.AttrOffset); err != nil {
		return nil, err
	} else if ok {
		elems, err := alloc.ParseOffset(string(v))
		if err != nil {
			return nil, err
		}
		if elems > math.MaxInt64/d.Size {
			return nil, fmt.Errorf("storage offset %d is out of range", elems)
		}
		off = elems * d.Size
	}
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if off > fi.Size() || n > fi.Size()-off {
		return nil, fmt.Errorf("%d-byte segment is too short for %s %s at byte %d (%d bytes)",
			fi.Size(), d.Name, alloc.FormatShape(dims), off, n)
	}
	return &segment{path: path, tensor: safetensors.Tensor{Dtype: st, Shape: dims}, offset: off}, nil
}

// contiguous reports whether stride is the row-major stride of shape,
// ignoring dims of extent 1 as PyTorch's is_contiguous does.
func contiguous(shape, stride []int64) bool {
	if len(shape) != len(stride) {
		return false
	}
	want := int64(1)
	for i := len(shape) - 1; i >= 0; i-- {
		if shape[i] == 0 {
			return true
		}
		if shape[i] != 1 && stride[i] != want {
			return false
		}
		want *= shape[i]
	}
	return true
}

// orderTensors lists the segments in the recorded order, then those not
// recorded as the reference writer orders them (safetensors.SortTensors).
func orderTensors(segs map[string]*segment, order []string) []safetensors.Tensor {
	var out []safetensors.Tensor
	done := map[string]bool{}
	for _, name := range order {
		if s, ok := segs[name]; ok && !done[name] {
			out = append(out, s.tensor)
			done[name] = true
		}
	}
	var rest []safetensors.Tensor
	for name, s := range segs {
		if !done[name] {
			rest = append(rest, s.tensor)
		}
	}
	safetensors.SortTensors(rest)
	return append(out, rest...)
}

// sameTensors reports whether the original header orig still describes
// tensors (names, order, dtypes and shapes) and meta.
func sameTensors(orig *safetensors.Header, tensors []safetensors.Tensor, meta map[string]string) bool {
	if len(orig.Tensors) != len(tensors) || len(orig.Metadata) != len(meta) {
		return false
	}
	for i, t := range tensors {
		o := orig.Tensors[i]
		if o.Name != t.Name || o.Dtype != t.Dtype || !slices.Equal(o.Shape, t.Shape) {
			return false
		}
	}
	for k, v := range meta {
		if ov, ok := orig.Metadata[k]; !ok || ov != v {
			return false
		}
	}
	return true
}

// readMetadata collects the user.safetensors.meta.* attributes of dir.
func readMetadata(dir string) (map[string]string, error) {
	names, err := listxattr(dir)
	if err != nil {
		return nil, err
	}
	meta := map[string]string{}
	for _, name := range names {
		key, ok := strings.CutPrefix(name, attrSTMeta)
		if !ok {
			continue
		}
		v, ok, err := alloc.GetXattr(dir, name)
		if err != nil {
			return nil, err
		}
		if ok {
			meta[key] = string(v)
		}
	}
	return meta, nil
}

// writeFile creates path through a temporary file in its directory that
// fill writes and that is renamed into place once complete and synced.
func writeFile(path string, fill func(*os.File) error) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-")
	if err != nil {
		return err
	}
	err = fill(f)
	if err == nil {
		err = f.Chmod(0o644)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		os.Remove(f.Name())
	}
	return err
}
