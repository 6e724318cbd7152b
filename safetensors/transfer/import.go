package transfer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
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

// Import imports src into dir, a new or empty directory inside a tensorfs
// mount (created with its missing parents), all or nothing: one segment
// per tensor, named as the tensor. src is a safetensors file, a sharded
// checkpoint's index file (PREFIX.safetensors.index.json, whose shards
// are read from its directory), or a directory holding one index or,
// without an index, one .safetensors file. Every file is checked before
// anything is written: a malformed file, an index that does not match its
// shards, or a name in two shards is refused. Ties the reference writer
// recorded in metadata (a name that is not a tensor mapped to one that
// is, as safetensors' save_model and huggingface_hub write them) become
// hard links: one segment under both names.
//
// With opt.PackBelow > 0, every tensor of fewer bytes that is tied to no
// other name and whose dtype has whole bytes goes into DIR's pack
// (PackName) instead of a segment of its own, as the Python client's
// save_state_dict(pack_below=N) writes it: a safetensors file with no
// dtype or shape of its own and no metadata, its tensors ordered by
// element size, largest first, then by name (safetensors.SortByElementSize),
// so that each starts on a whole element. A name that would be the pack,
// or a directory in its place, is then refused.
//
// It refuses a source that is not a regular file before opening it. Once
// ctx is done it stops, removes what it wrote and returns an error saying
// it was interrupted.
func Import(ctx context.Context, src, dir string, opt Options) (Summary, error) {
	job := &importJob{dir: dir}
	defer job.closeSources()
	if err := job.open(src); err != nil {
		return Summary{}, err
	}
	if err := job.plan(opt.PackBelow); err != nil {
		return Summary{}, fmt.Errorf("%s: %w", src, err)
	}
	if err := job.prepareDir(); err != nil {
		job.rollback()
		return Summary{}, err
	}
	if err := job.run(ctx, opt.Progress); err != nil {
		job.rollback()
		return Summary{}, err
	}
	return job.summary, nil
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

// source is one safetensors file being imported.
type source struct {
	path   string
	f      *os.File
	h      *safetensors.Header
	raw    []byte // the header as read
	dataAt int64  // offset of the byte buffer in the file
}

// importJob is one import in progress, and what to undo if it fails.
type importJob struct {
	srcs     []*source
	index    *safetensors.Index // nil for one file
	indexRaw []byte
	indexAt  string // the index file's name
	dir      string

	links   map[string]string // tie name -> the tensor whose segment it shares
	attrs   map[string][]byte // what to set on dir
	summary Summary

	packHead []byte           // the pack's length prefix and header, nil when nothing is packed
	packSize int64            // the pack's bytes
	packed   map[string]int64 // a packed tensor -> the offset of its bytes in the pack

	room    room     // what the mount had free when the import began
	created string   // topmost directory the import created, "" if none
	tmp     string   // the .import-XXXX directory, "" once removed
	moved   []string // entries renamed from tmp into dir
	set     []string // attributes set on dir
}

// tensorRef is one tensor of one source, with the attributes its
// segment gets.
type tensorRef struct {
	src          *source
	t            safetensors.Tensor
	dtype, shape string
}

// open finds and opens the sources of src and reads their headers (and
// the index).
func (j *importJob) open(src string) error {
	fi, err := os.Stat(src)
	if err != nil {
		return err
	}
	if fi.IsDir() {
		if src, err = findCheckpoint(src); err != nil {
			return err
		}
	}
	f, err := openRegular(src)
	if err != nil {
		return err
	}
	if !isIndex(f, src) {
		return j.addSource(src, f)
	}
	defer f.Close()
	raw, err := io.ReadAll(io.LimitReader(f, safetensors.MaxHeaderSize+1))
	if err != nil {
		return err
	}
	if j.index, err = safetensors.ParseIndex(raw); err != nil {
		return fmt.Errorf("%s: %w", src, err)
	}
	j.indexRaw, j.indexAt = raw, filepath.Base(src)
	if len(j.index.WeightMap) == 0 {
		return fmt.Errorf("%s: the index's weight_map names no tensor", src)
	}
	for _, name := range j.index.Files() {
		p := filepath.Join(filepath.Dir(src), name)
		f, err := openRegular(p)
		if err != nil {
			return fmt.Errorf("%s names %s: %w", src, name, err)
		}
		if err := j.addSource(p, f); err != nil {
			return err
		}
	}
	return nil
}

// addSource reads the header of the safetensors file f and adds it; f is
// the job's to close.
func (j *importJob) addSource(path string, f *os.File) error {
	s := &source{path: path, f: f}
	j.srcs = append(j.srcs, s)
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if s.h, s.raw, err = safetensors.ReadHeader(f, fi.Size()); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	s.dataAt = safetensors.PrefixSize + int64(len(s.raw))
	return nil
}

func (j *importJob) closeSources() {
	for _, s := range j.srcs {
		s.f.Close()
	}
}

// isIndex tells an index file from a safetensors file: a name ending in
// .json, or a first byte '{' where a safetensors file has its header
// length, whose high bytes are zero (an index has no NUL byte).
func isIndex(f *os.File, path string) bool {
	if strings.HasSuffix(path, ".json") {
		return true
	}
	var b [safetensors.PrefixSize]byte
	n, _ := f.ReadAt(b[:], 0)
	return n == len(b) && b[0] == '{' && bytes.IndexByte(b[:], 0) < 0
}

// findCheckpoint returns the index file in dir, or its one .safetensors
// file when it has no index.
func findCheckpoint(dir string) (string, error) {
	indexes, _ := filepath.Glob(filepath.Join(dir, "*"+safetensors.IndexSuffix))
	files, _ := filepath.Glob(filepath.Join(dir, "*.safetensors"))
	switch {
	case len(indexes) == 1:
		return indexes[0], nil
	case len(indexes) > 1:
		return "", fmt.Errorf("%s holds %d index files (%s): name the one to import", dir, len(indexes), strings.Join(baseNames(indexes), ", "))
	case len(files) == 1:
		return files[0], nil
	case len(files) > 1:
		return "", fmt.Errorf("%s holds %d .safetensors files and no *%s: name the file to import", dir, len(files), safetensors.IndexSuffix)
	}
	return "", fmt.Errorf("%s holds no .safetensors file and no *%s", dir, safetensors.IndexSuffix)
}

func baseNames(paths []string) []string {
	out := make([]string, len(paths))
	for i, p := range paths {
		out[i] = filepath.Base(p)
	}
	return out
}

// plan checks everything that can be checked before writing: that the
// index and the shards agree, tensor names that make valid paths and
// appear once, dtypes and shapes tensorfs accepts, metadata that fits
// extended attributes. It fills in what run sets, and plans the pack of
// the tensors under packBelow bytes.
func (j *importJob) plan(packBelow int64) error {
	owner := map[string]*source{}
	for _, s := range j.srcs {
		for _, t := range s.h.Tensors {
			if o, ok := owner[t.Name]; ok {
				return fmt.Errorf("tensor %q is in both %s and %s", t.Name, filepath.Base(o.path), filepath.Base(s.path))
			}
			owner[t.Name] = s
			if j.index != nil {
				if f, ok := j.index.WeightMap[t.Name]; !ok || f != filepath.Base(s.path) {
					return fmt.Errorf("%s holds tensor %q, which the index puts in %q", filepath.Base(s.path), t.Name, f)
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
			j.summary.Tensors++
			j.summary.Bytes += t.Size()
		}
	}
	if j.index != nil {
		for _, name := range slices.Sorted(maps.Keys(j.index.WeightMap)) {
			if owner[name] == nil {
				return fmt.Errorf("the index puts tensor %q in %s, which does not hold it", name, j.index.WeightMap[name])
			}
		}
	}
	j.links = map[string]string{}
	for _, meta := range j.metadatas() {
		for k, v := range meta {
			if owner[k] == nil && owner[v] != nil && checkTensorName(k) == nil {
				j.links[k] = v
			}
		}
	}
	if err := j.planPack(packBelow); err != nil {
		return err
	}
	names := map[string]bool{}
	for name := range owner {
		names[name] = true
	}
	for name := range j.links {
		names[name] = true
	}
	for name := range names {
		if err := checkTensorName(name); err != nil {
			return err
		}
		if j.packHead != nil {
			if err := checkNotPack(name); err != nil {
				return fmt.Errorf("%w: import it without packing", err)
			}
		}
		for i := range len(name) {
			if name[i] == '/' && names[name[:i]] {
				return fmt.Errorf("tensor %q is also the directory of tensor %q", name[:i], name)
			}
		}
	}
	j.summary.Links, j.summary.Files = len(j.links), len(j.srcs)
	return j.planAttrs()
}

// planPack lays out the pack: every tensor of fewer than packBelow bytes
// (0: none) that no tie names and whose dtype has whole bytes.
func (j *importJob) planPack(packBelow int64) error {
	if packBelow <= 0 {
		return nil
	}
	tied := map[string]bool{}
	for _, name := range j.links {
		tied[name] = true
	}
	h := &safetensors.Header{}
	for _, s := range j.srcs {
		for _, t := range s.h.Tensors {
			if bits, _ := safetensors.Bits(t.Dtype); t.Size() < packBelow && !tied[t.Name] && bits%8 == 0 {
				h.Tensors = append(h.Tensors, safetensors.Tensor{Name: t.Name, Dtype: t.Dtype, Shape: t.Shape})
			}
		}
	}
	if len(h.Tensors) == 0 {
		return nil
	}
	safetensors.SortByElementSize(h.Tensors)
	if err := h.Pack(); err != nil {
		return err
	}
	header := h.Encode()
	j.packHead = append(safetensors.AppendPrefix(nil, header), header...)
	j.packSize = int64(len(j.packHead)) + h.DataSize()
	j.packed = map[string]int64{}
	for _, t := range h.Tensors {
		j.packed[t.Name] = int64(len(j.packHead)) + t.Begin
	}
	return nil
}

// need is the bytes the import writes: the tensors' and the pack's header.
func (j *importJob) need() int64 {
	return j.summary.Bytes + int64(len(j.packHead))
}

// metadatas returns every metadata object of the sources, the index's
// string values included.
func (j *importJob) metadatas() []map[string]string {
	var out []map[string]string
	if j.index != nil {
		out = append(out, indexStrings(j.index.Metadata))
	}
	for _, s := range j.srcs {
		out = append(out, s.h.Metadata)
	}
	return out
}

// indexStrings returns the string values of an index's metadata.
func indexStrings(meta map[string]json.RawMessage) map[string]string {
	out := map[string]string{}
	for k, raw := range meta {
		var v string
		if json.Unmarshal(raw, &v) == nil {
			out[k] = v
		}
	}
	return out
}

// planAttrs fills in the attributes of dir: for one file its metadata,
// its tensor order and, unless export would rebuild it, its header; for a
// sharded checkpoint the metadata its files share and the shards record.
func (j *importJob) planAttrs() error {
	j.attrs = map[string][]byte{}
	var meta map[string]string
	if j.index == nil {
		s := j.srcs[0]
		meta = s.h.Metadata
		order := make([]string, len(s.h.Tensors))
		for i, t := range s.h.Tensors {
			order[i] = t.Name
		}
		ob, err := marshalJSON(order)
		if err != nil {
			return err
		}
		setChunks(j.attrs, attrSTOrder, ob)
		if rebuilt, err := rebuildHeader(s.h.Tensors, s.h.Metadata); err != nil {
			return err
		} else if !bytes.Equal(rebuilt.Encode(), s.raw) {
			setChunks(j.attrs, attrSTHeader, s.raw)
		}
	} else {
		rec := shardsRecord{Index: j.indexAt, Metadata: j.index.Metadata}
		if !bytes.Equal(j.index.Encode(), j.indexRaw) {
			rec.Raw = string(j.indexRaw)
		}
		for _, s := range j.srcs {
			fr := fileRecord{Name: filepath.Base(s.path), Metadata: s.h.Metadata, Tensors: []string{}}
			for _, t := range s.h.Tensors {
				fr.Tensors = append(fr.Tensors, t.Name)
			}
			if rebuilt, err := rebuildHeader(s.h.Tensors, s.h.Metadata); err != nil {
				return err
			} else if !bytes.Equal(rebuilt.Encode(), s.raw) {
				fr.Header = string(s.raw)
			}
			rec.Files = append(rec.Files, fr)
		}
		b, err := marshalJSON(rec)
		if err != nil {
			return err
		}
		setChunks(j.attrs, attrSTShards, b)
		meta = rec.commonMetadata()
	}
	for k, v := range meta {
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
	if strings.HasPrefix(parts[0], savePrefix) {
		return fmt.Errorf("tensor name %q starts with %q, which the Python client keeps for its temporary entries", name, savePrefix)
	}
	return nil
}

// checkPackedName refuses a name that a pack may not hold: what
// checkTensorName and checkNotPack refuse.
func checkPackedName(name string) error {
	if err := checkTensorName(name); err != nil {
		return err
	}
	return checkNotPack(name)
}

// checkNotPack refuses PackName and a name under it, whose place in the
// directory the pack takes.
func checkNotPack(name string) error {
	if first, _, _ := strings.Cut(name, "/"); first == PackName {
		return fmt.Errorf("tensor %q: %s is the name of the pack of the small tensors", name, PackName)
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
		j.room = measureRoom(j.dir, j.need())
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
			j.room = measureRoom(parent, j.need())
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

// run writes every segment, and the pack, into a temporary directory
// inside dir, then records the attributes on dir and renames them into
// place.
func (j *importJob) run(ctx context.Context, progress func(done, total int64)) error {
	tmp, err := os.MkdirTemp(j.dir, importPrefix)
	if err != nil {
		return err
	}
	j.tmp = tmp
	pack, err := j.createPack()
	if err != nil {
		return fmt.Errorf("%s: %w", PackName, err)
	}
	c := newCopier(ctx, j.summary.Bytes, progress)
	for _, s := range j.srcs {
		for _, i := range s.h.DataOrder() { // each source is read front to back
			if err := c.failed(); err != nil {
				break
			}
			ref := tensorRef{src: s, t: s.h.Tensors[i]}
			if at, ok := j.packed[ref.t.Name]; ok {
				c.add(pack, at, s.f, s.dataAt+ref.t.Begin, ref.t.Size(), j.finish(ref.t.Name, nil))
				continue
			}
			ref.dtype, _ = safetensors.TensorfsDtype(ref.t.Dtype)
			ref.shape = alloc.FormatShape(ref.t.Shape)
			if err := j.startTensor(c, ref); err != nil {
				c.fail(fmt.Errorf("tensor %q: %w", ref.t.Name, err))
			}
		}
	}
	err = c.wait()
	if pack != nil {
		if cerr := pack.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("%s: %w", PackName, j.orFull(cerr))
		}
	}
	if err != nil {
		return err
	}
	for _, name := range slices.Sorted(maps.Keys(j.links)) {
		path := filepath.Join(tmp, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return err
		}
		if err := os.Link(filepath.Join(tmp, filepath.FromSlash(j.links[name])), path); err != nil {
			return fmt.Errorf("tying %q to %q: %w", name, j.links[name], err)
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

// startTensor creates a tensor's segment in the temporary directory,
// sets its dtype and shape, and queues the copy of its bytes, which
// closes it.
func (j *importJob) startTensor(c *copier, ref tensorRef) error {
	t := ref.t
	path := filepath.Join(j.tmp, filepath.FromSlash(t.Name))
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	if err := prepareSegment(f, ref, j.room); err != nil {
		f.Close()
		return err
	}
	c.add(f, 0, ref.src.f, ref.src.dataAt+t.Begin, t.Size(), j.finish(t.Name, f))
	return nil
}

// finish is what runs once the copy of the tensor name is done: it closes
// its segment f (nil for a packed tensor: run closes the pack) and says
// what failed, a full mount as errFull.
func (j *importJob) finish(name string, f *os.File) func(error) error {
	return func(err error) error {
		where := ""
		if f != nil {
			if cerr := f.Close(); err == nil {
				err = cerr
			}
		} else {
			where = " in " + PackName
		}
		if err != nil {
			return fmt.Errorf("tensor %q%s: %w", name, where, j.orFull(err))
		}
		return nil
	}
}

// orFull returns errFull for ENOSPC (the mount is full), else err.
func (j *importJob) orFull(err error) error {
	if errors.Is(err, unix.ENOSPC) {
		return j.room.full()
	}
	return err
}

// createPack creates the pack in the temporary directory, sized on a
// device, with its header written, and returns it open for the copies
// of its tensors; nil when nothing is packed. It gets no dtype or shape.
func (j *importJob) createPack() (*os.File, error) {
	if j.packHead == nil {
		return nil, nil
	}
	f, err := os.OpenFile(filepath.Join(j.tmp, PackName), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return nil, err
	}
	if err = reserve(f, j.packSize, j.room); err == nil {
		_, err = f.WriteAt(j.packHead, 0)
	}
	if err != nil {
		f.Close()
		return nil, j.orFull(err)
	}
	return f, nil
}

// prepareSegment sets a tensor's dtype and shape on its new segment f,
// and sizes a device segment.
func prepareSegment(f *os.File, ref tensorRef, r room) error {
	if err := reserve(f, ref.t.Size(), r); err != nil {
		return err
	}
	if err := unix.Fsetxattr(int(f.Fd()), alloc.AttrDtype, []byte(ref.dtype), 0); err != nil {
		return fmt.Errorf("setting %s=%s: %w", alloc.AttrDtype, ref.dtype, err)
	}
	if err := unix.Fsetxattr(int(f.Fd()), alloc.AttrShape, []byte(ref.shape), 0); err != nil {
		return fmt.Errorf("setting %s=%s: %w", alloc.AttrShape, ref.shape, err)
	}
	return nil
}

// reserve sizes the new file f to n bytes at once if it lives in device
// memory. A host file gets its pages as its bytes are written, as a full
// mount says with ENOSPC; reserving them first would clear every page
// once more. A device file is sized at once, so that its memory is
// allocated once rather than grown write by write.
func reserve(f *os.File, n int64, r room) error {
	if n > 0 && onDevice(f) {
		if err := f.Truncate(n); err != nil {
			if errors.Is(err, unix.ENOSPC) {
				return fmt.Errorf("reserving %d bytes: %w", n, r.full())
			}
			return err
		}
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
