package main

// tensorfs set DTYPE SHAPE PATH... and tensorfs show PATH|DIR...: a segment's
// tensor layout, its user.tensor.* attributes, with the daemon's rules
// checked here first so that a refusal says why; show also lists the
// tensors of a pack (transfer.PackName).

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/safetensors"
	"tensorfs/safetensors/transfer"
)

func runSet(args []string, stdout, stderr io.Writer) int {
	set := flag.NewFlagSet("tensorfs set", flag.ContinueOnError)
	const synopsis = "[--allow-outside] DTYPE SHAPE PATH...   (a contiguous layout: stride and storage offset are removed)"
	outside := allowOutside(set, "set the attributes of")
	if code, ok := parseFlags(set, args, synopsis, stdout, stderr); !ok {
		return code
	}
	if set.NArg() < 3 {
		fmt.Fprintf(stderr, "tensorfs set: want %s\n", synopsis)
		return 2
	}
	d, err := alloc.ParseDtype(set.Arg(0))
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs set: %s\n", alloc.EscapeText(err.Error()))
		return 2
	}
	shape, err := alloc.ParseShape(set.Arg(1))
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs set: %s (want a list such as \"[4096, 1024]\" or 4096,1024)\n", alloc.EscapeText(err.Error()))
		return 2
	}
	status := 0
	paths := checkPaths("tensorfs set", set.Args()[2:], *outside, stderr)
	if len(paths) < set.NArg()-2 {
		status = 1
	}
	for _, path := range paths {
		if err := setLayout(path, d, shape); err != nil {
			fmt.Fprintf(stderr, "tensorfs set: %s\n", alloc.EscapeText(err.Error()))
			status = 1
			continue
		}
		fmt.Fprintf(stdout, "%s: %s %s\n", alloc.Escape(path), d.Name, alloc.FormatShape(shape))
	}
	return status
}

// setLayout sets dtype and shape on path and removes its stride and
// storage offset, checking first that the tensor fits the segment. On a
// refusal the old attributes are put back.
func setLayout(path string, d alloc.Dtype, shape []int64) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is not a segment", path)
	}
	need, err := alloc.Extent(d, shape, nil, 0)
	if err != nil {
		return fmt.Errorf("%s: %v", path, err)
	}
	if need > fi.Size() && device(path) == "cpu" {
		return fmt.Errorf("%s: %s %s needs %d bytes, the segment has %d", path, d.Name, alloc.FormatShape(shape), need, fi.Size())
	}
	names := []string{alloc.AttrShape, alloc.AttrStride, alloc.AttrOffset, alloc.AttrDtype}
	old := map[string][]byte{}
	for _, name := range names {
		v, ok, err := alloc.GetXattr(path, name)
		if err != nil {
			return explainXattr(path, err)
		}
		if ok {
			old[name] = v
		}
	}
	// The layout goes first, so that no step checks the new dtype against
	// the old shape.
	for _, name := range names[:3] {
		if err := unix.Removexattr(path, name); err != nil && !errors.Is(err, unix.ENODATA) {
			return explainXattr(path, err)
		}
	}
	err = unix.Setxattr(path, alloc.AttrDtype, []byte(d.Name), 0)
	if err == nil {
		err = unix.Setxattr(path, alloc.AttrShape, []byte(alloc.FormatShape(shape)), 0)
	}
	if err != nil {
		for _, name := range []string{alloc.AttrDtype, alloc.AttrShape, alloc.AttrStride, alloc.AttrOffset} {
			unix.Removexattr(path, name)
			if v, ok := old[name]; ok {
				unix.Setxattr(path, name, v, 0)
			}
		}
		return explainXattr(path, err)
	}
	return nil
}

// device returns a segment's user.tensorfs.device, "cpu" when unset.
func device(path string) string {
	if v := attrOr(path, alloc.AttrDevice); v != "-" {
		return v
	}
	return "cpu"
}

// explainXattr turns an attribute error into one that names path and the
// usual cause.
func explainXattr(path string, err error) error {
	switch {
	case errors.Is(err, unix.ENOTSUP):
		return fmt.Errorf("%s is not on a tensorfs mount (no user attributes: %v)", path, err)
	case errors.Is(err, unix.ENOTCONN):
		return fmt.Errorf("%s: the tensorfs daemon is gone (%v): remount it with tensorfs mount", path, err)
	case errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES):
		return fmt.Errorf("%s: %v (the segment's owner, or root, sets its layout)", path, err)
	}
	return fmt.Errorf("%s: %v", path, err)
}

func runShow(args []string, stdout, stderr io.Writer) int {
	set := flag.NewFlagSet("tensorfs show", flag.ContinueOnError)
	outside := allowOutside(set, "show")
	if code, ok := parseFlags(set, args, "[--allow-outside] PATH...   (a directory: every segment under it)", stdout, stderr); !ok {
		return code
	}
	if set.NArg() == 0 {
		fmt.Fprintln(stderr, "tensorfs show: want PATH...")
		return 2
	}
	status := 0
	paths := checkPaths("tensorfs show", set.Args(), *outside, stderr)
	if len(paths) < set.NArg() {
		status = 1
	}
	for _, path := range paths {
		segs, err := segmentsUnder(path)
		if err != nil {
			fmt.Fprintf(stderr, "tensorfs show: %s\n", alloc.EscapeText(err.Error()))
			status = 1
		}
		for _, seg := range segs {
			lines, err := showLayout(seg, seg == path || filepath.Dir(seg) == filepath.Clean(path))
			if err != nil {
				fmt.Fprintf(stderr, "tensorfs show: %s\n", alloc.EscapeText(err.Error()))
				status = 1
				continue
			}
			for _, line := range lines {
				fmt.Fprintln(stdout, line)
			}
		}
	}
	return status
}

// segmentsUnder returns path itself, or, for a directory, the regular
// files under it in lexical order (symbolic links not followed). err
// says what could not be read; the files found are returned anyway.
func segmentsUnder(path string) ([]string, error) {
	fi, err := os.Stat(path)
	if err != nil || !fi.IsDir() {
		return []string{path}, nil // showLayout says what is wrong
	}
	var out []string
	err = filepath.WalkDir(path, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			out = append(out, p)
		}
		return nil
	})
	if err == nil && len(out) == 0 {
		err = fmt.Errorf("%s holds no segments", path)
	}
	return out, err
}

// showLayout describes a segment's tensor in one line:
// "PATH: float32 [4096, 1024] (16.0M; contiguous)", with a stride and
// storage offset when set, and what is wrong when the attributes do not
// describe a tensor that fits. When path is a pack and mayPack is set
// (path is the file given, or one directly in the directory given), it
// describes the pack as showPack does.
func showLayout(path string, mayPack bool) ([]string, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a segment", path)
	}
	get := func(name string) (string, bool, error) {
		v, ok, err := alloc.GetXattr(path, name)
		if err != nil {
			return "", false, explainXattr(path, err)
		}
		return strings.TrimSpace(string(v)), ok, nil
	}
	dt, hasDtype, err := get(alloc.AttrDtype)
	if err != nil {
		return nil, err
	}
	shape, hasShape, _ := get(alloc.AttrShape)
	stride, hasStride, _ := get(alloc.AttrStride)
	offset, hasOffset, _ := get(alloc.AttrOffset)
	var b strings.Builder
	fmt.Fprintf(&b, "%s: ", alloc.Escape(path))
	if !hasDtype && !hasShape {
		if mayPack && filepath.Base(path) == transfer.PackName {
			return showPack(path, fi.Size())
		}
		fmt.Fprintf(&b, "no dtype or shape (%s; tensorfs set DTYPE SHAPE %s gives it one)", byteCount(fi.Size()), alloc.Escape(path))
		return []string{b.String()}, nil
	}
	fmt.Fprintf(&b, "%s %s (%s", or(dt, hasDtype, "no dtype"), or(shape, hasShape, "no shape"), byteCount(fi.Size()))
	if hasStride {
		fmt.Fprintf(&b, "; stride %s", alloc.EscapeText(stride))
	}
	if hasOffset && offset != "0" {
		fmt.Fprintf(&b, "; storage offset %s", alloc.EscapeText(offset))
	}
	if !hasStride && (!hasOffset || offset == "0") {
		b.WriteString("; contiguous")
	}
	b.WriteString(")")
	return []string{b.String()}, nil
}

// showPack describes the pack at path, of size bytes: "PATH: a pack of N
// tensors (SIZE)", then a line per tensor it holds, in its order, as
// showLayout describes a segment's, with where it is: "DIR/NAME: float32
// [64, 64] (16.0K; contiguous; in packed.safetensors at byte 1234)".
func showPack(path string, size int64) ([]string, error) {
	h, dataAt, err := transfer.ReadPack(path)
	if err != nil {
		return nil, err
	}
	plural := "s"
	if len(h.Tensors) == 1 {
		plural = ""
	}
	lines := []string{fmt.Sprintf("%s: a pack of %d tensor%s (%s)", alloc.Escape(path), len(h.Tensors), plural, byteCount(size))}
	for _, t := range h.Tensors {
		dt, _ := safetensors.TensorfsDtype(t.Dtype)
		lines = append(lines, fmt.Sprintf("%s: %s %s (%s; contiguous; in %s at byte %d)", alloc.Escape(filepath.Dir(path)+"/"+t.Name),
			dt, alloc.FormatShape(t.Shape), byteCount(t.Size()), transfer.PackName, dataAt+t.Begin))
	}
	return lines, nil
}

// or returns the escaped value v, or missing when it is absent.
func or(v string, ok bool, missing string) string {
	if !ok {
		return missing
	}
	return alloc.EscapeText(v)
}
