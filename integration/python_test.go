package integration

// The tensor-sharing story end to end with the real consumers: NumPy
// reads dtype and shape from xattrs and memmaps a segment; PyTorch maps a
// segment with torch.from_file(shared=True). All mappings are made by
// python children, never by the test process.

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// TestPythonNumpyMemmapFromXattrs: Go sets user.tensor.dtype and shape on
// a segment; a numpy child reads them with os.getxattr, opens the segment
// with np.memmap(mode="r+"), checks what Go wrote and writes new values,
// which Go reads back through the mount.
func TestPythonNumpyMemmapFromXattrs(t *testing.T) {
	t.Parallel()
	const rows, cols = 64, 32
	const script = `
import json, os, sys
import numpy as np
path = sys.argv[1]
dtype = os.getxattr(path, "user.tensor.dtype").decode()
shape = tuple(json.loads(os.getxattr(path, "user.tensor.shape").decode()))
print("meta", dtype, json.dumps(list(shape)))
a = np.memmap(path, dtype=np.dtype(dtype), shape=shape, mode="r+")
i, j = np.indices(shape)
want = (i * 100 + j).astype(a.dtype)
print("go-values", "ok" if np.array_equal(a, want) else "bad %r" % a[:2, :4].tolist())
a[:] = -(i * 1000 + j + 0.5)
a.flush()
del a
print("written")
`
	forEachMode(t, func(t *testing.T, m *mount) {
		p := m.path("weights.f32")
		// Go fills the segment with element (i, j) = i*100 + j, little endian.
		buf := make([]byte, rows*cols*4)
		for i := 0; i < rows; i++ {
			for j := 0; j < cols; j++ {
				binary.LittleEndian.PutUint32(buf[(i*cols+j)*4:], math.Float32bits(float32(i*100+j)))
			}
		}
		if err := os.WriteFile(p, buf, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := unix.Setxattr(p, "user.tensor.dtype", []byte("float32"), 0); err != nil {
			t.Fatalf("setxattr user.tensor.dtype=float32: %v", err)
		}
		if err := unix.Setxattr(p, "user.tensor.shape", []byte("[64, 32]"), 0); err != nil {
			t.Fatalf("setxattr user.tensor.shape=[64, 32]: %v", err)
		}
		if v, err := getxattr(p, "user.tensor.dtype"); err != nil || string(v) != "float32" {
			t.Errorf("user.tensor.dtype reads %q %v, want float32", v, err)
		}
		if v, err := getxattr(p, "user.tensor.shape"); err != nil || string(v) != "[64, 32]" {
			t.Errorf("user.tensor.shape reads %q %v, want [64, 32]", v, err)
		}

		out := python(t, script, p)
		lines := strings.Split(strings.TrimSpace(out), "\n")
		want := []string{"meta float32 [64, 32]", "go-values ok", "written"}
		if strings.Join(lines, "\n") != strings.Join(want, "\n") {
			t.Fatalf("numpy child said:\n%s\nwant:\n%s", out, strings.Join(want, "\n"))
		}

		got, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != rows*cols*4 {
			t.Fatalf("segment is %d bytes after the memmap, want %d", len(got), rows*cols*4)
		}
		bad := 0
		for i := 0; i < rows; i++ {
			for j := 0; j < cols; j++ {
				v := math.Float32frombits(binary.LittleEndian.Uint32(got[(i*cols+j)*4:]))
				if w := -(float32(i*1000+j) + 0.5); v != w {
					if bad < 5 {
						t.Errorf("element [%d, %d] = %v through the mount, want %v", i, j, v, w)
					}
					bad++
				}
			}
		}
		if bad > 0 {
			t.Errorf("%d of %d elements differ from what numpy wrote", bad, rows*cols)
		}
		// The metadata survived the data traffic.
		if v, err := getxattr(p, "user.tensor.shape"); err != nil || string(v) != "[64, 32]" {
			t.Errorf("after the memmap user.tensor.shape reads %q %v", v, err)
		}
	})
}

var (
	torchOnce sync.Once
	torchErr  error
)

// requireTorch skips (fails under CI) when /usr/bin/python3 has no torch.
func requireTorch(t *testing.T) {
	t.Helper()
	torchOnce.Do(func() {
		// Found, not imported: an import of torch costs a CPU-second, and
		// the tests' own children import it (and fail if it is broken).
		out, err := runTimeout(commandTimeout, systemPython, "-c",
			"import importlib.util as u, sys; sys.exit(0 if u.find_spec('torch') and u.find_spec('numpy') else 'no torch or numpy')")
		if err != nil {
			torchErr = fmt.Errorf("%s cannot import torch: %v %s", systemPython, err, out)
		}
	})
	if torchErr != nil {
		skipOrFail(t, "%v", torchErr)
	}
}

// TestTorchFromFileShared: one child writes float32s through the mount; a
// second maps them with torch.from_file(shared=True), sees them and stores
// into the tensor; a third child and the test see that store.
func TestTorchFromFileShared(t *testing.T) {
	t.Parallel()
	requireTorch(t)
	const n = 1 << 16
	const writer = `
import sys
import numpy as np
np.arange(int(sys.argv[2]), dtype=np.float32).tofile(sys.argv[1])
print("wrote")
`
	const mapper = `
import sys, torch
path, n = sys.argv[1], int(sys.argv[2])
t = torch.from_file(path, shared=True, size=n, dtype=torch.float32)
ok = torch.equal(t, torch.arange(n, dtype=torch.float32))
print("seen", "ok" if ok else "bad %r" % t[:8].tolist())
t[7] = 4242.5
t[n - 1] = -1.25
t[1000:2000] = torch.full((1000,), 3.0)
del t
print("stored")
`
	const reader = `
import sys
import numpy as np
a = np.fromfile(sys.argv[1], dtype=np.float32)
print("read", len(a), a[7], a[-1], a[1000], a[1999], a[2000])
`
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		p := m.path("tensor.f32")
		if out := strings.TrimSpace(python(t, writer, p, fmt.Sprint(n))); out != "wrote" {
			t.Fatalf("writer said %q", out)
		}
		out := strings.TrimSpace(python(t, mapper, p, fmt.Sprint(n)))
		if out != "seen ok\nstored" {
			t.Fatalf("torch.from_file child said:\n%s\nwant \"seen ok\" then \"stored\"", out)
		}
		want := fmt.Sprintf("read %d 4242.5 -1.25 3.0 3.0 2000.0", n)
		if got := strings.TrimSpace(python(t, reader, p)); got != want {
			t.Errorf("third child read %q, want %q", got, want)
		}

		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if len(data) != n*4 {
			t.Fatalf("segment is %d bytes, want %d", len(data), n*4)
		}
		at := func(i int) float32 { return math.Float32frombits(binary.LittleEndian.Uint32(data[i*4:])) }
		for i, w := range map[int]float32{0: 0, 6: 6, 7: 4242.5, 8: 8, 999: 999, 1000: 3, 1999: 3, 2000: 2000, n - 2: n - 2, n - 1: -1.25} {
			if g := at(i); g != w {
				t.Errorf("element %d read by Go through the mount = %v, want %v", i, g, w)
			}
		}
	})
}

// TestTorchFromFileConcurrent: two live torch processes map the same
// segment with torch.from_file(shared=True) and see each other's stores
// while both mappings exist.
func TestTorchFromFileConcurrent(t *testing.T) {
	t.Parallel()
	requireTorch(t)
	const n = 4096
	const proc = `
import sys, torch
path, n, role = sys.argv[1], int(sys.argv[2]), sys.argv[3]
t = torch.from_file(path, shared=True, size=n, dtype=torch.float32)
if role == "first":
    t[0] = 11.0
    print("stored")
    sys.stdin.readline()
    print("saw", t[1].item())
else:
    print("saw", t[0].item())
    t[1] = 22.0
    print("stored")
sys.stdin.readline()
`
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		p := m.path("concurrent.f32")
		if err := os.WriteFile(p, make([]byte, n*4), 0o644); err != nil {
			t.Fatal(err)
		}
		first := startPython(t, "torch first", proc, p, fmt.Sprint(n), "first")
		first.expect(t, "stored")
		second := startPython(t, "torch second", proc, p, fmt.Sprint(n), "second")
		if got := second.expect(t, "saw"); got != "11.0" {
			t.Errorf("second torch process saw %q at [0], want the first's 11.0", got)
		}
		second.expect(t, "stored")
		first.send(t, "go")
		if got := first.expect(t, "saw"); got != "22.0" {
			t.Errorf("first torch process saw %q at [1], want the second's 22.0", got)
		}
		second.wait(t)
		first.wait(t)
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if v := math.Float32frombits(binary.LittleEndian.Uint32(data[4:])); v != 22 {
			t.Errorf("element 1 through the mount = %v, want 22", v)
		}
		if v := math.Float32frombits(binary.LittleEndian.Uint32(data[0:])); v != 11 {
			t.Errorf("element 0 through the mount = %v, want 11", v)
		}
	})
}

// TestPythonDtypeSpellings: the Python client and the daemon accept the
// same dtype spellings and agree on their canonical names, both reading
// the one table (alloc/dtypes.json, shipped in the Python package).
func TestPythonDtypeSpellings(t *testing.T) {
	t.Parallel()
	var spellings []string
	for _, d := range alloc.Dtypes() {
		for _, a := range append([]string{d.Name}, d.TorchAliases...) {
			spellings = append(spellings, a, "torch."+a, strings.ToUpper(a), " "+a+"\t")
		}
		spellings = append(spellings, d.NumPyAliases...)
		if d.Safetensors != "" {
			spellings = append(spellings, d.Safetensors, strings.ToLower(d.Safetensors), " "+d.Safetensors)
		}
		for _, c := range d.NumPyCodes {
			for _, order := range []string{"", "<", "=", "|", ">", "!"} {
				spellings = append(spellings, order+c)
			}
		}
	}
	spellings = append(spellings, "", "torch.", "torch.f4", "<float32", "float128", "\u017fingle",
		"FLOAT\u0130", "np.float32", "b", "complex32", "float4_e2m1fn_x2")
	const script = `
import json, sys
sys.path.insert(0, sys.argv[1])
import tensorfs
out = []
for s in json.loads(sys.stdin.read()):
    try:
        out.append(tensorfs.canonical_dtype(s))
    except TypeError:
        out.append("")
print(json.dumps(out))
`
	pydir, err := filepath.Abs("../python")
	if err != nil {
		t.Fatal(err)
	}
	in, _ := json.Marshal(spellings)
	out := pythonStdin(t, script, string(in), pydir)
	var got []string
	if err := json.Unmarshal([]byte(out), &got); err != nil || len(got) != len(spellings) {
		t.Fatalf("python said %q: %v", out, err)
	}
	for i, s := range spellings {
		want := ""
		if d, err := alloc.ParseDtype(s); err == nil {
			want = d.Name
		}
		if got[i] != want {
			t.Errorf("dtype %q: python %q, go %q", s, got[i], want)
		}
	}
}

// pythonStdin runs /usr/bin/python3 -c script args with stdin and returns
// its stdout, failing with its stderr if it exits non-zero.
func pythonStdin(t *testing.T, script, stdin string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), commandTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, systemPython, append([]string{"-c", script}, args...)...)
	cmd.Stdin = strings.NewReader(stdin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, stderr.String())
	}
	return string(out)
}
