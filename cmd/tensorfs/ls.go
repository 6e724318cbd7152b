package main

// tensorfs ls [-l] PATH...: a table of segments and what their extended
// attributes say about them.
//
// Files named on the command line come first, in one table. Each directory
// then gets a block: a summary line "DIR  <rbytes>  <rsegments> segments"
// for its whole subtree, and a table of its entries (subdirectories show
// as NAME/ with their subtree's bytes; -R lists each in a block too). Hidden names
// are listed too: a segment uses memory whatever its name. An attribute
// that is absent, or a file outside tensorfs, shows "-". A pack
// (transfer.PackName) named on the command line or directly in a
// directory named there is followed by a row for each tensor it holds,
// its name indented, with its size, dtype and shape.
//
// Names and values are anyone's bytes: each is escaped (alloc.Escape for
// names and holders, alloc.EscapeText for values) before it reaches the
// terminal.

import (
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"tensorfs/alloc"
	"tensorfs/safetensors"
	"tensorfs/safetensors/transfer"
)

func runLs(args []string, stdout, stderr io.Writer) int {
	set := flag.NewFlagSet("tensorfs ls", flag.ContinueOnError)
	long := set.Bool("l", false, "also list the processes holding each segment (HOLDERS: pid:command(handles))")
	recursive := set.Bool("R", false, "list each subdirectory too, in a block of its own, as ls -R does")
	outside := allowOutside(set, "list")
	if code, ok := parseFlags(set, args, "[-l] [-R] [--allow-outside] PATH...", stdout, stderr); !ok {
		return code
	}
	paths := set.Args()
	if len(paths) == 0 {
		paths = []string{"."}
	}
	status := 0
	checked := checkPaths("tensorfs ls", paths, *outside, stderr)
	if len(checked) < len(paths) {
		status = 1
	}
	var files, dirs []string
	for _, p := range checked {
		fi, err := os.Stat(p)
		switch {
		case err != nil:
			fmt.Fprintf(stderr, "tensorfs ls: %s\n", alloc.EscapeText(err.Error()))
			status = 1
		case fi.IsDir():
			dirs = append(dirs, p)
		default:
			files = append(files, p)
		}
	}
	l := lister{w: stdout, stderr: stderr, long: *long, recursive: *recursive}
	if len(files) > 0 {
		if !l.table(files, func(p string) string { return p }, true) {
			status = 1
		}
		l.blocks++
	}
	for _, dir := range dirs {
		if !l.dir(dir, true) {
			status = 1
		}
	}
	return status
}

// lister prints the blocks of tensorfs ls.
type lister struct {
	w, stderr       io.Writer
	long, recursive bool
	blocks          int // printed so far
}

// dir prints dir's block: a summary line "DIR  <rbytes>  <rsegments>
// segments" and a table of its entries, with the tensors of its pack when
// top is set (dir was named on the command line); with -R, then each
// subdirectory's block. It reports whether every directory and pack could
// be read.
func (l *lister) dir(dir string, top bool) bool {
	names, err := readDirNames(dir)
	if err != nil {
		fmt.Fprintf(l.stderr, "tensorfs ls: %s\n", alloc.EscapeText(err.Error()))
		return false
	}
	slices.Sort(names)
	if l.blocks > 0 {
		fmt.Fprintln(l.w)
	}
	l.blocks++
	segs := attrOr(dir, alloc.AttrRsegments)
	plural := "s"
	if segs == "1" {
		plural = ""
	}
	fmt.Fprintf(l.w, "%s  %s  %s segment%s\n", alloc.Escape(dir), humanAttr(dir, alloc.AttrRbytes), segs, plural)
	entries := make([]string, len(names))
	for i, name := range names {
		entries[i] = filepath.Join(dir, name)
	}
	ok := l.table(entries, filepath.Base, top)
	if l.recursive {
		for _, p := range entries {
			if fi, err := os.Lstat(p); err == nil && fi.IsDir() {
				ok = l.dir(p, false) && ok
			}
		}
	}
	return ok
}

// table prints one row per path that is a regular file or a directory,
// named by name(path); with packs, a pack among them is followed by the
// rows of its tensors (packRows). It reports whether every pack could be
// read.
func (l *lister) table(paths []string, name func(string) string, packs bool) bool {
	tw := tabwriter.NewWriter(l.w, 0, 0, 2, ' ', 0)
	header := "NAME\tSIZE\tDEVICE\tFLAGS\tREFS\tDTYPE\tSHAPE"
	if l.long {
		header += "\tHOLDERS"
	}
	fmt.Fprintln(tw, header)
	ok := true
	for _, p := range paths {
		fi, err := os.Lstat(p)
		if err != nil {
			continue // gone since it was listed
		}
		var row []string
		pack := false
		switch {
		case fi.Mode().IsRegular():
			dtype, shape := attrOr(p, alloc.AttrDtype), attrOr(p, alloc.AttrShape)
			row = []string{alloc.Escape(name(p)), humanSize(fi.Size()), attrOr(p, alloc.AttrDevice), attrOr(p, alloc.AttrFlags),
				attrOr(p, alloc.AttrRefcount), dtype, shape}
			if l.long {
				row = append(row, holders(p))
			}
			pack = packs && filepath.Base(p) == transfer.PackName && dtype == "-" && shape == "-"
		case fi.IsDir():
			row = []string{alloc.Escape(name(p)) + "/", humanAttr(p, alloc.AttrRbytes), attrOr(p, alloc.AttrDevice),
				attrOr(p, alloc.AttrFlags), "-", "-", "-"}
			if l.long {
				row = append(row, "-")
			}
		default:
			continue
		}
		fmt.Fprintln(tw, strings.Join(row, "\t"))
		if pack {
			ok = l.packRows(tw, p) && ok
		}
	}
	tw.Flush()
	return ok
}

// packRows prints a row for each tensor of the pack at path, in its
// order: its name indented, its size, dtype and shape. It reports whether
// the pack could be read.
func (l *lister) packRows(tw io.Writer, path string) bool {
	h, _, err := transfer.ReadPack(path)
	if err != nil {
		fmt.Fprintf(l.stderr, "tensorfs ls: %s\n", alloc.EscapeText(err.Error()))
		return false
	}
	for _, t := range h.Tensors {
		dt, _ := safetensors.TensorfsDtype(t.Dtype)
		row := []string{"  " + alloc.Escape(t.Name), humanSize(t.Size()), "-", "-", "-", dt, alloc.FormatShape(t.Shape)}
		if l.long {
			row = append(row, "-")
		}
		fmt.Fprintln(tw, strings.Join(row, "\t"))
	}
	return true
}

// attrOr returns the attribute as escaped text, or "-" when it cannot be
// read.
func attrOr(path, name string) string {
	v, ok, err := alloc.GetXattr(path, name)
	if err != nil || !ok || len(v) == 0 {
		return "-"
	}
	return alloc.EscapeText(strings.TrimSpace(string(v)))
}

// humanAttr returns a decimal byte count attribute as a human-readable size.
func humanAttr(path, name string) string {
	v := attrOr(path, name)
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return v
	}
	return humanSize(n)
}

// holders returns path's user.tensorfs.holders as formatHolders does,
// "-" for none.
func holders(path string) string {
	v, ok, err := alloc.GetXattr(path, alloc.AttrHolders)
	if err != nil || !ok {
		return "-"
	}
	return formatHolders(string(v))
}

// formatHolders turns holders lines ("PID COMM HANDLES", COMM escaped)
// into "PID:COMM(HANDLES),...", "-" for none. Lines that are not three
// such fields (not from tensorfs) are skipped; COMM is escaped again,
// commas included, so that it cannot pose as another holder.
func formatHolders(v string) string {
	var out []string
	for _, line := range strings.Split(v, "\n") {
		f := strings.Split(line, " ")
		if len(f) != 3 || !decimal(f[0]) || f[1] == "" || !decimal(f[2]) {
			continue
		}
		comm := strings.ReplaceAll(alloc.Escape(alloc.Unescape(f[1])), ",", `\x2c`)
		out = append(out, f[0]+":"+comm+"("+f[2]+")")
	}
	if len(out) == 0 {
		return "-"
	}
	return strings.Join(out, ",")
}

// decimal reports whether s is a non-empty string of ASCII digits.
func decimal(s string) bool {
	return s != "" && strings.Trim(s, "0123456789") == ""
}

// humanSize prints a byte count as ls -h does: 512, 1.0K, 3.5M, 1.0G...
func humanSize(n int64) string {
	if n < 1024 {
		return strconv.FormatInt(n, 10)
	}
	const units = "KMGTPE"
	f := float64(n) / 1024
	u := 0
	for f >= 1024 && u < len(units)-1 {
		f /= 1024
		u++
	}
	return strconv.FormatFloat(f, 'f', 1, 64) + string(units[u])
}

// readDirNames returns the names in dir, unsorted.
func readDirNames(dir string) ([]string, error) {
	d, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	return d.Readdirnames(0)
}
