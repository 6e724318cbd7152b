package safetensors

import (
	"slices"
	"strings"

	"tensorfs/alloc"
)

// Order lists the dtypes of the format in the order of the reference
// implementation's Dtype enum (huggingface/safetensors, tensor.rs), which
// its writer sorts by: the writer lays tensors out by descending dtype in
// this order, then by name. It comes from the shared dtype table.
var Order = alloc.SafetensorsOrder()

// dtype is what the format says about one element type.
type dtype struct {
	tensorfs string // tensorfs's canonical spelling (user.tensor.dtype)
	bits     int64  // bits per element
	rank     int    // index in Order
}

// dtypes maps every safetensors dtype spelling to tensorfs's, from the
// dtype table tensorfs shares with its Python client (alloc/dtypes.json).
var dtypes = buildDtypes()

func buildDtypes() map[string]dtype {
	m := map[string]dtype{}
	for _, d := range alloc.Dtypes() {
		if rank := slices.Index(Order, d.Safetensors); rank >= 0 {
			m[d.Safetensors] = dtype{tensorfs: d.Name, bits: d.Bits, rank: rank}
		}
	}
	return m
}

// TensorfsDtype returns tensorfs's canonical name for a safetensors dtype
// ("F32" gives "float32"), and false for a dtype this package does not know.
func TensorfsDtype(st string) (string, bool) {
	d, ok := dtypes[st]
	return d.tensorfs, ok
}

// FromTensorfsDtype returns the safetensors spelling of a tensorfs
// canonical dtype name ("bfloat16" gives "BF16"), and false for a dtype the
// format cannot hold.
func FromTensorfsDtype(name string) (string, bool) {
	for st, d := range dtypes {
		if d.tensorfs == name {
			return st, true
		}
	}
	return "", false
}

// Bits returns the bits of one element of a safetensors dtype (16 for
// "BF16", 4 for "F4"), and false for a dtype this package does not know.
func Bits(st string) (int64, bool) {
	d, ok := dtypes[st]
	return d.bits, ok
}

// SortByElementSize sorts tensors as a tensorfs pack orders them (the
// Python client's save_state_dict with pack_below, tensorfs import
// --pack-below): by the bits of one element, largest first, then by
// name, byte-wise. Laid out back to back from offset 0 in this order,
// tensors of whole-byte dtypes each start on a whole element. Unknown
// dtypes sort last.
func SortByElementSize(tensors []Tensor) {
	slices.SortStableFunc(tensors, func(a, b Tensor) int {
		ba, _ := Bits(a.Dtype)
		bb, _ := Bits(b.Dtype)
		if ba != bb {
			return cmpInt(bb, ba)
		}
		return strings.Compare(a.Name, b.Name)
	})
}

// SortTensors sorts tensors as the reference writer (serialize) does
// before laying them out: by dtype, descending in Order (so that wider
// elements come first and stay aligned), then by name, byte-wise. Unknown
// dtypes sort last.
func SortTensors(tensors []Tensor) {
	rank := func(st string) int {
		if d, ok := dtypes[st]; ok {
			return d.rank
		}
		return -1
	}
	slices.SortStableFunc(tensors, func(a, b Tensor) int {
		if ra, rb := rank(a.Dtype), rank(b.Dtype); ra != rb {
			return rb - ra
		}
		return strings.Compare(a.Name, b.Name)
	})
}
