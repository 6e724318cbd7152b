package alloc

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
)

// Dtype is an element type, stored by its canonical (PyTorch) spelling.
type Dtype struct {
	Name string // canonical PyTorch spelling without "torch.", such as "float32"
	Size int64  // bytes per element, rounded up: 1 for the packed sub-byte types
	Bits int64  // bits per element: 4 or 6 for the packed sub-byte types, else 8*Size
}

// Packed reports whether d's elements are packed below a byte (Bits%8 != 0):
// a tensor of them must be contiguous, start at byte 0 and fill whole bytes.
func (d Dtype) Packed() bool { return d.Bits%8 != 0 }

// DtypeInfo is one entry of the dtype table, dtypes.json.
type DtypeInfo struct {
	Name         string   `json:"name"`
	Bits         int64    `json:"bits"`
	Safetensors  string   `json:"safetensors"` // "" when the format has no such type
	Torch        string   `json:"torch"`
	TorchPack    int64    `json:"torch_pack"`
	NumPy        string   `json:"numpy"`
	TorchAliases []string `json:"torch_aliases"`
	NumPyAliases []string `json:"numpy_aliases"`
	NumPyCodes   []string `json:"numpy_codes"`
}

// DtypesJSON is the dtype table that Go and the Python client share. The Python package ships
// a copy (python/tensorfs/dtypes.json, written by go generate; a test checks it is the same).
//
//go:generate cp dtypes.json ../python/tensorfs/dtypes.json
//go:embed dtypes.json
var DtypesJSON []byte

// dtypeTable lists the dtypes of DtypesJSON in its order; safetensorsOrder
// is its safetensors_order.
var dtypeTable, safetensorsOrder = parseDtypeTable(DtypesJSON)

// dtypeNames maps every accepted lower-case spelling to its canonical Dtype;
// safetensorsNames maps the format's spellings, exactly as it writes them.
var dtypeNames, safetensorsNames = buildDtypeNames(dtypeTable)

// Dtypes returns the dtype table, in the order of dtypes.json.
func Dtypes() []DtypeInfo { return slices.Clone(dtypeTable) }

// SafetensorsOrder returns the safetensors dtypes in the order of the
// reference implementation's Dtype enum, by which its writer sorts.
func SafetensorsOrder() []string { return slices.Clone(safetensorsOrder) }

func parseDtypeTable(b []byte) ([]DtypeInfo, []string) {
	var t struct {
		Dtypes []DtypeInfo
		Order  []string `json:"safetensors_order"`
	}
	if err := json.Unmarshal(b, &t); err != nil {
		panic("alloc: dtypes.json: " + err.Error())
	}
	return t.Dtypes, t.Order
}

// buildDtypeNames lists the accepted spellings, as dtypes.json describes them: the
// case-insensitive ones, and safetensors' own, which match as the format writes them (upper
// case), since three of them lower-cased are NumPy codes of other types ("I8" is int8, "i8"
// int64; "U8", "u8"; "F4" float4_e2m1fn, "f4" float32). NumPy's one-letter type codes are not
// accepted: matching is case-insensitive, and "b"/"B" or "l"/"L" would then be ambiguous.
func buildDtypeNames(table []DtypeInfo) (names, safetensors map[string]Dtype) {
	names, safetensors = map[string]Dtype{}, map[string]Dtype{}
	for _, e := range table {
		d := Dtype{Name: e.Name, Size: (e.Bits + 7) / 8, Bits: e.Bits}
		if e.Safetensors != "" {
			safetensors[e.Safetensors] = d
		}
		for _, alias := range append([]string{e.Name}, e.TorchAliases...) {
			names[alias] = d
			names["torch."+alias] = d
		}
		for _, alias := range e.NumPyAliases {
			names[alias] = d
		}
		for _, code := range e.NumPyCodes {
			for _, order := range []string{"", "<", "=", "|"} {
				names[order+code] = d
			}
		}
	}
	return names, safetensors
}

// ParseDtype parses a safetensors, PyTorch or NumPy dtype spelling, such as "F32", "BF16",
// "torch.float32", "float", "<f4" or "single", ignoring surrounding whitespace, and returns the
// canonical Dtype. Safetensors' spellings match as the format writes them (upper case, and
// before the others: "I8" is int8), the others case-insensitively. Big-endian NumPy codes
// (">f4") and unknown names are errors wrapping ErrInvalid that quote s as given.
func ParseDtype(s string) (Dtype, error) {
	given := strings.TrimSpace(s)
	if d, ok := safetensorsNames[given]; ok {
		return d, nil
	}
	lower := lowerASCII(given)
	if d, ok := dtypeNames[lower]; ok {
		return d, nil
	}
	if strings.HasPrefix(lower, ">") || strings.HasPrefix(lower, "!") {
		return Dtype{}, fmt.Errorf("%w: big-endian dtype %q, only little-endian is stored", ErrInvalid, given)
	}
	return Dtype{}, fmt.Errorf("%w: unknown dtype %q", ErrInvalid, given)
}

// Limits on shape and stride values.
const (
	maxDims     = 64
	maxShapeLen = 4096
)

// ParseShape parses a shape or stride: comma-separated non-negative decimal integers,
// optionally in brackets or parentheses, with whitespace ignored and a trailing comma allowed,
// such as "[1024, 768]", "(3,)" or "1024,768". "[]" and "()" give a scalar (an empty, non-nil
// slice). More than 64 dims, input over 4096 bytes and anything else that does not
// parse are errors wrapping ErrInvalid.
func ParseShape(s string) ([]int64, error) {
	if len(s) > maxShapeLen {
		return nil, fmt.Errorf("%w: shape longer than %d bytes", ErrInvalid, maxShapeLen)
	}
	body := strings.TrimSpace(s)
	if body == "" {
		return nil, fmt.Errorf("%w: empty shape, use \"[]\" for a scalar", ErrInvalid)
	}
	if body[0] == '[' || body[0] == '(' {
		closer := "]"
		if body[0] == '(' {
			closer = ")"
		}
		if len(body) < 2 || !strings.HasSuffix(body, closer) {
			return nil, fmt.Errorf("%w: unbalanced brackets in shape %q", ErrInvalid, s)
		}
		body = strings.TrimSpace(body[1 : len(body)-1])
	}
	dims := []int64{}
	if body == "" {
		return dims, nil
	}
	elems := strings.Split(body, ",")
	if len(elems) > 1 && strings.TrimSpace(elems[len(elems)-1]) == "" {
		elems = elems[:len(elems)-1] // trailing comma, as in "(3,)"
	}
	if len(elems) > maxDims {
		return nil, fmt.Errorf("%w: shape has more than %d dims", ErrInvalid, maxDims)
	}
	for _, e := range elems {
		n, err := parseNonNegative(strings.TrimSpace(e))
		if err != nil {
			return nil, fmt.Errorf("%w in shape %q", err, s)
		}
		dims = append(dims, n)
	}
	return dims, nil
}

// FormatShape returns the canonical form of a shape or stride, such as "[1024, 768]", or
// "[]" for a scalar.
func FormatShape(dims []int64) string {
	parts := make([]string, len(dims))
	for i, d := range dims {
		parts[i] = strconv.FormatInt(d, 10)
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

// ParseOffset parses a storage offset: a non-negative decimal int64, surrounding whitespace
// ignored. Anything else is an error wrapping ErrInvalid.
func ParseOffset(s string) (int64, error) {
	n, err := parseNonNegative(strings.TrimSpace(s))
	if err != nil {
		return 0, fmt.Errorf("%w as storage offset", err)
	}
	return n, nil
}

// parseNonNegative parses a string of decimal digits that fits in an int64.
func parseNonNegative(s string) (int64, error) {
	if s == "" || strings.Trim(s, "0123456789") != "" {
		return 0, fmt.Errorf("%w: %q is not a non-negative integer", ErrInvalid, s)
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%w: %q does not fit in int64", ErrInvalid, s)
	}
	return n, nil
}

// Extent returns the number of bytes a tensor with this layout reaches into its storage:
// (offset + 1 + sum((shape[i]-1)*stride[i])) * d.Size, or 0 when any shape dim is 0. A nil
// stride means contiguous. Shape, stride and offset are in elements and must be non-negative.
// A packed sub-byte dtype (d.Packed) takes numel*d.Bits/8 bytes: its tensors must be
// contiguous, at offset 0, and fill whole bytes. A stride whose length differs from the
// shape's, a negative value, a Dtype without a size, a packed layout that breaks those rules
// and int64 overflow are errors wrapping ErrInvalid.
func Extent(d Dtype, shape, stride []int64, offset int64) (int64, error) {
	if d.Packed() {
		return packedExtent(d, shape, stride, offset)
	}
	if stride == nil {
		stride = ContiguousStride(shape)
	}
	if len(stride) != len(shape) {
		return 0, fmt.Errorf("%w: stride has %d dims, shape has %d", ErrInvalid, len(stride), len(shape))
	}
	if d.Size <= 0 {
		return 0, fmt.Errorf("%w: dtype %q has no element size", ErrInvalid, d.Name)
	}
	if offset < 0 {
		return 0, fmt.Errorf("%w: negative storage offset %d", ErrInvalid, offset)
	}
	for i := range shape {
		if shape[i] < 0 || stride[i] < 0 {
			return 0, fmt.Errorf("%w: negative shape or stride in dim %d", ErrInvalid, i)
		}
	}
	for _, n := range shape {
		if n == 0 {
			return 0, nil
		}
	}
	end, ok := checkedAdd(offset, 1)
	for i := 0; ok && i < len(shape); i++ {
		var reach int64
		if reach, ok = checkedMul(shape[i]-1, stride[i]); ok {
			end, ok = checkedAdd(end, reach)
		}
	}
	if ok {
		end, ok = checkedMul(end, d.Size)
	}
	if !ok {
		return 0, fmt.Errorf("%w: tensor extent overflows int64", ErrInvalid)
	}
	return end, nil
}

// packedExtent is Extent for a packed sub-byte dtype.
func packedExtent(d Dtype, shape, stride []int64, offset int64) (int64, error) {
	if (stride != nil && !slices.Equal(stride, ContiguousStride(shape))) || offset != 0 {
		return 0, fmt.Errorf("%w: %s packs %d-bit elements: only a contiguous layout at offset 0", ErrInvalid, d.Name, d.Bits)
	}
	bits, ok := d.Bits, d.Bits > 0
	for i := 0; ok && i < len(shape); i++ {
		if shape[i] < 0 {
			return 0, fmt.Errorf("%w: negative shape in dim %d", ErrInvalid, i)
		}
		bits, ok = checkedMul(bits, shape[i])
	}
	switch {
	case !ok:
		return 0, fmt.Errorf("%w: tensor extent overflows int64", ErrInvalid)
	case bits%8 != 0:
		return 0, fmt.Errorf("%w: shape %s of %d-bit %s is %d bits, not whole bytes", ErrInvalid, FormatShape(shape), d.Bits, d.Name, bits)
	}
	return bits / 8, nil
}

// ContiguousStride returns the row-major strides, in elements, of a contiguous tensor with
// this shape, as PyTorch computes them (a 0 dim counts as 1). Strides that would overflow
// int64 saturate at math.MaxInt64.
func ContiguousStride(shape []int64) []int64 {
	stride := make([]int64, len(shape))
	next := int64(1)
	for i := len(shape) - 1; i >= 0; i-- {
		stride[i] = next
		var ok bool
		if next, ok = checkedMul(next, max(shape[i], 1)); !ok {
			next = math.MaxInt64
		}
	}
	return stride
}

// checkedAdd returns a+b for non-negative a and b, and whether it fits in int64.
func checkedAdd(a, b int64) (int64, bool) {
	return a + b, a <= math.MaxInt64-b
}

// checkedMul returns a*b for non-negative a and b, and whether it fits in int64.
func checkedMul(a, b int64) (int64, bool) {
	if a != 0 && b > math.MaxInt64/a {
		return 0, false
	}
	return a * b, true
}
