package alloc

import (
	"bytes"
	"errors"
	"math"
	"os"
	"slices"
	"strings"
	"testing"
)

func TestParseDtype(t *testing.T) {
	good := []struct {
		in, want string
		size     int64
	}{
		{"float32", "float32", 4},
		{"torch.float32", "float32", 4},
		{"float", "float32", 4},
		{"f4", "float32", 4},
		{"<f4", "float32", 4},
		{"=f4", "float32", 4},
		{"single", "float32", 4},
		{" Torch.Float32\n", "float32", 4},
		{"double", "float64", 8},
		{"f8", "float64", 8},
		{"<f8", "float64", 8},
		{"torch.double", "float64", 8},
		{"half", "float16", 2},
		{"<f2", "float16", 2},
		{"torch.half", "float16", 2},
		{"bfloat16", "bfloat16", 2},
		{"torch.bfloat16", "bfloat16", 2},
		{"long", "int64", 8},
		{"int", "int32", 4},
		{"short", "int16", 2},
		{"i8", "int64", 8},
		{"<i8", "int64", 8},
		{"i4", "int32", 4},
		{"i2", "int16", 2},
		{"i1", "int8", 1},
		{"|i1", "int8", 1},
		{"|u1", "uint8", 1},
		{"uint8", "uint8", 1},
		{"<u2", "uint16", 2},
		{"u4", "uint32", 4},
		{"torch.uint64", "uint64", 8},
		{"bool", "bool", 1},
		{"bool_", "bool", 1},
		{"|b1", "bool", 1},
		{"?", "bool", 1},
		{"cfloat", "complex64", 8},
		{"cdouble", "complex128", 16},
		{"c8", "complex64", 8},
		{"<c16", "complex128", 16},
		{"float8_e4m3fn", "float8_e4m3fn", 1},
		{"torch.float8_e5m2", "float8_e5m2", 1},
		// safetensors' spellings, as the format writes them; upper case
		// comes first where NumPy has the code lower-cased.
		{"F32", "float32", 4},
		{" BF16 ", "bfloat16", 2},
		{"I64", "int64", 8},
		{"I8", "int8", 1},
		{"U8", "uint8", 1},
		{"BOOL", "bool", 1},
		{"F8_E4M3", "float8_e4m3fn", 1},
		{"C64", "complex64", 8},
	}
	for _, tc := range good {
		got, err := ParseDtype(tc.in)
		if err != nil || got != (Dtype{tc.want, tc.size, 8 * tc.size}) {
			t.Errorf("ParseDtype(%q) = %v, %v; want %s/%d", tc.in, got, err, tc.want, tc.size)
		}
	}
	bad := []string{
		"", ">f4", "!f4", ">i2", "float128", "f16", "torch.", "torch.f4", "<float32",
		"np.float32", "b", "B", "f", "complex32", "int4", "float 32", "<<f4",
		"float32\x00", "torch.Size", "str", "ſingle", "FLOAT\u0130", "f32", "Bf16", "F128",
	}
	for _, in := range bad {
		if got, err := ParseDtype(in); !errors.Is(err, ErrInvalid) {
			t.Errorf("ParseDtype(%q) = %v, %v; want ErrInvalid", in, got, err)
		}
	}
	// Packed ones, and an error that quotes the spelling as given.
	if d, err := ParseDtype("F4"); err != nil || d.Name != "float4_e2m1fn" {
		t.Errorf("ParseDtype(F4) = %v, %v; want float4_e2m1fn (safetensors' F4, not NumPy's f4)", d, err)
	}
	if _, err := ParseDtype(" Float33 "); err == nil || !strings.Contains(err.Error(), `"Float33"`) {
		t.Errorf("ParseDtype(Float33): %v, want the spelling quoted as given", err)
	}
}

func TestParseShape(t *testing.T) {
	good := []struct {
		in   string
		want []int64
	}{
		{"[1024, 768]", []int64{1024, 768}},
		{"[1024,768]", []int64{1024, 768}},
		{"(1024, 768)", []int64{1024, 768}},
		{"1024,768", []int64{1024, 768}},
		{" [ 1024 ,\t768 ] \n", []int64{1024, 768}},
		{"(3,)", []int64{3}},
		{"[3,]", []int64{3}},
		{"3,", []int64{3}},
		{"7", []int64{7}},
		{"[0, 5]", []int64{0, 5}},
		{"[]", []int64{}},
		{"()", []int64{}},
		{"[ ]", []int64{}},
		{"[9223372036854775807]", []int64{math.MaxInt64}},
		{"[007]", []int64{7}},
		{"[" + strings.Repeat("1,", 64) + "]", slices.Repeat([]int64{1}, 64)},
	}
	for _, tc := range good {
		got, err := ParseShape(tc.in)
		if err != nil || got == nil || !slices.Equal(got, tc.want) {
			t.Errorf("ParseShape(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
	bad := []string{
		"", " \n", "[", "]", "(", "[1, 2)", "(1, 2]", "[1, 2", "1, 2]", "[[1]]", "[-1]", "[+1]",
		"[1,,2]", "[,]", "[,1]", "[1,,]", ",", "1024 768", "[1 2]", "[1.0]", "[0x10]", "[1e3]",
		"[9223372036854775808]", "[99999999999999999999999]", "[a]", "[1;2]", "[1]x",
		"[" + strings.Repeat("1,", 65) + "]",
		"[" + strings.Repeat(" ", 4096) + "]",
		"[\x001]",
	}
	for _, in := range bad {
		if got, err := ParseShape(in); !errors.Is(err, ErrInvalid) {
			t.Errorf("ParseShape(%q) = %v, %v; want ErrInvalid", in, got, err)
		}
	}
}

func TestFormatShape(t *testing.T) {
	for _, dims := range [][]int64{nil, {}, {0}, {1024, 768}, {math.MaxInt64, 1, 2, 3}} {
		s := FormatShape(dims)
		got, err := ParseShape(s)
		if err != nil || !slices.Equal(got, dims) {
			t.Errorf("ParseShape(FormatShape(%v) = %q) = %v, %v", dims, s, got, err)
		}
	}
	if got := FormatShape([]int64{1024, 768}); got != "[1024, 768]" {
		t.Errorf("FormatShape = %q, want %q", got, "[1024, 768]")
	}
	if got := FormatShape(nil); got != "[]" {
		t.Errorf("FormatShape(nil) = %q, want %q", got, "[]")
	}
}

func TestParseOffset(t *testing.T) {
	for in, want := range map[string]int64{"0": 0, "42\n": 42, " 9223372036854775807 ": math.MaxInt64} {
		if got, err := ParseOffset(in); err != nil || got != want {
			t.Errorf("ParseOffset(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "-1", "+1", "1.5", "0x10", "9223372036854775808", "1 2", "[1]"} {
		if got, err := ParseOffset(in); !errors.Is(err, ErrInvalid) {
			t.Errorf("ParseOffset(%q) = %d, %v; want ErrInvalid", in, got, err)
		}
	}
}

func TestExtent(t *testing.T) {
	f32 := Dtype{"float32", 4, 8 * 4}
	good := []struct {
		name   string
		d      Dtype
		shape  []int64
		stride []int64
		offset int64
		want   int64
	}{
		{"contiguous", f32, []int64{1024, 768}, nil, 0, 1024 * 768 * 4},
		{"explicit contiguous", f32, []int64{1024, 768}, []int64{768, 1}, 0, 1024 * 768 * 4},
		{"offset", f32, []int64{2, 3}, nil, 10, (10 + 6) * 4},
		{"transposed", f32, []int64{768, 1024}, []int64{1, 768}, 0, 1024 * 768 * 4},
		{"broadcast", f32, []int64{1000, 3}, []int64{0, 1}, 0, 3 * 4},
		{"padded rows", Dtype{"float64", 8, 8 * 8}, []int64{2, 3}, []int64{5, 1}, 0, (5 + 3) * 8},
		{"scalar", Dtype{"complex128", 16, 8 * 16}, []int64{}, nil, 7, 8 * 16},
		{"zero dim", f32, []int64{0, math.MaxInt64}, nil, math.MaxInt64 - 1, 0},
		{"zero dim explicit stride", f32, []int64{5, 0}, []int64{1, 1}, 0, 0},
		{"max", Dtype{"uint8", 1, 8 * 1}, []int64{math.MaxInt64}, nil, 0, math.MaxInt64},
		{"max offset", Dtype{"uint8", 1, 8 * 1}, []int64{1}, nil, math.MaxInt64 - 1, math.MaxInt64},
	}
	for _, tc := range good {
		got, err := Extent(tc.d, tc.shape, tc.stride, tc.offset)
		if err != nil || got != tc.want {
			t.Errorf("%s: Extent = %d, %v; want %d", tc.name, got, err, tc.want)
		}
	}
	bad := []struct {
		name   string
		d      Dtype
		shape  []int64
		stride []int64
		offset int64
	}{
		{"stride length", f32, []int64{2, 3}, []int64{1}, 0},
		{"empty stride for shape", f32, []int64{2}, []int64{}, 0},
		{"no dtype", Dtype{}, []int64{2}, nil, 0},
		{"negative shape", f32, []int64{-2}, nil, 0},
		{"negative stride", f32, []int64{2}, []int64{-1}, 0},
		{"negative offset", f32, []int64{2}, nil, -1},
		{"elements overflow", f32, []int64{1 << 62}, nil, 0},
		{"bytes overflow", Dtype{"uint8", 1, 8 * 1}, []int64{math.MaxInt64}, nil, 1},
		{"offset overflow", Dtype{"uint8", 1, 8 * 1}, []int64{1}, nil, math.MaxInt64},
		{"stride product overflow", Dtype{"uint8", 1, 8 * 1}, []int64{1, 1 << 32, 1 << 32}, nil, 0},
		{"reach overflow", f32, []int64{3}, []int64{math.MaxInt64 / 2}, 0},
		{"sum overflow", Dtype{"uint8", 1, 8 * 1}, []int64{2, 2}, []int64{math.MaxInt64 / 2, math.MaxInt64 / 2}, 1},
	}
	for _, tc := range bad {
		if got, err := Extent(tc.d, tc.shape, tc.stride, tc.offset); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: Extent = %d, %v; want ErrInvalid", tc.name, got, err)
		}
	}
}

func TestContiguousStride(t *testing.T) {
	for _, tc := range []struct{ shape, want []int64 }{
		{[]int64{}, []int64{}},
		{[]int64{5}, []int64{1}},
		{[]int64{2, 3, 4}, []int64{12, 4, 1}},
		{[]int64{2, 0, 4}, []int64{4, 4, 1}},
		{[]int64{2, 1 << 32, 1 << 32}, []int64{math.MaxInt64, 1 << 32, 1}},
	} {
		if got := ContiguousStride(tc.shape); !slices.Equal(got, tc.want) {
			t.Errorf("ContiguousStride(%v) = %v, want %v", tc.shape, got, tc.want)
		}
	}
}

func FuzzParseShape(f *testing.F) {
	f.Fuzz(func(t *testing.T, s string) {
		dims, err := ParseShape(s)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("ParseShape(%q) error %v does not wrap ErrInvalid", s, err)
			}
			return
		}
		if dims == nil || len(dims) > maxDims || slices.ContainsFunc(dims, func(n int64) bool { return n < 0 }) {
			t.Fatalf("ParseShape(%q) = %#v", s, dims)
		}
		canon := FormatShape(dims)
		if again, err := ParseShape(canon); err != nil || !slices.Equal(again, dims) {
			t.Fatalf("ParseShape(%q) = %v, %v; want %v", canon, again, err, dims)
		}
		if _, err := Extent(Dtype{"uint8", 1, 8 * 1}, dims, nil, 0); err != nil && !errors.Is(err, ErrInvalid) {
			t.Fatalf("Extent(%v) error %v does not wrap ErrInvalid", dims, err)
		}
	})
}

func FuzzParseDtype(f *testing.F) {
	f.Fuzz(func(t *testing.T, s string) {
		d, err := ParseDtype(s)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("ParseDtype(%q) error %v does not wrap ErrInvalid", s, err)
			}
			return
		}
		if d != dtypeNames[d.Name] || d.Size <= 0 {
			t.Fatalf("ParseDtype(%q) = %v, not a canonical dtype", s, d)
		}
		if again, err := ParseDtype(d.Name); err != nil || again != d {
			t.Fatalf("ParseDtype(%q) = %v, %v; want %v", d.Name, again, err, d)
		}
	})
}

// TestDtypeTableShared fails when the Python package's copy of the dtype table differs from
// the one Go embeds (run go generate ./alloc after editing alloc/dtypes.json).
func TestDtypeTableShared(t *testing.T) {
	py, err := os.ReadFile("../python/tensorfs/dtypes.json")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(py, DtypesJSON) {
		t.Fatal("python/tensorfs/dtypes.json differs from alloc/dtypes.json: run go generate ./alloc")
	}
	seen := map[string]bool{}
	for _, e := range Dtypes() {
		d, err := ParseDtype(e.Name)
		switch {
		case err != nil:
			t.Errorf("%s: %v", e.Name, err)
		case seen[e.Name]:
			t.Errorf("%s appears twice", e.Name)
		case e.Bits <= 0 || (e.Bits%8 != 0 && e.Bits > 8) || d.Bits != e.Bits || d.Size != (e.Bits+7)/8:
			t.Errorf("%s: %d bits gives %+v", e.Name, e.Bits, d)
		case e.TorchPack != 0 && e.TorchPack*e.Bits != 8:
			t.Errorf("%s: torch_pack %d of %d-bit elements is not one byte", e.Name, e.TorchPack, e.Bits)
		}
		seen[e.Name] = true
	}
}

func TestPackedExtent(t *testing.T) {
	f4, err := ParseDtype("float4_e2m1fn")
	if err != nil || !f4.Packed() || f4.Bits != 4 || f4.Size != 1 {
		t.Fatalf("float4_e2m1fn = %+v, %v", f4, err)
	}
	f6, _ := ParseDtype("FLOAT6_E3M2FN")
	for _, tc := range []struct {
		d      Dtype
		shape  []int64
		stride []int64
		offset int64
		want   int64 // -1: an error
	}{
		{f4, []int64{2, 3}, nil, 0, 3},
		{f4, []int64{2, 3}, []int64{3, 1}, 0, 3},
		{f4, []int64{0, 3}, nil, 0, 0},
		{f4, []int64{}, nil, 0, -1}, // 4 bits
		{f4, []int64{3}, nil, 0, -1},
		{f4, []int64{2, 2}, []int64{1, 2}, 0, -1},
		{f4, []int64{2}, nil, 2, -1},
		{f6, []int64{4}, nil, 0, 3},
		{f6, []int64{2}, nil, 0, -1},
		{f4, []int64{math.MaxInt64, 2}, nil, 0, -1},
	} {
		got, err := Extent(tc.d, tc.shape, tc.stride, tc.offset)
		if tc.want < 0 {
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("Extent(%s %v %v %d) = %d, %v; want ErrInvalid", tc.d.Name, tc.shape, tc.stride, tc.offset, got, err)
			}
		} else if err != nil || got != tc.want {
			t.Errorf("Extent(%s %v %v %d) = %d, %v; want %d", tc.d.Name, tc.shape, tc.stride, tc.offset, got, err, tc.want)
		}
	}
}
