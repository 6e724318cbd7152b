package safetensors

import (
	"bytes"
	"encoding/binary"
	"errors"
	"reflect"
	"strings"
	"testing"
)

// file assembles a whole safetensors file from a header and a byte buffer.
func file(header string, data []byte) []byte {
	b := AppendPrefix(nil, []byte(header))
	b = append(b, header...)
	return append(b, data...)
}

// TestEncodeReference compares Encode with files the reference writer
// (huggingface/safetensors serialize) produces for the same tensors.
func TestEncodeReference(t *testing.T) {
	for _, tc := range []struct {
		name string
		h    Header
		want string
	}{
		{
			name: "one tensor",
			h:    Header{Tensors: []Tensor{{Name: "attn.0", Dtype: "F32", Shape: []int64{1, 2, 3}, Begin: 0, End: 24}}},
			want: `{"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}}`, // 64 bytes, no padding
		},
		{
			name: "padded",
			h:    Header{Tensors: []Tensor{{Name: "attn0", Dtype: "F32", Shape: []int64{1, 1, 2, 3}, Begin: 0, End: 24}}},
			want: `{"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}}       `,
		},
		{
			name: "empty",
			h:    Header{},
			want: `{}      `,
		},
		{
			name: "metadata only",
			h:    Header{Metadata: map[string]string{"framework": "pt"}},
			want: `{"__metadata__":{"framework":"pt"}}     `,
		},
		{
			name: "metadata first, scalar",
			h: Header{
				Metadata: map[string]string{"b": "2", "a": "1"},
				Tensors:  []Tensor{{Name: "s", Dtype: "F64", Shape: []int64{}, Begin: 0, End: 8}},
			},
			want: `{"__metadata__":{"a":"1","b":"2"},"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]}}  `,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := tc.h.Encode()
			if string(got) != tc.want {
				t.Errorf("Encode = %q\nwant     %q", got, tc.want)
			}
			if len(got)%8 != 0 {
				t.Errorf("Encode length %d is not a multiple of 8", len(got))
			}
		})
	}
}

// TestEscape checks strings are escaped as serde_json escapes them and
// read back unchanged.
func TestEscape(t *testing.T) {
	name := "a\"b\\c\n\t\x01\x1f\x7fé/\u2028<>&"
	want := `"a\"b\\c\n\t\u0001\u001f` + "\x7fé/\u2028<>&" + `"`
	if got := string(appendString(nil, name)); got != want {
		t.Errorf("appendString = %q, want %q", got, want)
	}
	h := Header{
		Metadata: map[string]string{name: name},
		Tensors:  []Tensor{{Name: name, Dtype: "U8", Shape: []int64{3}}},
	}
	if err := h.Pack(); err != nil {
		t.Fatal(err)
	}
	back, err := ParseHeader(h.Encode(), 3)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, &h) {
		t.Errorf("round trip: got %+v, want %+v", back, h)
	}
}

// TestRoundTrip packs tensors of every dtype, writes a file, reads it back
// and checks the header, the raw bytes and each tensor's data.
func TestRoundTrip(t *testing.T) {
	h := Header{Metadata: map[string]string{"format": "pt", "note": "x"}}
	i := int64(1)
	for st := range dtypes {
		h.Tensors = append(h.Tensors, Tensor{Name: "t/" + st, Dtype: st, Shape: []int64{i, 4}}) // 4: whole bytes of F6
		i++
	}
	h.Tensors = append(h.Tensors,
		Tensor{Name: "scalar", Dtype: "I32", Shape: []int64{}},
		Tensor{Name: "empty", Dtype: "F32", Shape: []int64{0, 5}})
	if err := h.Pack(); err != nil {
		t.Fatal(err)
	}
	data := make([]byte, h.DataSize())
	for j := range data {
		data[j] = byte(j * 7)
	}
	enc := h.Encode()
	f := file(string(enc), data)

	got, raw, err := ReadHeader(bytes.NewReader(f), int64(len(f)))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(raw, enc) {
		t.Errorf("raw header %q, want %q", raw, enc)
	}
	if !reflect.DeepEqual(got, &h) {
		t.Errorf("ReadHeader = %+v\nwant %+v", got, h)
	}
	if !bytes.Equal(got.Encode(), enc) {
		t.Errorf("re-encoding differs")
	}
	start := PrefixSize + int64(len(raw))
	for _, tn := range got.Tensors {
		if !bytes.Equal(f[start+tn.Begin:start+tn.End], data[tn.Begin:tn.End]) {
			t.Errorf("tensor %s: data differs", tn.Name)
		}
	}
}

// TestDataOrder keeps header order and data order apart.
func TestDataOrder(t *testing.T) {
	hdr := `{"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]},` +
		`"z":{"dtype":"U8","shape":[0],"data_offsets":[3,3]},` +
		`"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}`
	h, err := ParseHeader([]byte(hdr), 5)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := h.DataOrder(), []int{2, 1, 0}; !reflect.DeepEqual(got, want) {
		t.Errorf("DataOrder = %v, want %v", got, want)
	}
	if h.Tensors[0].Name != "b" || h.Tensors[2].Name != "a" {
		t.Errorf("header order lost: %+v", h.Tensors)
	}
	if h.Metadata != nil {
		t.Errorf("Metadata = %v, want nil without __metadata__", h.Metadata)
	}
}

// TestMalformed: every way a file can be wrong is refused with an error
// that wraps ErrInvalid and says what is wrong.
func TestMalformed(t *testing.T) {
	const okTensor = `"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}`
	eight := make([]byte, 8)
	for _, tc := range []struct {
		name string
		file []byte
		want string
	}{
		{"empty file", nil, "shorter than the 8-byte"},
		{"short file", []byte{1, 2, 3}, "shorter than the 8-byte"},
		{"header past EOF", func() []byte {
			f := file("{"+okTensor+"}", eight)
			return f[:20]
		}(), "runs past the end"},
		{"huge header length", binary.LittleEndian.AppendUint64(nil, 1<<40), "over the"},
		{"header just over the limit", binary.LittleEndian.AppendUint64(nil, MaxHeaderSize+1), "over the"},
		{"bad JSON", file(`{"w":{"dtype":"F32",`, nil), "bad JSON"},
		{"not an object", file(`[1, 2]`, nil), "start with '{'"},
		{"leading space", file(` {}`, nil), "start with '{'"},
		{"invalid UTF-8", file("{\"\xff\":{}}", nil), "UTF-8"},
		{"trailing garbage", file(`{}x`, nil), "trailing data"},
		{"second object", file(`{}{}`, nil), "trailing data"},
		{"duplicate key", file("{"+okTensor+","+okTensor+"}", append(eight, eight...)), "twice"},
		{"entry not an object", file(`{"w":3}`, nil), "tensor \"w\""},
		{"missing dtype", file(`{"w":{"shape":[2],"data_offsets":[0,8]}}`, eight), "no dtype"},
		{"missing shape", file(`{"w":{"dtype":"F32","data_offsets":[0,8]}}`, eight), "no shape"},
		{"missing offsets", file(`{"w":{"dtype":"F32","shape":[2]}}`, eight), "no data_offsets"},
		{"three offsets", file(`{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8,9]}}`, eight), "want [begin, end]"},
		{"negative dim", file(`{"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}`, eight), "tensor \"w\""},
		{"fractional dim", file(`{"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}}`, eight), "tensor \"w\""},
		{"dim out of range", file(`{"w":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,8]}}`, eight), "out of range"},
		{"offset out of range", file(`{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615]}}`, eight), "out of range"},
		{"shape overflows", file(`{"w":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}}`, eight), "overflows"},
		{"unknown dtype", file(`{"w":{"dtype":"F128","shape":[2],"data_offsets":[0,8]}}`, eight), "unknown dtype"},
		{"lower-case dtype", file(`{"w":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}}`, eight), "unknown dtype"},
		{"offsets past buffer", file(`{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`, eight[:6]), "run past"},
		{"begin after end", file(`{"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}}`, eight), "begin <= end"},
		{"wrong size", file(`{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}`, eight), "needs 12"},
		{"overlap", file(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},`+
			`"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}`, make([]byte, 12)), "overlap"},
		{"same range twice", file(`{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},`+
			`"b":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}`, eight), "overlap"},
		{"gap", file(`{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},`+
			`"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}`, eight[:6]), "unused bytes"},
		{"trailing bytes", file("{"+okTensor+"}", append(eight, 0)), "cover 8 bytes"},
		{"metadata not strings", file(`{"__metadata__":{"a":1}}`, nil), "__metadata__"},
		{"metadata not object", file(`{"__metadata__":"x"}`, nil), "__metadata__"},
		{"duplicate dtype", file(`{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"dtype":"F32"}}`, eight), `tensor "w": key "dtype" appears twice`},
		{"duplicate ignored key", file(`{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1,"x":2}}`, eight), `key "x" appears twice`},
		{"only DTYPE", file(`{"w":{"DTYPE":"F32","shape":[2],"data_offsets":[0,8]}}`, eight), "no dtype"},
		{"only Shape", file(`{"w":{"dtype":"F32","Shape":[2],"data_offsets":[0,8]}}`, eight), "no shape"},
		{"entry null", file(`{"w":null}`, nil), "tensor \"w\""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, _, err := ReadHeader(bytes.NewReader(tc.file), int64(len(tc.file)))
			if err == nil {
				t.Fatalf("ReadHeader accepted it: %+v", h)
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("error %v does not wrap ErrInvalid", err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not say %q", err, tc.want)
			}
			if strings.Contains(err.Error(), "\n") {
				t.Errorf("error %q is more than one line", err)
			}
		})
	}
}

// TestEntryKeys: a tensor entry's keys match exactly, as in the reference
// implementation and the Python client; keys of other case, or unknown,
// are ignored, and "__metadata__" is read as before.
func TestEntryKeys(t *testing.T) {
	for _, tc := range []struct {
		name, header string
		want         Tensor
		meta         map[string]string
	}{
		{"DTYPE after dtype", `{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"DTYPE":"I32"}}`,
			Tensor{Name: "w", Dtype: "F32", Shape: []int64{1}, End: 4}, nil},
		{"DTYPE before dtype", `{"w":{"DTYPE":"I32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}`,
			Tensor{Name: "w", Dtype: "F32", Shape: []int64{1}, End: 4}, nil},
		{"Shape ignored", `{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"Shape":[2,2]}}`,
			Tensor{Name: "w", Dtype: "F32", Shape: []int64{1}, End: 4}, nil},
		{"Data_Offsets ignored", `{"w":{"Data_Offsets":[4,8],"dtype":"U8","shape":[4],"data_offsets":[0,4]}}`,
			Tensor{Name: "w", Dtype: "U8", Shape: []int64{4}, End: 4}, nil},
		{"unknown keys ignored", `{"w":{"dtype":"F32","x":{"y":[1,"z"]},"shape":[1],"data_offsets":[0,4],"__metadata__":1}}`,
			Tensor{Name: "w", Dtype: "F32", Shape: []int64{1}, End: 4}, nil},
		{"__metadata__ unaffected", `{"__metadata__":{"dtype":"I32","DTYPE":"U8","Shape":"[2]"},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`,
			Tensor{Name: "w", Dtype: "F32", Shape: []int64{1}, End: 4}, map[string]string{"dtype": "I32", "DTYPE": "U8", "Shape": "[2]"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, err := ParseHeader([]byte(tc.header), 4)
			if err != nil {
				t.Fatal(err)
			}
			want := &Header{Tensors: []Tensor{tc.want}, Metadata: tc.meta}
			if !reflect.DeepEqual(h, want) {
				t.Errorf("ParseHeader = %+v, want %+v", h, want)
			}
		})
	}
}

// TestValidateNames refuses tensors that the JSON cannot tell apart.
func TestValidateNames(t *testing.T) {
	h := Header{Tensors: []Tensor{{Name: MetadataKey, Dtype: "U8", Shape: []int64{1}, End: 1}}}
	if err := h.Validate(1); err == nil || !errors.Is(err, ErrInvalid) {
		t.Errorf("a tensor named %s: Validate = %v, want ErrInvalid", MetadataKey, err)
	}
	h = Header{Tensors: []Tensor{{Name: "a", Dtype: "U8", Shape: []int64{1}}, {Name: "a", Dtype: "U8", Shape: []int64{1}}}}
	if err := h.Pack(); err != nil {
		t.Fatal(err)
	}
	if err := h.Validate(2); err == nil || !strings.Contains(err.Error(), "twice") {
		t.Errorf("two tensors named a: Validate = %v, want \"twice\"", err)
	}
}

// TestDtypes checks the mapping to tensorfs names and back: every dtype
// of the reference format, and only those.
func TestDtypes(t *testing.T) {
	want := map[string]string{
		"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
		"I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
		"BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
		"U16": "uint16", "U32": "uint32", "U64": "uint64", "C64": "complex64",
		"F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
		"F4": "float4_e2m1fn", "F6_E2M3": "float6_e2m3fn", "F6_E3M2": "float6_e3m2fn",
	}
	if len(dtypes) != len(want) || len(Order) != len(want) {
		t.Errorf("%d dtypes, %d in Order, want %d", len(dtypes), len(Order), len(want))
	}
	for st, name := range want {
		got, ok := TensorfsDtype(st)
		if !ok || got != name {
			t.Errorf("TensorfsDtype(%s) = %q %v, want %q", st, got, ok, name)
		}
		back, ok := FromTensorfsDtype(name)
		if !ok || back != st {
			t.Errorf("FromTensorfsDtype(%s) = %q %v, want %q", name, back, ok, st)
		}
	}
	if _, ok := FromTensorfsDtype("complex128"); ok {
		t.Errorf("FromTensorfsDtype(complex128) is known: safetensors has no such dtype")
	}
	for _, tc := range []struct {
		dtype string
		shape []int64
		want  int64 // -1: refused
	}{
		{"F4", []int64{2, 3}, 3}, {"F4", []int64{3}, -1}, {"F4", []int64{}, -1},
		{"F6_E2M3", []int64{4}, 3}, {"F6_E3M2", []int64{2}, -1}, {"F8_E8M0", []int64{5}, 5},
		{"C64", []int64{2}, 16}, {"F4", []int64{0}, 0},
	} {
		n, err := NBytes(tc.dtype, tc.shape)
		if tc.want < 0 && !errors.Is(err, ErrInvalid) || tc.want >= 0 && (err != nil || n != tc.want) {
			t.Errorf("NBytes(%s, %v) = %d, %v; want %d", tc.dtype, tc.shape, n, err, tc.want)
		}
	}
}

// TestSortTensors checks the reference writer's order: dtype descending in
// the enum's order, then name; BF16 before F16 and I16 although all are
// two bytes wide.
func TestSortTensors(t *testing.T) {
	ts := []Tensor{
		{Name: "b", Dtype: "F16"}, {Name: "a", Dtype: "I16"}, {Name: "c", Dtype: "BF16"},
		{Name: "z", Dtype: "F4"}, {Name: "y", Dtype: "U64"}, {Name: "B", Dtype: "F16"},
		{Name: "x", Dtype: "BOOL"}, {Name: "w", Dtype: "F8_E4M3FNUZ"}, {Name: "v", Dtype: "F8_E8M0"},
	}
	SortTensors(ts)
	want := "U64:y BF16:c F16:B F16:b I16:a F8_E4M3FNUZ:w F8_E8M0:v F4:z BOOL:x"
	if got := dtypesAndNames(ts); got != want {
		t.Errorf("SortTensors = %s\nwant          %s", got, want)
	}
}

// dtypesAndNames lists tensors as "DTYPE:NAME", in their order.
func dtypesAndNames(ts []Tensor) string {
	var out []string
	for _, t := range ts {
		out = append(out, t.Dtype+":"+t.Name)
	}
	return strings.Join(out, " ")
}

// TestSortByElementSize checks a pack's order: element bits descending,
// then name byte-wise, so that F16, BF16 and I16 mix by name; unknown
// dtypes last. Packed in this order, every tensor of a whole-byte dtype
// starts on a whole element.
func TestSortByElementSize(t *testing.T) {
	ts := []Tensor{
		{Name: "b", Dtype: "F16", Shape: []int64{3}}, {Name: "a", Dtype: "I16", Shape: []int64{1}},
		{Name: "c", Dtype: "BF16", Shape: []int64{1}}, {Name: "y", Dtype: "U64", Shape: []int64{1}},
		{Name: "x", Dtype: "BOOL", Shape: []int64{3}}, {Name: "w", Dtype: "F32", Shape: []int64{}},
		{Name: "v", Dtype: "I32", Shape: []int64{0}}, {Name: "u", Dtype: "C64", Shape: []int64{1}},
		{Name: "q", Dtype: "NOPE"},
	}
	SortByElementSize(ts)
	want := "C64:u U64:y I32:v F32:w I16:a F16:b BF16:c BOOL:x NOPE:q"
	if got := dtypesAndNames(ts); got != want {
		t.Errorf("SortByElementSize = %s\nwant                %s", got, want)
	}
	h := &Header{Tensors: ts[:len(ts)-1]}
	if err := h.Pack(); err != nil {
		t.Fatal(err)
	}
	for _, tn := range h.Tensors {
		if bits, _ := Bits(tn.Dtype); tn.Begin%(bits/8) != 0 {
			t.Errorf("%s %s starts at byte %d, not on a whole element", tn.Dtype, tn.Name, tn.Begin)
		}
	}
	if b, ok := Bits("F4"); !ok || b != 4 {
		t.Errorf("Bits(F4) = %d, %v; want 4, true", b, ok)
	}
	if _, ok := Bits("NOPE"); ok {
		t.Error("Bits knows NOPE")
	}
}

// FuzzParseHeader: ParseHeader never panics, and what it accepts is valid,
// re-encodes to a header that parses to the same thing, and encodes the
// same way again. The seed corpus is in testdata/fuzz/FuzzParseHeader.
func FuzzParseHeader(f *testing.F) {
	f.Fuzz(func(t *testing.T, raw []byte, dataSize int64) {
		h, err := ParseHeader(raw, dataSize)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			return
		}
		if h.DataSize() != dataSize {
			t.Fatalf("accepted a header covering %d bytes of a %d-byte buffer", h.DataSize(), dataSize)
		}
		enc := h.Encode()
		back, err := ParseHeader(enc, dataSize)
		if err != nil {
			t.Fatalf("Encode of an accepted header does not parse: %v\n%q", err, enc)
		}
		if !reflect.DeepEqual(back, h) {
			t.Fatalf("round trip changed the header:\n%+v\n%+v", h, back)
		}
		if again := back.Encode(); !bytes.Equal(again, enc) {
			t.Fatalf("Encode is not stable:\n%q\n%q", enc, again)
		}
	})
}
