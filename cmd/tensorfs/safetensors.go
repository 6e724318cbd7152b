package main

// tensorfs import FILE DIR and tensorfs export DIR FILE: safetensors files
// in and out of a mount.
//
// Import writes one segment per tensor under DIR (a name "a/b" becomes the
// segment b in the directory a) with user.tensor.dtype and
// user.tensor.shape set, and records on DIR what a segment cannot hold:
//
//	user.safetensors.meta.KEY  each "__metadata__" entry
//	user.safetensors.order     the tensor names in header order, a JSON list
//	user.safetensors.header    the original header, only when it is not the
//	                           one export would rebuild (see below)
//
// Export rebuilds the header the way the reference writer lays it out:
// compact JSON, "__metadata__" first, the tensors in recorded order (then
// any new ones, largest element size first so that data stays aligned,
// then by name), packed back to back. A file written by the reference
// writer therefore exports byte-identical without anything more; for any
// other file (different JSON spacing or key order, data not in key order,
// an empty "__metadata__"...) import keeps the original header bytes, and
// export reuses them, offsets and all, as long as every tensor still has
// its recorded name, dtype and shape and the metadata is unchanged. An
// unchanged import thus always exports byte-identical.
//
// Attribute values over 64 KiB (the kernel's limit) are split: NAME holds
// the first 64 KiB, NAME.1, NAME.2... the rest.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/safetensors"
)

const (
	attrSTPrefix = "user.safetensors."
	attrSTMeta   = attrSTPrefix + "meta."
	attrSTOrder  = attrSTPrefix + "order"
	attrSTHeader = attrSTPrefix + "header"

	xattrNameMax = 255      // XATTR_NAME_MAX
	xattrSizeMax = 64 << 10 // XATTR_SIZE_MAX: the largest attribute value
	nameMax      = 255      // NAME_MAX: the longest path component

	importPrefix = ".import-" // temporary directory of an import in progress
	copyChunk    = 8 << 20    // bytes per copy_file_range or read/write
	progressMin  = 64 << 20   // smallest file that gets a progress line
)

var errInterrupted = errors.New("interrupted")

func runImport(args []string, stdout, stderr io.Writer) int {
	set := flag.NewFlagSet("tensorfs import", flag.ContinueOnError)
	if code, ok := parseFlags(set, args, "FILE.safetensors DIR   (DIR: new or empty, inside a tensorfs mount)", stdout, stderr); !ok {
		return code
	}
	if set.NArg() != 2 {
		fmt.Fprintln(stderr, "tensorfs import: want FILE.safetensors DIR")
		return 2
	}
	ctx, stop := interruptible()
	defer stop()
	h, err := importFile(ctx, set.Arg(0), set.Arg(1), stderr)
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs import: %s\n", alloc.EscapeText(err.Error()))
		return 1
	}
	fmt.Fprintf(stdout, "imported %d tensors (%s) from %s into %s\n",
		len(h.Tensors), byteCount(h.DataSize()), set.Arg(0), set.Arg(1))
	return 0
}

func runExport(args []string, stdout, stderr io.Writer) int {
	set := flag.NewFlagSet("tensorfs export", flag.ContinueOnError)
	if code, ok := parseFlags(set, args, "DIR FILE.safetensors", stdout, stderr); !ok {
		return code
	}
	if set.NArg() != 2 {
		fmt.Fprintln(stderr, "tensorfs export: want DIR FILE.safetensors")
		return 2
	}
	ctx, stop := interruptible()
	defer stop()
	h, err := exportDir(ctx, set.Arg(0), set.Arg(1), stderr)
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs export: %s\n", alloc.EscapeText(err.Error()))
		return 1
	}
	fmt.Fprintf(stdout, "exported %d tensors (%s) from %s to %s\n",
		len(h.Tensors), byteCount(h.DataSize()), set.Arg(0), set.Arg(1))
	return 0
}

// interruptible returns a context that the first SIGINT or SIGTERM
// cancels: the command stops at its next check and removes what it wrote.
// The handlers go with it, so that a second signal ends the command at
// once wherever it is.
func interruptible() (context.Context, context.CancelFunc) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	context.AfterFunc(ctx, stop)
	return ctx, stop
}

// byteCount prints a size for a sentence: "101 bytes", "3.5M".
func byteCount(n int64) string {
	if n < 1024 {
		return strconv.FormatInt(n, 10) + " bytes"
	}
	return humanSize(n)
}

// importFile imports the safetensors file src into dir, all or nothing.
func importFile(ctx context.Context, src, dir string, stderr io.Writer) (*safetensors.Header, error) {
	f, err := openRegular(src)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	h, raw, err := safetensors.ReadHeader(f, fi.Size())
	if err != nil {
		return nil, fmt.Errorf("%s: %w", src, err)
	}
	job := &importJob{src: f, h: h, dataAt: safetensors.PrefixSize + int64(len(raw)), dir: dir}
	if err := job.plan(raw); err != nil {
		return nil, fmt.Errorf("%s: %w", src, err)
	}
	if err := job.prepareDir(); err != nil {
		job.rollback()
		return nil, err
	}
	job.copier = newCopier(ctx, stderr, "importing "+filepath.Base(src), h.DataSize())
	err = job.run()
	job.copier.progress.finish()
	if err != nil {
		job.rollback()
		return nil, err
	}
	return h, nil
}

// openRegular opens path for reading if it is a regular file. A FIFO or
// a device would block open() or never end: it is refused before the
// open, and again after it (O_NONBLOCK, so that a FIFO swapped in
// meanwhile cannot block either).
func openRegular(path string) (*os.File, error) {
	if fi, err := os.Stat(path); err != nil {
		return nil, err
	} else if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		f.Close()
		if err == nil {
			err = fmt.Errorf("%s is not a regular file", path)
		}
		return nil, err
	}
	return f, nil
}

// importJob is one import in progress, and what to undo if it fails.
type importJob struct {
	src    *os.File
	h      *safetensors.Header
	dataAt int64 // offset of the byte buffer in src
	dir    string
	copier *copier

	dtypes []string          // tensorfs dtype of each tensor of h
	shapes []string          // user.tensor.shape of each tensor of h
	attrs  map[string][]byte // what to set on dir; nil values are removed

	created string   // topmost directory the import created, "" if none
	tmp     string   // the .import-XXXX directory, "" once removed
	moved   []string // entries renamed from tmp into dir
	set     []string // attributes set on dir
}

// plan checks everything that can be checked before writing: tensor names
// that make valid paths, dtypes and shapes tensorfs accepts, metadata that
// fits extended attributes. It fills in what run sets.
func (j *importJob) plan(raw []byte) error {
	names := make(map[string]bool, len(j.h.Tensors))
	for _, t := range j.h.Tensors {
		names[t.Name] = true
	}
	for _, t := range j.h.Tensors {
		if err := checkTensorName(t.Name); err != nil {
			return err
		}
		for i := range len(t.Name) {
			if t.Name[i] == '/' && names[t.Name[:i]] {
				return fmt.Errorf("tensor %q is also the directory of tensor %q", t.Name[:i], t.Name)
			}
		}
		dt, _ := safetensors.TensorfsDtype(t.Dtype) // known: ReadHeader checked
		if _, err := alloc.ParseDtype(dt); err != nil {
			return fmt.Errorf("tensor %q: tensorfs does not know dtype %s", t.Name, t.Dtype)
		}
		shape := alloc.FormatShape(t.Shape)
		if _, err := alloc.ParseShape(shape); err != nil {
			return fmt.Errorf("tensor %q: tensorfs cannot store shape %s: %v", t.Name, shape, err)
		}
		j.dtypes = append(j.dtypes, dt)
		j.shapes = append(j.shapes, shape)
	}

	j.attrs = map[string][]byte{}
	for k, v := range j.h.Metadata {
		name := attrSTMeta + k
		switch {
		case strings.IndexByte(k, 0) >= 0:
			return fmt.Errorf("metadata key %q contains a NUL byte and cannot be an attribute name", k)
		case len(name) > xattrNameMax:
			return fmt.Errorf("metadata key %.40q... is longer than the %d bytes an attribute name can take",
				k, xattrNameMax-len(attrSTMeta))
		case len(v) > xattrSizeMax:
			return fmt.Errorf("metadata %q has a %d-byte value, over the %d bytes of an attribute",
				k, len(v), xattrSizeMax)
		}
		j.attrs[name] = []byte(v)
	}
	order := make([]string, len(j.h.Tensors))
	for i, t := range j.h.Tensors {
		order[i] = t.Name
	}
	ob, err := marshalNames(order)
	if err != nil {
		return err
	}
	setChunks(j.attrs, attrSTOrder, ob)
	rebuilt, err := rebuildHeader(j.h.Tensors, j.h.Metadata)
	if err != nil {
		return err
	}
	if !bytes.Equal(rebuilt.Encode(), raw) {
		setChunks(j.attrs, attrSTHeader, raw)
	}
	return nil
}

// checkTensorName refuses names that are not a relative path of plain
// components, and the names import uses for itself.
func checkTensorName(name string) error {
	if strings.IndexByte(name, 0) >= 0 {
		return fmt.Errorf("tensor name %q contains a NUL byte", name)
	}
	parts := strings.Split(name, "/")
	for _, p := range parts {
		switch {
		case p == "":
			return fmt.Errorf("tensor name %q has an empty path component", name)
		case p == "." || p == "..":
			return fmt.Errorf("tensor name %q has a %q path component", name, p)
		case len(p) > nameMax:
			return fmt.Errorf("tensor name %.40q... has a component over %d bytes", name, nameMax)
		}
	}
	if strings.HasPrefix(parts[0], importPrefix) {
		return fmt.Errorf("tensor name %q starts with %q, which import keeps for its temporary directory", name, importPrefix)
	}
	return nil
}

// rebuildHeader is the header export writes for these tensors (names,
// dtypes and shapes; offsets are recomputed) and metadata when it has no
// original to reuse.
func rebuildHeader(tensors []safetensors.Tensor, meta map[string]string) (*safetensors.Header, error) {
	h := &safetensors.Header{Tensors: slices.Clone(tensors)}
	if len(meta) > 0 {
		h.Metadata = meta
	}
	return h, h.Pack()
}

// prepareDir checks that dir is in a tensorfs mount and is empty, creating
// it (and missing parents) if it does not exist.
func (j *importJob) prepareDir() error {
	fi, err := os.Stat(j.dir)
	switch {
	case err == nil && !fi.IsDir():
		return fmt.Errorf("%s is not a directory", j.dir)
	case err == nil:
		if err := checkTensorfs(j.dir); err != nil {
			return err
		}
		ents, err := readDirNames(j.dir, 1)
		if err != nil {
			return err
		}
		if len(ents) > 0 {
			return fmt.Errorf("%s is not empty (it holds %q): import into a new or empty directory", j.dir, ents[0])
		}
		return nil
	case !errors.Is(err, fs.ErrNotExist):
		return err
	}
	// Find the nearest existing ancestor: it must be in a mount, and the
	// first directory below it is what a failed import removes.
	top := filepath.Clean(j.dir)
	for {
		parent := filepath.Dir(top)
		if _, err := os.Stat(parent); err == nil || parent == top {
			if err := checkTensorfs(parent); err != nil {
				return err
			}
			break
		}
		top = parent
	}
	j.created = top
	return os.MkdirAll(j.dir, 0o755)
}

// checkTensorfs fails unless path is a directory of a tensorfs mount,
// where every directory answers user.tensorfs.flags.
func checkTensorfs(path string) error {
	if _, err := unix.Getxattr(path, alloc.AttrFlags, nil); err != nil {
		return fmt.Errorf("%s is not inside a tensorfs mount (no %s: %v)", path, alloc.AttrFlags, err)
	}
	return nil
}

// readDirNames returns up to n names in dir (all for n <= 0), unsorted.
func readDirNames(dir string, n int) ([]string, error) {
	d, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	names, err := d.Readdirnames(n)
	if err == io.EOF {
		err = nil
	}
	return names, err
}

// run writes every segment into a temporary directory inside dir, then
// records the attributes on dir and renames the segments into place.
func (j *importJob) run() error {
	tmp, err := os.MkdirTemp(j.dir, importPrefix)
	if err != nil {
		return err
	}
	j.tmp = tmp
	for _, i := range j.h.DataOrder() { // the source is read front to back
		if err := j.writeTensor(i); err != nil {
			return fmt.Errorf("tensor %q: %w", j.h.Tensors[i].Name, err)
		}
	}

	// The attributes go first: once a segment is in place, the import is
	// visible, and must be complete.
	old, err := listxattr(j.dir)
	if err != nil {
		return err
	}
	for _, name := range old {
		if strings.HasPrefix(name, attrSTPrefix) {
			// Left by an earlier import whose segments are gone.
			if err := unix.Removexattr(j.dir, name); err != nil && !errors.Is(err, unix.ENODATA) {
				return fmt.Errorf("removing %s from %s: %w", name, j.dir, err)
			}
		}
	}
	for _, name := range sortedKeys(j.attrs) {
		if err := unix.Setxattr(j.dir, name, j.attrs[name], 0); err != nil {
			return fmt.Errorf("setting %s (%d bytes) on %s: %w", name, len(j.attrs[name]), j.dir, err)
		}
		j.set = append(j.set, name)
	}

	ents, err := readDirNames(tmp, 0)
	if err != nil {
		return err
	}
	slices.Sort(ents)
	for _, name := range ents {
		err := unix.Renameat2(unix.AT_FDCWD, filepath.Join(tmp, name), unix.AT_FDCWD, filepath.Join(j.dir, name), unix.RENAME_NOREPLACE)
		if err != nil {
			return fmt.Errorf("moving %s into %s: %w", name, j.dir, err)
		}
		j.moved = append(j.moved, name)
	}
	if err := os.Remove(tmp); err != nil {
		return err
	}
	j.tmp = ""
	return nil
}

// writeTensor creates tensor i's segment in the temporary directory,
// reserves its bytes, copies them and sets its dtype and shape.
func (j *importJob) writeTensor(i int) error {
	t := j.h.Tensors[i]
	path := filepath.Join(j.tmp, filepath.FromSlash(t.Name))
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	err = j.fillSegment(f, t, i)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

func (j *importJob) fillSegment(f *os.File, t safetensors.Tensor, i int) error {
	// Growing the segment reserves its pages: a full mount fails here
	// rather than with SIGBUS in whoever maps the segment later.
	if err := f.Truncate(t.Size()); err != nil {
		if errors.Is(err, unix.ENOSPC) {
			return fmt.Errorf("reserving %s: the mount is full (see df; mount with a larger --capacity)", humanSize(t.Size()))
		}
		return err
	}
	if err := j.copier.copy(f, 0, j.src, j.dataAt+t.Begin, t.Size()); err != nil {
		return err
	}
	if err := unix.Fsetxattr(int(f.Fd()), alloc.AttrDtype, []byte(j.dtypes[i]), 0); err != nil {
		return fmt.Errorf("setting %s=%s: %w", alloc.AttrDtype, j.dtypes[i], err)
	}
	if err := unix.Fsetxattr(int(f.Fd()), alloc.AttrShape, []byte(j.shapes[i]), 0); err != nil {
		return fmt.Errorf("setting %s=%s: %w", alloc.AttrShape, j.shapes[i], err)
	}
	return nil
}

// rollback removes whatever a failed import wrote.
func (j *importJob) rollback() {
	for _, name := range j.moved {
		os.RemoveAll(filepath.Join(j.dir, name))
	}
	for _, name := range j.set {
		unix.Removexattr(j.dir, name)
	}
	if j.tmp != "" {
		os.RemoveAll(j.tmp)
	}
	if j.created != "" {
		os.RemoveAll(j.created)
	}
}

// exportDir writes the tensors under dir to the safetensors file out,
// through a temporary file renamed into place.
func exportDir(ctx context.Context, dir, out string, stderr io.Writer) (*safetensors.Header, error) {
	fi, err := os.Stat(dir)
	if err != nil {
		return nil, err
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("%s is not a directory", dir)
	}
	segs, err := scanSegments(dir, stderr)
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

	c := newCopier(ctx, stderr, "exporting "+filepath.Base(out), h.DataSize())
	err = writeFile(out, func(f *os.File) error {
		if _, err := f.Write(append(safetensors.AppendPrefix(nil, header), header...)); err != nil {
			return err
		}
		dataAt := safetensors.PrefixSize + int64(len(header))
		for _, i := range h.DataOrder() {
			t := h.Tensors[i]
			if err := copySegment(c, segs[t.Name], f, dataAt+t.Begin, t.Size()); err != nil {
				return fmt.Errorf("tensor %q: %w", t.Name, err)
			}
		}
		return nil
	})
	c.progress.finish()
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
func scanSegments(dir string, stderr io.Writer) (map[string]*segment, error) {
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
		dt, hasDtype, err := getxattr(path, alloc.AttrDtype)
		if err != nil {
			return err
		}
		shape, hasShape, err := getxattr(path, alloc.AttrShape)
		if err != nil {
			return err
		}
		if !hasDtype || !hasShape {
			if hasDtype || hasShape {
				fmt.Fprintf(stderr, "tensorfs export: skipping %s: it needs both %s and %s\n", alloc.Escape(path), alloc.AttrDtype, alloc.AttrShape)
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
	if v, ok, err := getxattr(path, alloc.AttrStride); err != nil {
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
	if v, ok, err := getxattr(path, alloc.AttrOffset); err != nil {
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
// recorded, largest element size first (so that each stays aligned), then
// by name.
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
	slices.SortFunc(rest, func(a, b safetensors.Tensor) int {
		sa, _ := safetensors.NBytes(a.Dtype, nil)
		sb, _ := safetensors.NBytes(b.Dtype, nil)
		if sa != sb {
			return int(sb - sa)
		}
		return strings.Compare(a.Name, b.Name)
	})
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
		v, ok, err := getxattr(dir, name)
		if err != nil {
			return nil, err
		}
		if ok {
			meta[key] = string(v)
		}
	}
	return meta, nil
}

// copySegment copies n bytes of the tensor in s to dst at dstOff.
func copySegment(c *copier, s *segment, dst *os.File, dstOff, n int64) error {
	f, err := openRegular(s.path)
	if err != nil {
		return err
	}
	defer f.Close()
	return c.copy(dst, dstOff, f, s.offset, n)
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

// marshalNames encodes a list of names as JSON without HTML escaping.
func marshalNames(names []string) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(names); err != nil {
		return nil, err
	}
	return bytes.TrimRight(b.Bytes(), "\n"), nil
}

// setChunks adds value to attrs under name, split into NAME, NAME.1,
// NAME.2... of at most xattrSizeMax bytes each.
func setChunks(attrs map[string][]byte, name string, value []byte) {
	for i := 0; i == 0 || len(value) > 0; i++ {
		n := min(len(value), xattrSizeMax)
		key := name
		if i > 0 {
			key += "." + strconv.Itoa(i)
		}
		attrs[key] = value[:n]
		value = value[n:]
	}
}

// getChunks reads an attribute that setChunks split; ok is false when it
// is absent.
func getChunks(path, name string) (value []byte, ok bool, err error) {
	for i := 0; ; i++ {
		key := name
		if i > 0 {
			key += "." + strconv.Itoa(i)
		}
		v, ok, err := getxattr(path, key)
		if err != nil || (!ok && i == 0) {
			return nil, false, err
		}
		value = append(value, v...)
		if !ok || len(v) < xattrSizeMax {
			return value, true, nil
		}
	}
}

func sortedKeys(m map[string][]byte) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// copier copies byte ranges between files: with copy_file_range while the
// kernel can (both files on one filesystem), otherwise with large reads
// and writes. It stops when ctx is done and reports to its progress line.
type copier struct {
	ctx      context.Context
	buf      []byte
	noCFR    bool
	progress *progress
}

func newCopier(ctx context.Context, stderr io.Writer, label string, total int64) *copier {
	return &copier{ctx: ctx, progress: newProgress(stderr, label, total)}
}

// copy copies n bytes of src at srcOff to dst at dstOff.
func (c *copier) copy(dst *os.File, dstOff int64, src *os.File, srcOff, n int64) error {
	for n > 0 {
		if c.ctx.Err() != nil {
			return errInterrupted
		}
		chunk := int(min(n, copyChunk))
		var done int
		if !c.noCFR {
			so, do := srcOff, dstOff
			k, err := unix.CopyFileRange(int(src.Fd()), &so, int(dst.Fd()), &do, chunk, 0)
			switch {
			case errors.Is(err, unix.EXDEV), errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.ENOSYS),
				errors.Is(err, unix.EINVAL):
				c.noCFR = true
				continue
			case err != nil:
				return err
			case k == 0:
				return fmt.Errorf("source ended %d bytes early", n)
			}
			done = k
		} else {
			if c.buf == nil {
				c.buf = make([]byte, copyChunk)
			}
			k, err := src.ReadAt(c.buf[:chunk], srcOff)
			if k < chunk {
				if err == nil || err == io.EOF {
					err = fmt.Errorf("source ended %d bytes early", n-int64(k))
				}
				return err
			}
			if _, err := dst.WriteAt(c.buf[:k], dstOff); err != nil {
				return err
			}
			done = k
		}
		srcOff += int64(done)
		dstOff += int64(done)
		n -= int64(done)
		c.progress.add(int64(done))
	}
	return nil
}

// progress draws "\rLABEL  42%  812.3 MB/s" on a terminal, for large copies.
type progress struct {
	w           io.Writer // nil: draw nothing
	label       string
	total, done int64
	start, last time.Time
}

func newProgress(stderr io.Writer, label string, total int64) *progress {
	p := &progress{label: label, total: total, start: time.Now()}
	if total > progressMin && isTerminal(stderr) {
		p.w = stderr
	}
	return p
}

func (p *progress) add(n int64) {
	p.done += n
	if p.w == nil {
		return
	}
	now := time.Now()
	if now.Sub(p.last) < 100*time.Millisecond && p.done < p.total {
		return
	}
	p.last = now
	rate := float64(p.done) / 1e6 / max(now.Sub(p.start).Seconds(), 1e-3)
	fmt.Fprintf(p.w, "\r%s  %3d%%  %.1f MB/s ", p.label, p.done*100/p.total, rate)
}

// finish ends the progress line, if one was drawn.
func (p *progress) finish() {
	if p.w != nil && !p.last.IsZero() {
		fmt.Fprintln(p.w)
	}
}

// isTerminal reports whether w is a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
