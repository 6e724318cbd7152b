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
