package alloc

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// needRoot skips a test of the trusted namespace, which only root reaches
// (and fails it under CI, which runs as root).
func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("tests need root under CI")
		}
		t.Skip("needs root for trusted.* attributes")
	}
}

// TestStoredNames (A11): a root daemon stores the flags and the device
// in the trusted namespace, and reads nothing of a user.* copy that a
// peer holding a descriptor of the backing file could have set.
func TestStoredNames(t *testing.T) {
	needRoot(t)
	for name, want := range map[string]string{
		AttrFlags: "trusted.tensorfs.flags", AttrDevice: "trusted.tensorfs.device",
		AttrDtype: AttrDtype, "user.foo": "user.foo",
	} {
		if got := StoredName(name); got != want {
			t.Errorf("StoredName(%s) = %s, want %s", name, got, want)
		}
	}
	obj := newObject(t, 0)
	if err := Setxattr(obj, AttrFlags, []byte("KEEPFD"), 0); err != nil {
		t.Fatal(err)
	}
	if err := StoreDevice(obj.Path, "cuda:1"); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{AttrFlags, AttrDevice} {
		if _, ok, _ := GetXattr(obj.Path, name); ok {
			t.Errorf("%s stored under its user.* name", name)
		}
	}
	if v, _, _ := GetXattr(obj.Path, "trusted.tensorfs.flags"); string(v) != "KEEPFD" {
		t.Errorf("trusted.tensorfs.flags = %q, want KEEPFD", v)
	}
	// What a peer sets through its descriptor changes nothing the daemon reads.
	forged := newObject(t, 0)
	setAttrRaw(forged.Path, AttrFlags, "UNLINK")
	setAttrRaw(forged.Path, AttrDevice, "cuda:0")
	if f, err := ReadFlags(forged.Path); err != nil || f != 0 {
		t.Errorf("forged flags read as %v, %v; want none", f, err)
	}
	if d, err := ReadDevice(forged.Path); err != nil || d != "cpu" {
		t.Errorf("forged device read as %q, %v; want cpu", d, err)
	}
	var st unix.Stat_t
	unix.Stat(forged.Path, &st)
	if m, err := ReadMarker(forged.Path, &st); err != nil || m.Kind != Host {
		t.Errorf("forged device marker classified as %v, %v; want host", m.Kind, err)
	}
	if names, err := Listxattr(forged.Path); err != nil || len(names) != 0 {
		t.Errorf("Listxattr of the forged names: %q, %v; want none", names, err)
	}
	if _, err := Getxattr(forged.Path, AttrFlags, make([]byte, 64)); !errors.Is(err, ErrNoAttr) {
		t.Errorf("Getxattr of the forged flags: %v, want ErrNoAttr", err)
	}
	// Removing the flags removes the stored ones, not the copy.
	if err := Removexattr(obj.Path, AttrFlags); err != nil {
		t.Fatal(err)
	}
	if f, err := ReadFlags(obj.Path); err != nil || f != 0 {
		t.Errorf("flags after removal: %v, %v", f, err)
	}
}

// TestRecoverIgnoresForgedState (A11): recovery deletes or changes no
// segment for what a user can store on its backing file: user.* flags
// (UNLINK), device, and tensor attributes that fail validation.
func TestRecoverIgnoresForgedState(t *testing.T) {
	needRoot(t)
	backing := tmpfsBacking(t)
	s := openStore(t, backing)
	victim, empty, temp := filepath.Join(backing, "victim"), filepath.Join(backing, "empty"), filepath.Join(backing, "temp")
	os.WriteFile(victim, []byte("owner's bytes"), 0o666)
	os.WriteFile(empty, nil, 0o666)
	os.WriteFile(temp, []byte("gone"), 0o644)
	forged := map[string]string{AttrFlags: "UNLINK", AttrDevice: "cuda:0", AttrDtype: "bogus", AttrShape: "[[1", AttrStride: "[-1]", AttrOffset: "-5"}
	for _, p := range []string{victim, empty} {
		for name, v := range forged {
			if err := setAttrRaw(p, name, v); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := storeFlags(temp, Unlink, 0); err != nil { // the daemon's own UNLINK
		t.Fatal(err)
	}
	rec, err := s.Recover(nil, false)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Segments != 2 || len(rec.Devices) != 0 {
		t.Errorf("Recover kept %d segments, %d device ones; want 2, 0", rec.Segments, len(rec.Devices))
	}
	if b, err := os.ReadFile(victim); err != nil || string(b) != "owner's bytes" {
		t.Errorf("victim after recovery: %q, %v", b, err)
	}
	if _, err := os.Stat(empty); err != nil {
		t.Errorf("empty segment after recovery: %v", err)
	}
	for _, p := range []string{victim, empty} {
		for name, v := range forged {
			if got, _, _ := GetXattr(p, name); string(got) != v {
				t.Errorf("%s: recovery changed %s to %q", filepath.Base(p), name, got)
			}
		}
	}
	if _, err := os.Stat(temp); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the daemon's UNLINK segment survived recovery: %v", err)
	}
}

// TestReadLayoutValidates (A11): ReadLayout serves only values that the
// mount's setxattr would have stored, in canonical form, and says why it
// left the others out; a valid write replaces a bad stored value.
func TestReadLayoutValidates(t *testing.T) {
	for _, c := range []struct {
		name   string
		stored map[string]string
		want   Layout
		bad    string // "" when ReadLayout has nothing to say
	}{
		{"valid", map[string]string{AttrDtype: "float32", AttrShape: "[4]"}, Layout{Dtype: "float32", Shape: "[4]"}, ""},
		{"spelled otherwise", map[string]string{AttrDtype: "<f4", AttrShape: "(2,2)"}, Layout{Dtype: "float32", Shape: "[2, 2]"}, ""},
		{"bad dtype", map[string]string{AttrDtype: "bogus", AttrShape: "[4]"}, Layout{Shape: "[4]"}, AttrDtype},
		{"bad each", map[string]string{AttrDtype: "bogus", AttrShape: "[[4", AttrStride: "x", AttrOffset: "-5"}, Layout{}, AttrOffset},
		{"stride of another rank", map[string]string{AttrDtype: "int8", AttrShape: "[2, 2]", AttrStride: "[1]"}, Layout{}, "together"},
	} {
		obj := newObject(t, 16)
		for name, v := range c.stored {
			if err := setAttrRaw(obj.Path, name, v); err != nil {
				t.Fatal(err)
			}
		}
		l, err := ReadLayout(obj.Path)
		if l != c.want {
			t.Errorf("%s: ReadLayout = %+v, want %+v", c.name, l, c.want)
		}
		switch {
		case c.bad == "" && err != nil:
			t.Errorf("%s: ReadLayout: %v", c.name, err)
		case c.bad != "" && (!errors.Is(err, ErrBadStored) || !strings.Contains(err.Error(), c.bad)):
			t.Errorf("%s: ReadLayout: %v; want ErrBadStored naming %s", c.name, err, c.bad)
		}
	}
	obj := newObject(t, 16)
	setAttrRaw(obj.Path, AttrDtype, "bogus")
	if err := Setxattr(obj, AttrDtype, []byte("float32"), 0); err != nil {
		t.Fatalf("a valid dtype over a bad stored one: %v", err)
	}
	if l, err := ReadLayout(obj.Path); err != nil || l.Dtype != "float32" {
		t.Errorf("after the write: %+v, %v", l, err)
	}
}

// TestRecoverOldBacking: a backing of an older root daemon, which stored
// the flags and the device as user.* attributes, comes back without them:
// an UNLINK segment is kept, and a spilled device segment is a host one
// with its bytes, not restored to a device.
func TestRecoverOldBacking(t *testing.T) {
	needRoot(t)
	backing := tmpfsBacking(t)
	s := openStore(t, backing)
	temp, spill := filepath.Join(backing, "temp"), filepath.Join(backing, "spill")
	os.WriteFile(temp, []byte("kept"), 0o644)
	setAttrRaw(temp, AttrFlags, "UNLINK")
	os.WriteFile(spill, []byte("spilled!"), 0o644)
	setAttrRaw(spill, AttrDevice, "cuda:0")
	if err := WriteDeviceState(spill, DeviceState{Size: 8, Spilled: true}); err != nil {
		t.Fatal(err)
	}
	rec, err := s.Recover(nil, false)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Segments != 2 || len(rec.Devices) != 0 {
		t.Errorf("Recover kept %d segments, %d device ones; want 2, 0", rec.Segments, len(rec.Devices))
	}
	for p, want := range map[string]string{temp: "kept", spill: "spilled!"} {
		if b, err := os.ReadFile(p); err != nil || string(b) != want {
			t.Errorf("%s after recovery: %q, %v; want %q", filepath.Base(p), b, err, want)
		}
	}
	// The same spilled segment with its device stored is restored.
	if err := StoreDevice(spill, "cuda:0"); err != nil {
		t.Fatal(err)
	}
	if rec, err = s.Recover(nil, false); err != nil {
		t.Fatal(err)
	}
	if len(rec.Devices) != 1 {
		t.Fatalf("Recover of a spilled device segment: %d devices, want 1", len(rec.Devices))
	}
	rec.Devices[0].Close()
}
