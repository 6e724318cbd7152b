package transfer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/safetensors"
)

// Import imports the safetensors file src into dir, a new or empty
// directory inside a tensorfs mount (created with its missing parents),
// all or nothing. It refuses a src that is not a regular file before
// opening it, and a malformed file before writing anything. Once ctx is
// done it stops, removes what it wrote and returns an error saying it was
// interrupted.
func Import(ctx context.Context, src, dir string, opt Options) (*safetensors.Header, error) {
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
	if err := job.run(ctx, opt.Progress); err != nil {
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

	dtypes []string          // tensorfs dtype of each tensor of h
	shapes []string          // user.tensor.shape of each tensor of h
	attrs  map[string][]byte // what to set on dir

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

// run writes every segment into a temporary directory inside dir, then
// records the attributes on dir and renames the segments into place.
func (j *importJob) run(ctx context.Context, progress func(done, total int64)) error {
	tmp, err := os.MkdirTemp(j.dir, importPrefix)
	if err != nil {
		return err
	}
	j.tmp = tmp
	c := newCopier(ctx, j.h.DataSize(), progress)
	for _, i := range j.h.DataOrder() { // the source is read front to back
		if err := c.failed(); err != nil {
			break
		}
		if err := j.startTensor(c, i); err != nil {
			c.fail(fmt.Errorf("tensor %q: %w", j.h.Tensors[i].Name, err))
		}
	}
	if err := c.wait(); err != nil {
		return err
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
	for _, name := range slices.Sorted(maps.Keys(j.attrs)) {
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

// startTensor creates tensor i's segment in the temporary directory,
// reserves its bytes, sets its dtype and shape, and queues the copy of
// its bytes, which closes it.
func (j *importJob) startTensor(c *copier, i int) error {
	t := j.h.Tensors[i]
	path := filepath.Join(j.tmp, filepath.FromSlash(t.Name))
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	if err := j.prepareSegment(f, i); err != nil {
		f.Close()
		return err
	}
	c.add(f, 0, j.src, j.dataAt+t.Begin, t.Size(), func(err error) error {
		if errors.Is(err, unix.ENOSPC) {
			err = errFull
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("tensor %q: %w", t.Name, err)
		}
		return nil
	})
	return nil
}

// prepareSegment sets the dtype and shape of tensor i on its new segment
// f, and sizes a device segment.
func (j *importJob) prepareSegment(f *os.File, i int) error {
	// A host segment gets its pages as its bytes are written, as a full
	// mount says with ENOSPC; reserving them first would clear every
	// page once more. A device segment is sized at once, so that its
	// memory is allocated once rather than grown write by write.
	if n := j.h.Tensors[i].Size(); n > 0 && onDevice(f) {
		if err := f.Truncate(n); err != nil {
			if errors.Is(err, unix.ENOSPC) {
				return fmt.Errorf("reserving %d bytes: %w", n, errFull)
			}
			return err
		}
	}
	if err := unix.Fsetxattr(int(f.Fd()), alloc.AttrDtype, []byte(j.dtypes[i]), 0); err != nil {
		return fmt.Errorf("setting %s=%s: %w", alloc.AttrDtype, j.dtypes[i], err)
	}
	if err := unix.Fsetxattr(int(f.Fd()), alloc.AttrShape, []byte(j.shapes[i]), 0); err != nil {
		return fmt.Errorf("setting %s=%s: %w", alloc.AttrShape, j.shapes[i], err)
	}
	return nil
}

// onDevice reports whether the new segment f lives in device memory: its
// user.tensorfs.device, inherited from its directory, is not cpu.
func onDevice(f *os.File) bool {
	buf := make([]byte, 64)
	n, err := unix.Fgetxattr(int(f.Fd()), alloc.AttrDevice, buf)
	return err == nil && string(buf[:n]) != "cpu"
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
