package transfer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/safetensors"
)

// Export writes the tensors under dir, every regular file with a dtype
// and a shape, to out: one safetensors file, or, when out is a directory
// (an existing one, a path ending in '/', any path when opt.MaxShardSize
// is set, or one not ending in .safetensors when dir was imported from a
// sharded checkpoint), a sharded checkpoint in it as transformers writes
// one: PREFIX-0000i-of-0000n.safetensors and PREFIX.safetensors.index.json,
// or PREFIX.safetensors alone when one shard holds everything. A
// directory imported from a sharded checkpoint is written back as the same
// files while its tensors and metadata are unchanged and opt.MaxShardSize
// is 0; otherwise the tensors are split afresh (safetensors.Split, in the
// order recorded on dir, then by name) into shards of opt.MaxShardSize
// bytes, or safetensors.DefaultMaxShardSize.
//
// Several names of one segment (hard links: a tie) are written once, as
// safetensors' save_model writes shared tensors: under the name an import
// recorded, else the first in byte order, each other name becoming a
// metadata entry "other": "kept" unless metadata has that key already (in
// the index's metadata for a sharded checkpoint, as huggingface_hub writes
// it). A name in opt.Tied is left out, with no entry, and another name of
// its segment written, as transformers' save_pretrained drops the names in
// a model's tied-weights list.
//
// A pack (PackName) directly in dir adds its tensors under their header
// names, each copied from its place in the pack; a segment file of the
// same name wins over a packed tensor, with a line to opt.Warn, and a pack
// that ReadPack refuses (an invalid header, a name that is no path of the
// directory's) is an error naming it.
//
// Every file goes through a temporary file in its directory, renamed into
// place once all are complete and synced. Files with only one of dtype and
// shape are skipped, each with a line to opt.Warn. Once ctx is done it
// stops, removes the temporary files and returns an error saying it was
// interrupted.
func Export(ctx context.Context, dir, out string, opt Options) (Summary, error) {
	fi, err := os.Stat(dir)
	if err != nil {
		return Summary{}, err
	}
	if !fi.IsDir() {
		return Summary{}, fmt.Errorf("%s is not a directory", dir)
	}
	e := &exportJob{dir: dir}
	if err := e.read(opt.Warn, opt.Tied); err != nil {
		return Summary{}, err
	}
	var files []*outFile
	if e.toDirectory(out, opt.MaxShardSize) {
		e.outDir = out
		files, err = e.planShards(out, opt.MaxShardSize)
	} else {
		var f *outFile
		f, err = e.planFile(out)
		files = []*outFile{f}
	}
	if err != nil {
		return Summary{}, err
	}
	if err := e.write(ctx, files, opt.Progress); err != nil {
		return Summary{}, err
	}
	sum := Summary{Links: len(e.ties) + len(opt.Tied)}
	for _, f := range files {
		if f.h != nil {
			sum.Files++
			sum.Tensors += len(f.h.Tensors)
			sum.Bytes += f.h.DataSize()
		}
	}
	return sum, nil
}

// exportJob is what Export read from the directory.
type exportJob struct {
	dir     string
	segs    map[string]*segment // the names written, ties removed
	ties    map[string]string   // a tie's other name -> the name written
	meta    map[string]string   // user.safetensors.meta.*
	order   []string            // user.safetensors.order: a single import's header order
	keys    []string            // user.safetensors.keys: save_state_dict's key order
	shards  *shardsRecord       // user.safetensors.shards: a sharded import
	outDir  string              // the directory of shards written, "" for one file
	created bool                // Export made outDir
}

// outFile is one file to write: a safetensors file (h and its header) or
// the index (raw).
type outFile struct {
	path   string
	h      *safetensors.Header
	header []byte
	raw    []byte
}

// read scans dir and reads what imports and save_state_dict recorded;
// the names in tied are left out.
func (e *exportJob) read(warn func(string), tied []string) error {
	segs, err := scanSegments(e.dir, warn)
	if err != nil {
		return err
	}
	for _, attr := range []struct {
		name string
		into any
	}{{attrSTOrder, &e.order}, {attrSTKeys, &e.keys}, {attrSTShards, &e.shards}} {
		raw, ok, err := getChunks(e.dir, attr.name)
		if err != nil {
			return err
		}
		if ok {
			if err := json.Unmarshal(raw, attr.into); err != nil {
				return fmt.Errorf("%s on %s is not what tensorfs records: %v", attr.name, e.dir, err)
			}
		}
	}
	if e.shards != nil && len(e.shards.Files) == 0 {
		return fmt.Errorf("%s on %s lists no files", attrSTShards, e.dir)
	}
	if len(segs) == 0 && e.order == nil && e.shards == nil {
		return fmt.Errorf("no tensors under %s: a segment needs %s and %s to be exported",
			e.dir, alloc.AttrDtype, alloc.AttrShape)
	}
	if e.meta, err = readMetadata(e.dir); err != nil {
		return err
	}
	e.segs, e.ties, err = untie(segs, e.recorded(), tied)
	return err
}

// recorded returns the names an import read from its files.
func (e *exportJob) recorded() map[string]bool {
	names := map[string]bool{}
	for _, n := range e.order {
		names[n] = true
	}
	if e.shards != nil {
		for _, f := range e.shards.Files {
			for _, n := range f.Tensors {
				names[n] = true
			}
		}
	}
	return names
}

// untie keeps one name of each segment that has several (hard links):
// never one in drop; else the one recorded, else the first in byte order,
// as safetensors' _remove_duplicate_names keeps the first. It returns the
// names kept and the others but those in drop, each with the name kept
// for it. A name in drop that is not one of several names of a segment
// is an error: leaving it out would lose its tensor.
func untie(segs map[string]*segment, recorded map[string]bool, drop []string) (map[string]*segment, map[string]string, error) {
	groups := map[fileID][]string{}
	for name, s := range segs {
		groups[s.id] = append(groups[s.id], name)
	}
	dropped := map[string]bool{}
	for _, n := range drop {
		s, ok := segs[n]
		switch {
		case !ok:
			return nil, nil, fmt.Errorf("tied name %q: no segment of that name to leave out", n)
		case len(groups[s.id]) < 2:
			return nil, nil, fmt.Errorf("tied name %q shares its segment with no other name: leaving it out would lose its tensor", n)
		}
		dropped[n] = true
	}
	kept, ties := map[string]*segment{}, map[string]string{}
	for _, names := range groups {
		slices.Sort(names)
		k := -1 // the index in names of the name kept; -1: none yet
		for i, n := range names {
			if !dropped[n] && (k < 0 || recorded[n] && !recorded[names[k]]) {
				k = i
			}
		}
		if k < 0 {
			return nil, nil, fmt.Errorf("tied names %q are every name of one segment: keep one of them", names)
		}
		keep := names[k]
		kept[keep] = segs[keep]
		for _, n := range names {
			if n != keep && !dropped[n] {
				ties[n] = keep
			}
		}
	}
	return kept, ties, nil
}

// withTies returns meta plus an entry for every tie whose name it does
// not have yet.
func (e *exportJob) withTies(meta map[string]string) map[string]string {
	if len(e.ties) == 0 {
		return meta
	}
	out := maps.Clone(meta)
	if out == nil {
		out = map[string]string{}
	}
	for n, keep := range e.ties {
		if _, ok := out[n]; !ok {
			out[n] = keep
		}
	}
	return out
}

// toDirectory decides whether out is a directory of shards.
func (e *exportJob) toDirectory(out string, maxShardSize int64) bool {
	if fi, err := os.Stat(out); err == nil && fi.IsDir() {
		return true
	}
	return maxShardSize > 0 || strings.HasSuffix(out, "/") ||
		(e.shards != nil && !strings.HasSuffix(out, ".safetensors"))
}

// planFile plans the one file out: the tensors in the recorded order,
// then as the reference writer orders them; the original header when an
// import kept it and it still describes them.
func (e *exportJob) planFile(out string) (*outFile, error) {
	meta := e.withTies(e.meta)
	h, err := rebuildHeader(orderTensors(e.segs, e.order), meta)
	if err != nil {
		return nil, err
	}
	f := &outFile{path: out, h: h, header: h.Encode()}
	if raw, ok, err := getChunks(e.dir, attrSTHeader); err != nil {
		return nil, err
	} else if ok {
		if orig, err := safetensors.ParseHeader(raw, h.DataSize()); err == nil && sameTensors(orig, h.Tensors, meta) {
			f.h, f.header = orig, raw
		}
	}
	return f, nil
}

// planShards plans the files of a sharded checkpoint in the directory
// out: the recorded shards when they still describe the tensors, else a
// fresh split.
func (e *exportJob) planShards(out string, maxShardSize int64) ([]*outFile, error) {
	if maxShardSize == 0 && e.shards != nil {
		if files, ok := e.recordedShards(out); ok {
			return files, nil
		}
	}
	if maxShardSize == 0 {
		maxShardSize = safetensors.DefaultMaxShardSize
	}
	prefix := "model"
	var indexMeta map[string]json.RawMessage
	if e.shards != nil {
		prefix = strings.TrimSuffix(e.shards.Index, safetensors.IndexSuffix)
		indexMeta = e.shards.Metadata
	}
	// The order to split in: save_state_dict's keys, a sharded import's
	// files one after the other, a single import's header; then by name.
	var order []string
	switch {
	case e.keys != nil:
		order = e.keys
	case e.shards != nil:
		for _, f := range e.shards.Files {
			order = append(order, f.Tensors...)
		}
	default:
		order = e.order
	}
	var tensors []safetensors.Tensor
	done := map[string]bool{}
	for _, n := range order {
		if s, ok := e.segs[n]; ok && !done[n] {
			tensors = append(tensors, s.tensor)
			done[n] = true
		}
	}
	var rest []safetensors.Tensor
	for n, s := range e.segs {
		if !done[n] {
			rest = append(rest, s.tensor)
		}
	}
	slices.SortFunc(rest, func(a, b safetensors.Tensor) int { return strings.Compare(a.Name, b.Name) })
	tensors = append(tensors, rest...)
	sizes := make([]int64, len(tensors))
	var total int64
	for i, t := range tensors {
		n, err := safetensors.NBytes(t.Dtype, t.Shape)
		if err != nil {
			return nil, fmt.Errorf("tensor %q: %w", t.Name, err)
		}
		sizes[i], total = n, total+n
	}
	groups := safetensors.Split(sizes, maxShardSize)
	if len(groups) <= 1 {
		h, err := rebuildHeader(sortedTensors(tensors), e.withTies(e.meta))
		if err != nil {
			return nil, err
		}
		return []*outFile{{path: filepath.Join(out, safetensors.ShardName(prefix, 0, 1)), h: h, header: h.Encode()}}, nil
	}
	// Each file gets the directory's metadata but the ties, which go to
	// the index, as huggingface_hub writes them.
	fileMeta := map[string]string{}
	for k, v := range e.meta {
		if _, tie := e.ties[k]; !tie {
			fileMeta[k] = v
		}
	}
	if len(fileMeta) == 0 {
		fileMeta = nil
	}
	ix := &safetensors.Index{Metadata: map[string]json.RawMessage{}, WeightMap: map[string]string{}}
	for k, v := range indexMeta {
		ix.Metadata[k] = v
	}
	for n, keep := range e.ties {
		if _, ok := ix.Metadata[n]; !ok {
			ix.Metadata[n], _ = json.Marshal(keep)
		}
	}
	ix.Metadata["total_size"] = json.RawMessage(strconv.FormatInt(total, 10))
	var files []*outFile
	for i, g := range groups {
		name := safetensors.ShardName(prefix, i, len(groups))
		var shard []safetensors.Tensor
		for _, k := range g {
			shard = append(shard, tensors[k])
			ix.WeightMap[tensors[k].Name] = name
		}
		h, err := rebuildHeader(sortedTensors(shard), fileMeta)
		if err != nil {
			return nil, err
		}
		files = append(files, &outFile{path: filepath.Join(out, name), h: h, header: h.Encode()})
	}
	return append(files, &outFile{path: filepath.Join(out, prefix+safetensors.IndexSuffix), raw: ix.Encode()}), nil
}

// recordedShards plans the files a sharded import recorded, if the
// directory still holds exactly their tensors with their dtypes and
// shapes, and their metadata and the ties are unchanged.
func (e *exportJob) recordedShards(out string) ([]*outFile, bool) {
	r := e.shards
	if !maps.Equal(e.meta, r.commonMetadata()) {
		return nil, false
	}
	recordedMeta := indexStrings(r.Metadata)
	var files []*outFile
	n := 0
	for _, fr := range r.Files {
		var tensors []safetensors.Tensor
		for _, name := range fr.Tensors {
			s, ok := e.segs[name]
			if !ok {
				return nil, false
			}
			tensors = append(tensors, s.tensor)
		}
		n += len(tensors)
		for k, v := range fr.Metadata {
			recordedMeta[k] = v
		}
		h, err := rebuildHeader(tensors, fr.Metadata)
		if err != nil {
			return nil, false
		}
		f := &outFile{path: filepath.Join(out, fr.Name), h: h, header: h.Encode()}
		if fr.Header != "" {
			if orig, err := safetensors.ParseHeader([]byte(fr.Header), h.DataSize()); err == nil && sameTensors(orig, tensors, fr.Metadata) {
				f.h, f.header = orig, []byte(fr.Header)
			}
		}
		files = append(files, f)
	}
	if n != len(e.segs) {
		return nil, false
	}
	for name, keep := range e.ties {
		if recordedMeta[name] != keep {
			return nil, false
		}
	}
	ix := &safetensors.Index{Metadata: r.Metadata, WeightMap: map[string]string{}}
	for _, fr := range r.Files {
		for _, name := range fr.Tensors {
			ix.WeightMap[name] = fr.Name
		}
	}
	raw := ix.Encode()
	if r.Raw != "" {
		raw = []byte(r.Raw)
	}
	return append(files, &outFile{path: filepath.Join(out, r.Index), raw: raw}), true
}

// sortedTensors returns tensors in the reference writer's order.
func sortedTensors(tensors []safetensors.Tensor) []safetensors.Tensor {
	out := slices.Clone(tensors)
	safetensors.SortTensors(out)
	return out
}

// write writes the files through temporary files, copying the tensors'
// bytes with one copier, and renames them into place once all are
// complete and synced. A directory it had to create for them is removed
// if it fails.
func (e *exportJob) write(ctx context.Context, files []*outFile, progress func(done, total int64)) (err error) {
	if e.outDir != "" {
		if err := os.Mkdir(e.outDir, 0o755); err == nil {
			e.created = true
		} else if !errors.Is(err, fs.ErrExist) {
			return err
		}
	}
	var temps []*os.File
	defer func() {
		for _, f := range temps {
			f.Close()
			if err != nil {
				os.Remove(f.Name())
			}
		}
		if err != nil && e.created {
			os.Remove(e.outDir)
		}
	}()
	var total int64
	for _, f := range files {
		if f.h != nil {
			total += f.h.DataSize()
		}
	}
	c := newCopier(ctx, total, progress)
	for _, f := range files {
		tmp, err := os.CreateTemp(filepath.Dir(f.path), "."+filepath.Base(f.path)+".tmp-")
		if err != nil {
			c.fail(err)
			break
		}
		temps = append(temps, tmp)
		if f.h == nil {
			if _, err := tmp.Write(f.raw); err != nil {
				c.fail(err)
				break
			}
			continue
		}
		if _, err := tmp.Write(append(safetensors.AppendPrefix(nil, f.header), f.header...)); err != nil {
			c.fail(err)
			break
		}
		if err := e.queue(c, tmp, f); err != nil {
			c.fail(err)
			break
		}
	}
	if err := c.wait(); err != nil {
		return err
	}
	for _, tmp := range temps {
		if err := tmp.Chmod(0o644); err != nil {
			return err
		}
		if err := tmp.Sync(); err != nil {
			return err
		}
	}
	for i, tmp := range temps {
		if err := os.Rename(tmp.Name(), files[i].path); err != nil {
			return err
		}
	}
	return nil
}

// queue adds the copies of f's tensors into tmp to c.
func (e *exportJob) queue(c *copier, tmp *os.File, f *outFile) error {
	dataAt := safetensors.PrefixSize + int64(len(f.header))
	for _, i := range f.h.DataOrder() {
		if err := c.failed(); err != nil {
			return err
		}
		t := f.h.Tensors[i]
		s := e.segs[t.Name]
		src, err := openRegular(s.path)
		if err != nil {
			return fmt.Errorf("tensor %q: %w", t.Name, err)
		}
		c.add(tmp, dataAt+t.Begin, src, s.offset, t.Size(), func(err error) error {
			src.Close()
			if err != nil {
				return fmt.Errorf("tensor %q: %w", t.Name, err)
			}
			return nil
		})
	}
	return nil
}

// PackName is the name of a pack: a regular file directly in a
// state-dict directory, with neither user.tensor.dtype nor
// user.tensor.shape, whose bytes are a safetensors file holding small
// tensors of the directory together, each named by its header name, as
// the Python client's save_state_dict(pack_below=N) and Import with
// Options.PackBelow write it. A file of this name with a dtype or a shape
// is an ordinary segment, and one in a subdirectory is an ordinary file.
const PackName = "packed.safetensors"

// ReadPack reads and validates the header of the pack at path. The bytes
// of a tensor t of h are [dataAt+t.Begin, dataAt+t.End) in the file. An
// invalid header is an error naming path, and so is a tensor name that no
// writer of packs gives a tensor and that would mislead as a path in the
// directory: one Import refuses, one whose first component starts with
// ".save-" (the Python client's temporary entries, which readers skip),
// and PackName or a name under it.
func ReadPack(path string) (h *safetensors.Header, dataAt int64, err error) {
	f, err := openRegular(path)
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, 0, err
	}
	h, raw, err := safetensors.ReadHeader(f, fi.Size())
	if err != nil {
		return nil, 0, fmt.Errorf("pack %s: %w", path, err)
	}
	for _, t := range h.Tensors {
		if err := checkPackedName(t.Name); err != nil {
			return nil, 0, fmt.Errorf("pack %s: %w", path, err)
		}
	}
	return h, safetensors.PrefixSize + int64(len(raw)), nil
}

// segment is one exportable tensor found under the export directory: a
// segment file, or a tensor of a pack.
type segment struct {
	path   string
	id     fileID             // names of one id are a tie
	tensor safetensors.Tensor // name, dtype and shape; no offsets
	offset int64              // byte offset of the tensor in the file
}

// fileID tells one tensor from another: the device and inode of its file
// (names of one segment file, hard links, are one tensor) and, for a
// tensor of a pack, its name there (tensors of one pack are not ties).
type fileID struct {
	dev, ino uint64
	packed   string
}

// scanSegments finds every regular file under dir that has a dtype and a
// shape, keyed by its path relative to dir, with '/' separators, and the
// tensors of the pack at the top, keyed by their names unless a segment
// file has the name. Temporary entries of imports and of the Python
// client's saves (names starting with .import- or .save- at the top) are
// skipped.
func scanSegments(dir string, warn func(string)) (map[string]*segment, error) {
	segs := map[string]*segment{}
	var packed []*segment
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil {
			return err
		}
		if rel != "." && !strings.Contains(rel, "/") && (strings.HasPrefix(rel, importPrefix) || strings.HasPrefix(rel, savePrefix)) {
			if d.IsDir() {
				return fs.SkipDir
			}
			return nil
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
		if !hasDtype && !hasShape && rel == PackName {
			packed, err = packSegments(path)
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
	if err != nil {
		return nil, err
	}
	for _, s := range packed {
		if seg, ok := segs[s.tensor.Name]; ok {
			if warn != nil {
				warn(fmt.Sprintf("skipping %s in %s: the segment %s has that name",
					alloc.Escape(s.tensor.Name), alloc.Escape(s.path), alloc.Escape(seg.path)))
			}
			continue
		}
		segs[s.tensor.Name] = s
	}
	return segs, nil
}

// packSegments returns the tensors of the pack at path.
func packSegments(path string) ([]*segment, error) {
	h, dataAt, err := ReadPack(path)
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return nil, err
	}
	segs := make([]*segment, len(h.Tensors))
	for i, t := range h.Tensors {
		segs[i] = &segment{path: path, id: fileID{st.Dev, st.Ino, t.Name},
			tensor: safetensors.Tensor{Name: t.Name, Dtype: t.Dtype, Shape: t.Shape}, offset: dataAt + t.Begin}
	}
	return segs, nil
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
	var fst unix.Stat_t
	if err := unix.Stat(path, &fst); err != nil {
		return nil, err
	}
	if off > fst.Size || n > fst.Size-off {
		return nil, fmt.Errorf("%d-byte segment is too short for %s %s at byte %d (%d bytes)",
			fst.Size, d.Name, alloc.FormatShape(dims), off, n)
	}
	return &segment{path: path, id: fileID{dev: fst.Dev, ino: fst.Ino}, tensor: safetensors.Tensor{Dtype: st, Shape: dims}, offset: off}, nil
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
