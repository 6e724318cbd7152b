package alloc

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// newObject makes a segment of size bytes in a temporary directory.
func newObject(t *testing.T, size int64) Object {
	t.Helper()
	p := filepath.Join(t.TempDir(), "seg")
	if err := os.WriteFile(p, make([]byte, size), 0o644); err != nil {
		t.Fatal(err)
	}
	return Object{Path: p, Size: size}
}

func attr(t *testing.T, path, name string) string {
	t.Helper()
	v, err := readAttr(path, name)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func TestSetxattrCanonicalizes(t *testing.T) {
	obj := newObject(t, 64*32*4)
	for _, c := range []struct{ name, in, want string }{
		{AttrDtype, "<f4", "float32"},
		{AttrDtype, "torch.float32\n", "float32"},
		{AttrShape, "(64,32)", "[64, 32]"},
		{AttrStride, "[32, 1]", "[32, 1]"},
		{AttrOffset, "0", "0"},
		{"user.foo", "  kept verbatim ", "  kept verbatim "},
	} {
		if err := Setxattr(obj, c.name, []byte(c.in), 0); err != nil {
			t.Fatalf("%s=%q: %v", c.name, c.in, err)
		}
		if got := attr(t, obj.Path, c.name); got != c.want {
			t.Errorf("%s=%q stored %q, want %q", c.name, c.in, got, c.want)
		}
	}
}

func TestSetxattrRefusesAndKeepsOldValue(t *testing.T) {
	obj := newObject(t, 1024)
	if err := Setxattr(obj, AttrDtype, []byte("float32"), 0); err != nil {
		t.Fatal(err)
	}
	if err := Setxattr(obj, AttrShape, []byte("[16, 16]"), 0); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name, value string
		want        error
	}{
		{AttrDtype, "float128", ErrInvalid},
		{AttrDtype, "float64", ErrInvalid}, // 16*16*8 bytes > 1024
		{AttrShape, "[16, 17]", ErrInvalid},
		{AttrShape, "[-1]", ErrInvalid},
		{AttrStride, "[16]", ErrInvalid}, // wrong rank
		{AttrOffset, "1", ErrInvalid},    // pushes the extent past the end
		{AttrFlags, "BOGUS", ErrInvalid},
		{AttrFlags, "SHARED|SHAREDMEM", ErrInvalid},
		{AttrFlags, "UNLINK", ErrNotEmpty},
		{AttrFlags, "FROMFD", ErrReadOnly},
		{AttrFlags, "SHARED", ErrNoDisk},
		{AttrDevice, "cuda:0", ErrNoDevice},
		{AttrDevice, "tpu", ErrInvalid},
		{AttrRefcount, "3", ErrReadOnly},
		{AttrHandle, "/etc/passwd", ErrReadOnly},
		{"user.tensorfs.cuda.ipc_handle", "x", ErrReadOnly},
		{attrDisk, "x", ErrReadOnly},
	} {
		err := Setxattr(obj, c.name, []byte(c.value), 0)
		if !errors.Is(err, c.want) {
			t.Errorf("%s=%q: got %v, want %v", c.name, c.value, err, c.want)
		}
	}
	if got := attr(t, obj.Path, AttrDtype); got != "float32" {
		t.Errorf("dtype changed to %q by refused writes", got)
	}
	if got := attr(t, obj.Path, AttrShape); got != "[16, 16]" {
		t.Errorf("shape changed to %q by refused writes", got)
	}
	if got := attr(t, obj.Path, StoredName(AttrFlags)); got != "" {
		t.Errorf("flags changed to %q by refused writes", got)
	}
}

func TestFlagsOnEmptySegmentAndDirectory(t *testing.T) {
	obj := newObject(t, 0)
	if err := Setxattr(obj, AttrFlags, []byte("66"), 0); err != nil {
		t.Fatal(err)
	}
	if got := attr(t, obj.Path, StoredName(AttrFlags)); got != "SHAREDMEM|UNLINK" {
		t.Errorf("flags stored %q", got)
	}
	if err := Setxattr(obj, AttrFlags, []byte("EXCLUSIVE"), 0); !errors.Is(err, ErrInvalid) {
		t.Errorf("EXCLUSIVE on a segment: %v, want ErrInvalid", err)
	}
	dir := Object{Path: t.TempDir(), Dir: true}
	if err := Setxattr(dir, AttrFlags, []byte("EXCLUSIVE|NOCREATE|UNLINK"), 0); err != nil {
		t.Fatal(err)
	}
	f, err := ReadFlags(dir.Path)
	if err != nil || f != Exclusive|NoCreate|Unlink {
		t.Fatalf("dir flags %v, %v", f, err)
	}
	child := filepath.Join(dir.Path, "child")
	if err := os.WriteFile(child, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := InheritFlags(f, child, false); err != nil {
		t.Fatal(err)
	}
	if got := attr(t, child, StoredName(AttrFlags)); got != "UNLINK" {
		t.Errorf("a segment inherits %q, want only its storage modes (UNLINK)", got)
	}
	if err := Setxattr(dir, AttrShape, []byte("[1]"), 0); !errors.Is(err, ErrInvalid) {
		t.Errorf("shape on a directory: %v, want ErrInvalid", err)
	}
}

func TestListxattrHidesBookkeeping(t *testing.T) {
	obj := newObject(t, 0)
	if err := setAttrRaw(obj.Path, attrDisk, "abc"); err != nil {
		t.Fatal(err)
	}
	if err := Setxattr(obj, "user.visible", []byte("1"), 0); err != nil {
		t.Fatal(err)
	}
	names, err := Listxattr(obj.Path)
	if err != nil {
		t.Fatal(err)
	}
	if len(names) != 1 || names[0] != "user.visible" {
		t.Errorf("Listxattr = %q, want only user.visible", names)
	}
	if _, err := Getxattr(obj.Path, attrDisk, make([]byte, 16)); !errors.Is(err, ErrNoAttr) {
		t.Errorf("Getxattr of bookkeeping: %v, want ErrNoAttr", err)
	}
}
