package cluster

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash"
	"io"
	"math"
	"path"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode/utf8"

	"tensorfs/alloc"
)

// Piece sizes. A content is cut into pieces of DefaultPieceSize; one
// larger than MaxPieces of them gets pieces twice as large, as often as
// needed, so that its hashes stay well inside one etcd value.
const (
	DefaultPieceSize = 8 << 20
	MaxPieces        = 16384
)

// Limits on what a manifest may carry (those of Linux xattrs and paths,
// and, for all of one entry's attributes together, maxXattrBytes: an
// entry is one etcd value, base64 makes them a third larger, and etcd
// refuses requests over 1.5 MiB).
const (
	maxXattrName  = 255
	maxXattrValue = 64 << 10
	maxXattrs     = 256
	maxXattrBytes = 128 << 10
	maxPath       = 4096
)

// Content is the bytes of one published segment, as etcd records them: its
// size and the SHA-256 of each piece. Its ID is the hex SHA-256 of its
// encoding, so equal bytes cut equally have one ID whatever path or
// version they appear under, and every node that holds them can serve them.
type Content struct {
	Size      int64  `json:"size"`
	PieceSize int64  `json:"piece_size"`
	Hashes    []byte `json:"sha256"` // SHA-256 of each piece, concatenated

	id string // hex SHA-256 of the encoding; set by hashContent and decodeContent
}

// ID returns the content's ID.
func (c *Content) ID() string { return c.id }

// Pieces returns the number of pieces.
func (c *Content) Pieces() int { return int((c.Size + c.PieceSize - 1) / c.PieceSize) }

// PieceRange returns the offset and length of piece i.
func (c *Content) PieceRange(i int) (off, n int64) {
	off = int64(i) * c.PieceSize
	return off, min(c.PieceSize, c.Size-off)
}

// pieceHash returns the published SHA-256 of piece i.
func (c *Content) pieceHash(i int) []byte { return c.Hashes[i*sha256.Size : (i+1)*sha256.Size] }

// verifyBuf is the size of the buffer pieces are read through to be
// verified.
const verifyBuf = 256 << 10

// verifyPiece reads piece i from r (through buf) and checks it against
// its published hash: ErrBadCopy if it differs.
func (c *Content) verifyPiece(r io.ReaderAt, i int, buf []byte) error {
	off, n := c.PieceRange(i)
	h := sha256.New()
	if k, err := io.CopyBuffer(h, io.NewSectionReader(r, off, n), buf); k < n {
		return fmt.Errorf("reading piece %d of %.12s: %d bytes of %d: %v", i, c.id, k, n, err)
	}
	return c.checkSum(i, h.Sum(nil))
}

// readPiece reads piece i from r into a new buffer and returns it once
// it matches its published hash (ErrBadCopy if it does not).
func (c *Content) readPiece(r io.ReaderAt, i int) ([]byte, error) {
	off, n := c.PieceRange(i)
	b := make([]byte, n)
	if k, err := r.ReadAt(b, off); k < len(b) {
		return nil, fmt.Errorf("reading piece %d of %.12s: %d bytes of %d: %v", i, c.id, k, n, err)
	}
	sum := sha256.Sum256(b)
	if err := c.checkSum(i, sum[:]); err != nil {
		return nil, err
	}
	return b, nil
}

// checkSum checks sum, the SHA-256 of piece i's bytes, against the
// published one: ErrBadCopy if it differs.
func (c *Content) checkSum(i int, sum []byte) error {
	if !bytes.Equal(sum, c.pieceHash(i)) {
		return fmt.Errorf("%w: piece %d of %.12s", ErrBadCopy, i, c.id)
	}
	return nil
}

// hashedDest is a piece's destination file that hashes what is written
// to it, as the transport writes it: from the piece's start, in order.
// A write out of that order (an engine that places bytes otherwise)
// leaves the hash incomplete, and the piece is read back to be verified.
type hashedDest struct {
	f    io.WriterAt
	h    hash.Hash
	next int64 // the file offset the hash has reached
}

// newHashedDest returns the destination of the piece at off in f.
func newHashedDest(f io.WriterAt, off int64) *hashedDest {
	return &hashedDest{f: f, h: sha256.New(), next: off}
}

// WriteAt writes b at off of the file, and hashes what it wrote if it
// continues what was hashed.
func (d *hashedDest) WriteAt(b []byte, off int64) (int, error) {
	k, err := d.f.WriteAt(b, off)
	if off == d.next {
		d.h.Write(b[:k])
		d.next += int64(k)
	}
	return k, err
}

// verifyPiece checks piece i, written through d into r, against its
// published hash: from the hash of what was written where that covers
// the whole piece (no read back), else as c.verifyPiece reads it from r.
func (d *hashedDest) verifyPiece(c *Content, r io.ReaderAt, i int) error {
	off, n := c.PieceRange(i)
	if d.next != off+n {
		return c.verifyPiece(r, i, make([]byte, verifyBuf))
	}
	return c.checkSum(i, d.h.Sum(nil))
}

// Verify reads the whole content from r and checks every piece against
// its published hash: ErrBadCopy naming the first that differs.
func (c *Content) Verify(r io.ReaderAt) error {
	buf := make([]byte, verifyBuf)
	for i := range c.Pieces() {
		if err := c.verifyPiece(r, i, buf); err != nil {
			return err
		}
	}
	return nil
}

// encode returns the canonical encoding, whose hash is the ID.
func (c *Content) encode() []byte {
	b, err := json.Marshal(c)
	if err != nil {
		panic(err) // a struct of integers and bytes always encodes
	}
	return b
}

// decodeContent parses a stored content and checks it against its ID.
func decodeContent(id string, b []byte) (*Content, error) {
	if hashID(b) != id {
		return nil, fmt.Errorf("%w: content %s does not hash to its ID", ErrCorrupt, id)
	}
	c := &Content{id: id}
	if err := json.Unmarshal(b, c); err != nil {
		return nil, fmt.Errorf("%w: content %s: %v", ErrCorrupt, id, err)
	}
	// A piece is at most what pieceSizeFor makes of the largest base
	// (a node serves a piece from a buffer of its size: a forged piece
	// size would be memory a peer's request holds), the pieces of a
	// size are counted without overflow, and they are at most MaxPieces,
	// as every publish cuts them (a bitmap of them fits the piece
	// protocol's frames: transport.MaxBitmap).
	if c.Size < 0 || c.PieceSize <= 0 || c.Size > math.MaxInt64-c.PieceSize ||
		c.PieceSize > pieceSizeFor(c.Size, DefaultPieceSize) || c.Pieces() > MaxPieces ||
		len(c.Hashes) != c.Pieces()*sha256.Size {
		return nil, fmt.Errorf("%w: content %s: size %d, piece size %d, %d hash bytes", ErrCorrupt, id, c.Size, c.PieceSize, len(c.Hashes))
	}
	return c, nil
}

// hashID is the hex SHA-256 of b.
func hashID(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// validID reports whether s is a lower-case hex SHA-256.
func validID(s string) bool {
	if len(s) != 2*sha256.Size {
		return false
	}
	for _, c := range []byte(s) {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// pieceSizeFor returns the piece size of a content of size bytes: base,
// doubled until the content has at most MaxPieces pieces.
func pieceSizeFor(size, base int64) int64 {
	for base <= math.MaxInt64/MaxPieces/2 && size > base*MaxPieces {
		base *= 2
	}
	return base
}

// hashContent reads size bytes of r and returns their Content, cut into
// pieces of pieceSize (see pieceSizeFor). Pieces are hashed in parallel.
func hashContent(r io.ReaderAt, size, pieceSize int64) (*Content, error) {
	c := &Content{Size: size, PieceSize: pieceSizeFor(size, pieceSize)}
	c.Hashes = make([]byte, c.Pieces()*sha256.Size)
	next := make(chan int, c.Pieces())
	for i := range c.Pieces() {
		next <- i
	}
	close(next)
	var (
		wg       sync.WaitGroup
		errMu    sync.Mutex
		firstErr error
	)
	for range min(runtime.GOMAXPROCS(0), c.Pieces()) {
		wg.Go(func() {
			buf := make([]byte, c.PieceSize)
			for i := range next {
				off, n := c.PieceRange(i)
				if k, err := r.ReadAt(buf[:n], off); int64(k) < n {
					errMu.Lock()
					firstErr = cmpErr(firstErr, fmt.Errorf("reading bytes %d-%d: %w", off, off+n, err))
					errMu.Unlock()
					return
				}
				h := sha256.Sum256(buf[:n])
				copy(c.pieceHash(i), h[:])
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		return nil, firstErr
	}
	c.id = hashID(c.encode())
	return c, nil
}

// cmpErr keeps the first error.
func cmpErr(first, err error) error {
	if first != nil {
		return first
	}
	return err
}

// Entry is one file or directory of a published snapshot, as etcd records
// it. Every node shows it with these attributes.
type Entry struct {
	// Path is slash-separated and relative to the published directory;
	// "." is that directory itself.
	Path  string `json:"path"`
	Mode  uint32 `json:"mode"` // st_mode: S_IFREG or S_IFDIR, and permission bits
	UID   uint32 `json:"uid"`
	GID   uint32 `json:"gid"`
	Mtime int64  `json:"mtime_ns"` // modification time, nanoseconds since the epoch

	// Size and Content are set for files: the bytes and their content ID.
	Size    int64  `json:"size,omitempty"`
	Content string `json:"content,omitempty"`

	// The tensor attributes of a file, in canonical spelling (alloc.Layout),
	// "" where absent.
	Dtype         string `json:"dtype,omitempty"`
	Shape         string `json:"shape,omitempty"`
	Stride        string `json:"stride,omitempty"`
	StorageOffset string `json:"storage_offset,omitempty"`

	// Xattrs are the other user.* attributes, verbatim. Names of
	// tensorfs's own (user.tensorfs.*) are not published: each node
	// computes them.
	Xattrs map[string][]byte `json:"xattrs,omitempty"`
}

// IsDir reports whether e is a directory.
func (e *Entry) IsDir() bool { return e.Mode&syscall.S_IFMT == syscall.S_IFDIR }

// Layout returns the tensor attributes of e.
func (e *Entry) Layout() alloc.Layout {
	return alloc.Layout{Dtype: e.Dtype, Shape: e.Shape, Stride: e.Stride, Offset: e.StorageOffset}
}

// MtimeTime returns the modification time.
func (e *Entry) MtimeTime() time.Time { return time.Unix(0, e.Mtime) }

// check validates e: what Publish refuses and what a node refuses to show
// when it reads a manifest.
func (e *Entry) check() error {
	if e.Path != "." {
		if err := checkRelPath(e.Path); err != nil {
			return err
		}
	}
	perm := e.Mode &^ syscall.S_IFMT
	switch e.Mode & syscall.S_IFMT {
	case syscall.S_IFDIR:
		if perm&^0o1777 != 0 || e.Size != 0 || e.Content != "" || e.Layout() != (alloc.Layout{}) {
			return fmt.Errorf("directory %q: mode %o, size %d, content %q, tensor attributes %+v: a directory has permission bits and xattrs only", e.Path, e.Mode, e.Size, e.Content, e.Layout())
		}
	case syscall.S_IFREG:
		if e.Path == "." {
			return fmt.Errorf("the published directory itself (\".\") is a file")
		}
		if perm&^0o777 != 0 {
			return fmt.Errorf("file %q: mode %o: set-id and sticky bits are not published", e.Path, e.Mode)
		}
		if e.Size < 0 {
			return fmt.Errorf("file %q: size %d", e.Path, e.Size)
		}
		if err := checkLayout(e.Layout(), e.Size); err != nil {
			return fmt.Errorf("file %q: %w", e.Path, err)
		}
	default:
		return fmt.Errorf("%q: mode %o: only files and directories are published", e.Path, e.Mode)
	}
	if len(e.Xattrs) > maxXattrs {
		return fmt.Errorf("%q: %d xattrs, more than %d", e.Path, len(e.Xattrs), maxXattrs)
	}
	total := 0
	for name, v := range e.Xattrs {
		total += len(name) + len(v)
		if !strings.HasPrefix(name, "user.") || len(name) > maxXattrName || strings.HasPrefix(name, "user.tensorfs.") ||
			alloc.TensorAttr(name) || strings.IndexByte(name, 0) >= 0 {
			return fmt.Errorf("%q: xattr %q is not a user.* name a manifest carries", e.Path, name)
		}
		if len(v) > maxXattrValue {
			return fmt.Errorf("%q: xattr %q: %d bytes, more than %d", e.Path, name, len(v), maxXattrValue)
		}
	}
	if total > maxXattrBytes {
		return fmt.Errorf("%w: %q: %d xattrs of %d bytes (names and values), more than the %d one published entry carries", ErrTooLarge, e.Path, len(e.Xattrs), total, maxXattrBytes)
	}
	return nil
}

// checkLayout checks that the tensor attributes are canonical and fit in
// size bytes, as a segment's own xattrs would have to.
func checkLayout(l alloc.Layout, size int64) error {
	var (
		d             alloc.Dtype
		shape, stride []int64
		offset        int64
		err           error
	)
	if l.Dtype != "" {
		if d, err = alloc.ParseDtype(l.Dtype); err != nil || d.Name != l.Dtype {
			return fmt.Errorf("dtype %q is not a canonical dtype", l.Dtype)
		}
	}
	for _, f := range []struct {
		v    string
		dims *[]int64
	}{{l.Shape, &shape}, {l.Stride, &stride}} {
		if f.v == "" {
			continue
		}
		if *f.dims, err = alloc.ParseShape(f.v); err != nil || alloc.FormatShape(*f.dims) != f.v {
			return fmt.Errorf("shape or stride %q is not a canonical list of dimensions", f.v)
		}
	}
	if l.Offset != "" {
		if offset, err = alloc.ParseOffset(l.Offset); err != nil || fmt.Sprint(offset) != l.Offset {
			return fmt.Errorf("storage offset %q is not canonical", l.Offset)
		}
	}
	if l.Dtype == "" || l.Shape == "" {
		return nil
	}
	if stride == nil {
		stride = alloc.ContiguousStride(shape)
	}
	extent, err := alloc.Extent(d, shape, stride, offset)
	if err != nil {
		return err
	}
	if extent > size {
		return fmt.Errorf("dtype %s, shape %s, stride %s, offset %d need %d bytes, the segment has %d", l.Dtype, l.Shape, l.Stride, offset, extent, size)
	}
	return nil
}

// checkRelPath checks a path relative to a published directory: clean,
// slash-separated, valid UTF-8, no "." or ".." or empty elements.
func checkRelPath(p string) error {
	if p == "" || len(p) > maxPath || !utf8.ValidString(p) || strings.IndexByte(p, 0) >= 0 ||
		path.Clean(p) != p || p == "." || p == ".." || strings.HasPrefix(p, "/") || strings.HasPrefix(p, "../") {
		return fmt.Errorf("%w: path %q is not a clean relative path", ErrInvalid, p)
	}
	return nil
}

// CheckDir checks the name of a published directory: a clean path relative
// to the mount's root, as every node shows it.
func CheckDir(dir string) error { return checkRelPath(dir) }

// Version is one published snapshot of a directory. Its ID is the hex
// SHA-256 of its entries' encodings in path order, so it names exactly
// those entries (and through their content IDs, those bytes).
type Version struct {
	ID       string
	Entries  []Entry             // "." first, then sorted by Path
	Contents map[string]*Content // every file entry's content, by ID
}

// Bytes returns the total size of the version's files.
func (v *Version) Bytes() int64 {
	var n int64
	for i := range v.Entries {
		n += v.Entries[i].Size
	}
	return n
}

// versionHeader is the value of a version's key: what a reader checks the
// entries it reads against.
type versionHeader struct {
	Entries  int   `json:"entries"`
	Bytes    int64 `json:"bytes"`
	Manifest int64 `json:"manifest"` // bytes of the version's keys and values in etcd
}

// versionID hashes the encoded entries, in path order.
func versionID(encoded [][]byte) string {
	h := sha256.New()
	for _, b := range encoded {
		fmt.Fprintf(h, "%d\n", len(b))
		h.Write(b)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// encodeEntry returns the canonical encoding of e.
func encodeEntry(e *Entry) []byte {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(e); err != nil {
		panic(err) // strings, integers and byte slices always encode
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
}

// entryOrder orders entries by path, "." first.
func entryOrder(a, b Entry) int {
	switch {
	case a.Path == b.Path:
		return 0
	case a.Path == ".":
		return -1
	case b.Path == ".":
		return 1
	}
	return strings.Compare(a.Path, b.Path)
}

// checkTree checks that entries (in entryOrder) form one tree: "." first,
// every parent present and a directory, no path twice.
func checkTree(entries []Entry) error {
	if len(entries) == 0 || entries[0].Path != "." || !entries[0].IsDir() {
		return fmt.Errorf("%w: the entries do not start with the directory itself (\".\")", ErrInvalid)
	}
	dirs := map[string]bool{".": true}
	for i := 1; i < len(entries); i++ {
		e := &entries[i]
		if e.Path == "." || i > 1 && e.Path <= entries[i-1].Path {
			return fmt.Errorf("%w: entries out of order or repeated at %q", ErrInvalid, e.Path)
		}
		if !dirs[path.Dir(e.Path)] {
			return fmt.Errorf("%w: %q: its directory %q is not an entry before it", ErrInvalid, e.Path, path.Dir(e.Path))
		}
		if e.IsDir() {
			dirs[e.Path] = true
		}
	}
	return nil
}
