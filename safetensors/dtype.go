package safetensors

// dtype is what the format says about one element type.
type dtype struct {
	tensorfs string // tensorfs's canonical spelling (user.tensor.dtype)
	size     int64  // bytes per element
}

// dtypes maps every safetensors dtype spelling this package knows.
var dtypes = map[string]dtype{
	"F64":     {"float64", 8},
	"F32":     {"float32", 4},
	"F16":     {"float16", 2},
	"BF16":    {"bfloat16", 2},
	"I64":     {"int64", 8},
	"I32":     {"int32", 4},
	"I16":     {"int16", 2},
	"I8":      {"int8", 1},
	"U8":      {"uint8", 1},
	"BOOL":    {"bool", 1},
	"F8_E4M3": {"float8_e4m3fn", 1},
	"F8_E5M2": {"float8_e5m2", 1},
	"U16":     {"uint16", 2},
	"U32":     {"uint32", 4},
	"U64":     {"uint64", 8},
	"C64":     {"complex64", 8},
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
