// Package safetensors reads and writes the header of the safetensors file
// format: an 8-byte little-endian header length N, N bytes of a JSON object
// describing the tensors, then the byte buffer holding their data.
//
//	{"__metadata__": {"k": "v"}, "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, ...}
//
// ParseHeader validates a header the way the reference implementation
// (huggingface/safetensors) does: the JSON is a UTF-8 object starting with
// '{', every dtype is known, every tensor's data_offsets hold exactly
// numel*itemsize bytes, and the tensors, sorted by offset, tile the byte
// buffer from its first byte to its last with no gap and no overlap.
//
// Encode writes a header the way the reference writer does: compact JSON,
// "__metadata__" first, then the tensors, padded with spaces to a multiple
// of 8 bytes so that the data that follows stays aligned.
package safetensors

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/bits"
	"slices"
	"strconv"
	"unicode/utf8"
)

// MaxHeaderSize is the largest header accepted, as in the reference
// implementation: 100 MB.
const MaxHeaderSize = 100_000_000

// PrefixSize is the size of the little-endian header length that starts a file.
const PrefixSize = 8

// MetadataKey is the header key holding the free-form string metadata.
const MetadataKey = "__metadata__"

// ErrInvalid is wrapped by every error about a malformed file or header.
var ErrInvalid = errors.New("not a valid safetensors file")

// Tensor describes one tensor of a header.
type Tensor struct {
	Name  string
	Dtype string  // safetensors spelling, such as "F32" or "BF16"
	Shape []int64 // dims; empty for a scalar
	Begin int64   // data_offsets[0]: first byte in the byte buffer
	End   int64   // data_offsets[1]: one past the last byte
}

// Size returns the number of bytes the tensor's data takes, End - Begin.
func (t Tensor) Size() int64 { return t.End - t.Begin }

// Header is a parsed safetensors header.
type Header struct {
	// Tensors in the order of their keys in the JSON object.
	Tensors []Tensor
	// Metadata is the "__metadata__" object; nil when the header has none.
	Metadata map[string]string
}

// DataSize returns the size of the byte buffer the header describes: the
// largest End of its tensors, 0 without tensors.
func (h *Header) DataSize() int64 {
	var n int64
	for _, t := range h.Tensors {
		n = max(n, t.End)
	}
	return n
}

// DataOrder returns the indexes of h.Tensors sorted by their position in
// the byte buffer (Begin, then End, then header order).
func (h *Header) DataOrder() []int {
	idx := make([]int, len(h.Tensors))
	for i := range idx {
		idx[i] = i
	}
	slices.SortStableFunc(idx, func(a, b int) int {
		ta, tb := h.Tensors[a], h.Tensors[b]
		if ta.Begin != tb.Begin {
			return cmpInt(ta.Begin, tb.Begin)
		}
		return cmpInt(ta.End, tb.End)
	})
	return idx
}

func cmpInt(a, b int64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// NBytes returns numel(shape) * bitsize(dtype) / 8, failing for an unknown
// dtype, a negative dim, a product that overflows int64, and, as the
// reference implementation does (MisalignedSlice), for a tensor of a
// sub-byte dtype (F4, F6_*) that does not fill whole bytes.
func NBytes(dtype string, shape []int64) (int64, error) {
	d, ok := dtypes[dtype]
	if !ok {
		return 0, fmt.Errorf("%w: unknown dtype %q", ErrInvalid, dtype)
	}
	n := d.bits
	for _, dim := range shape {
		if dim < 0 {
			return 0, fmt.Errorf("%w: negative dim %d in shape", ErrInvalid, dim)
		}
		hi, lo := bits.Mul64(uint64(n), uint64(dim))
		if hi != 0 || lo > math.MaxInt64 {
			return 0, fmt.Errorf("%w: shape %v of %s overflows int64 bytes", ErrInvalid, shape, dtype)
		}
		n = int64(lo)
	}
	if n%8 != 0 {
		return 0, fmt.Errorf("%w: shape %s of %s is %d bits, not whole bytes", ErrInvalid, formatShape(shape), dtype, n)
	}
	return n / 8, nil
}

// Pack lays the tensors out back to back in the byte buffer in the order
// of h.Tensors, starting at 0, setting each Begin and End from its dtype and
// shape.
func (h *Header) Pack() error {
	var off int64
	for i := range h.Tensors {
		t := &h.Tensors[i]
		n, err := NBytes(t.Dtype, t.Shape)
		if err != nil {
			return fmt.Errorf("tensor %q: %w", t.Name, err)
		}
		if n > math.MaxInt64-off {
			return fmt.Errorf("%w: byte buffer overflows int64 at tensor %q", ErrInvalid, t.Name)
		}
		t.Begin, t.End = off, off+n
		off += n
	}
	return nil
}

// Validate checks h against a byte buffer of dataSize bytes: unique names
// other than "__metadata__", known dtypes, data_offsets
// holding exactly numel*itemsize bytes, and tensors that tile the buffer
// with no gap, no overlap and nothing left over.
func (h *Header) Validate(dataSize int64) error {
	seen := make(map[string]bool, len(h.Tensors))
	for _, t := range h.Tensors {
		switch {
		case t.Name == MetadataKey:
			return fmt.Errorf("%w: %q is not a tensor name", ErrInvalid, MetadataKey)
		case seen[t.Name]:
			return fmt.Errorf("%w: tensor %q appears twice", ErrInvalid, t.Name)
		}
		seen[t.Name] = true
		n, err := NBytes(t.Dtype, t.Shape)
		if err != nil {
			return fmt.Errorf("tensor %q: %w", t.Name, err)
		}
		if t.Begin < 0 || t.End < t.Begin {
			return fmt.Errorf("%w: tensor %q has data_offsets [%d, %d], want begin <= end",
				ErrInvalid, t.Name, t.Begin, t.End)
		}
		if t.End > dataSize {
			return fmt.Errorf("%w: tensor %q data_offsets [%d, %d] run past the %d-byte data buffer (truncated file?)",
				ErrInvalid, t.Name, t.Begin, t.End, dataSize)
		}
		if t.Size() != n {
			return fmt.Errorf("%w: tensor %q has %d bytes in data_offsets [%d, %d], but %s %s needs %d",
				ErrInvalid, t.Name, t.Size(), t.Begin, t.End, t.Dtype, formatShape(t.Shape), n)
		}
	}
	var at int64
	var prev string
	for _, i := range h.DataOrder() {
		t := h.Tensors[i]
		switch {
		case t.Begin < at:
			return fmt.Errorf("%w: tensors %q and %q overlap in the data buffer", ErrInvalid, prev, t.Name)
		case t.Begin > at:
			return fmt.Errorf("%w: %d unused bytes at offset %d of the data buffer, before tensor %q",
				ErrInvalid, t.Begin-at, at, t.Name)
		}
		at, prev = t.End, t.Name
	}
	if at != dataSize {
		return fmt.Errorf("%w: the tensors cover %d bytes, but the data buffer has %d", ErrInvalid, at, dataSize)
	}
	return nil
}

// ReadHeader reads the header of a safetensors file of the given size:
// its length prefix, then the header itself. It returns the parsed,
// validated header and its raw bytes (padding included); the byte buffer
// starts at PrefixSize + len(raw).
func ReadHeader(r io.ReaderAt, size int64) (h *Header, raw []byte, err error) {
	if size < PrefixSize {
		return nil, nil, fmt.Errorf("%w: %d bytes is shorter than the 8-byte header length", ErrInvalid, size)
	}
	var prefix [PrefixSize]byte
	if _, err := r.ReadAt(prefix[:], 0); err != nil {
		return nil, nil, err
	}
	n := binary.LittleEndian.Uint64(prefix[:])
	if n > MaxHeaderSize {
		return nil, nil, fmt.Errorf("%w: header length %d is over the %d-byte limit", ErrInvalid, n, MaxHeaderSize)
	}
	if int64(n) > size-PrefixSize {
		return nil, nil, fmt.Errorf("%w: header length %d runs past the end of the %d-byte file (truncated?)",
			ErrInvalid, n, size)
	}
	raw = make([]byte, n)
	if _, err := r.ReadAt(raw, PrefixSize); err != nil {
		return nil, nil, err
	}
	h, err = ParseHeader(raw, size-PrefixSize-int64(n))
	if err != nil {
		return nil, nil, err
	}
	return h, raw, nil
}

// ParseHeader parses and validates the JSON header raw (without its length
// prefix) of a file whose byte buffer is dataSize bytes long.
func ParseHeader(raw []byte, dataSize int64) (*Header, error) {
	if len(raw) > MaxHeaderSize {
		return nil, fmt.Errorf("%w: header length %d is over the %d-byte limit", ErrInvalid, len(raw), MaxHeaderSize)
	}
	if !utf8.Valid(raw) {
		return nil, fmt.Errorf("%w: header is not valid UTF-8", ErrInvalid)
	}
	if len(raw) == 0 || raw[0] != '{' {
		return nil, fmt.Errorf("%w: header does not start with '{'", ErrInvalid)
	}
	h, err := decode(raw)
	if err != nil {
		return nil, err
	}
	if err := h.Validate(dataSize); err != nil {
		return nil, err
	}
	return h, nil
}

// tensorJSON is one tensor entry as it appears in the JSON header. Keys
// other than these three are ignored, as by the reference implementation.
type tensorJSON struct {
	Dtype       *string
	Shape       *[]uint64
	DataOffsets *[]uint64
}

// decode reads the JSON object, keeping the order of its keys.
func decode(raw []byte) (*Header, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: bad JSON header: %s", ErrInvalid, fmt.Sprintf(format, args...))
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, bad("not a JSON object")
	}
	h := &Header{}
	seen := map[string]bool{}
	for dec.More() {
		key, err := objectKey(dec, seen)
		if err != nil {
			return nil, bad("%v", err)
		}
		if key == MetadataKey {
			var meta map[string]string
			if err := dec.Decode(&meta); err != nil {
				return nil, bad("%s is not an object of strings: %v", MetadataKey, err)
			}
			h.Metadata = meta
			continue
		}
		tj, err := decodeTensor(dec)
		if err != nil {
			return nil, bad("tensor %q: %v", key, err)
		}
		t, err := tj.tensor(key)
		if err != nil {
			return nil, err
		}
		h.Tensors = append(h.Tensors, t)
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return nil, bad("unterminated object")
	}
	rest := raw[dec.InputOffset():]
	if len(bytes.Trim(rest, " \t\r\n")) != 0 {
		return nil, bad("trailing data after the object")
	}
	return h, nil
}

// decodeTensor reads one tensor entry key by key. Keys match exactly, as
// in the reference implementation and the Python client, not in any case
// as encoding/json matches struct fields: an entry's "DTYPE" is not its
// dtype. A key may not repeat.
func decodeTensor(dec *json.Decoder) (tensorJSON, error) {
	var tj tensorJSON
	err := decodeObject(dec, func(key string) error {
		var v any
		switch key {
		case "dtype":
			v = &tj.Dtype
		case "shape":
			v = &tj.Shape
		case "data_offsets":
			v = &tj.DataOffsets
		default:
			v = new(json.RawMessage)
		}
		return dec.Decode(v)
	})
	return tj, err
}

// tensor checks the fields of one entry and converts them.
func (tj tensorJSON) tensor(name string) (Tensor, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: tensor %q: %s", ErrInvalid, name, fmt.Sprintf(format, args...))
	}
	switch {
	case tj.Dtype == nil:
		return Tensor{}, bad("no dtype")
	case tj.Shape == nil:
		return Tensor{}, bad("no shape")
	case tj.DataOffsets == nil:
		return Tensor{}, bad("no data_offsets")
	case len(*tj.DataOffsets) != 2:
		return Tensor{}, bad("data_offsets has %d numbers, want [begin, end]", len(*tj.DataOffsets))
	}
	if _, ok := dtypes[*tj.Dtype]; !ok {
		return Tensor{}, bad("unknown dtype %q", *tj.Dtype)
	}
	t := Tensor{Name: name, Dtype: *tj.Dtype, Shape: make([]int64, len(*tj.Shape))}
	for i, d := range *tj.Shape {
		if d > math.MaxInt64 {
			return Tensor{}, bad("dim %d is out of range", d)
		}
		t.Shape[i] = int64(d)
	}
	offs := *tj.DataOffsets
	if offs[0] > math.MaxInt64 || offs[1] > math.MaxInt64 {
		return Tensor{}, bad("data_offsets %v out of range", offs)
	}
	t.Begin, t.End = int64(offs[0]), int64(offs[1])
	return t, nil
}

// Encode returns the header in the reference writer's layout: compact JSON
// with "__metadata__" first (when Metadata is not nil, its keys sorted),
// then the tensors in the order of h.Tensors, each as
// {"dtype":..,"shape":[..],"data_offsets":[b,e]}, padded with spaces to a
// multiple of 8 bytes. Strings are escaped as serde_json escapes them.
func (h *Header) Encode() []byte {
	var b []byte
	b = append(b, '{')
	if h.Metadata != nil {
		b = appendString(b, MetadataKey)
		b = append(b, ':', '{')
		keys := make([]string, 0, len(h.Metadata))
		for k := range h.Metadata {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for i, k := range keys {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendString(b, k)
			b = append(b, ':')
			b = appendString(b, h.Metadata[k])
		}
		b = append(b, '}')
	}
	for i, t := range h.Tensors {
		if i > 0 || h.Metadata != nil {
			b = append(b, ',')
		}
		b = appendString(b, t.Name)
		b = append(b, `:{"dtype":`...)
		b = appendString(b, t.Dtype)
		b = append(b, `,"shape":[`...)
		for j, d := range t.Shape {
			if j > 0 {
				b = append(b, ',')
			}
			b = strconv.AppendInt(b, d, 10)
		}
		b = append(b, `],"data_offsets":[`...)
		b = strconv.AppendInt(b, t.Begin, 10)
		b = append(b, ',')
		b = strconv.AppendInt(b, t.End, 10)
		b = append(b, ']', '}')
	}
	b = append(b, '}')
	for len(b)%8 != 0 {
		b = append(b, ' ')
	}
	return b
}

// appendString appends s as a JSON string, escaped as serde_json does:
// '"', '\\' and control characters only, with \b \t \n \f \r for those that
// have a short form and lower-case \u00XX for the rest.
func appendString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c == '\b':
			b = append(b, '\\', 'b')
		case c == '\t':
			b = append(b, '\\', 't')
		case c == '\n':
			b = append(b, '\\', 'n')
		case c == '\f':
			b = append(b, '\\', 'f')
		case c == '\r':
			b = append(b, '\\', 'r')
		case c < 0x20:
			b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
}

// AppendPrefix appends the 8-byte little-endian length of header to b.
func AppendPrefix(b []byte, header []byte) []byte {
	return binary.LittleEndian.AppendUint64(b, uint64(len(header)))
}

// formatShape prints a shape as "[2, 3]".
func formatShape(shape []int64) string {
	b := []byte{'['}
	for i, d := range shape {
		if i > 0 {
			b = append(b, ", "...)
		}
		b = strconv.AppendInt(b, d, 10)
	}
	return string(append(b, ']'))
}
