package fs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ctl"
	"tensorfs/fdpass"
)

// TestControlLoadFromNodeCache: a load takes a segment's tensor
// attributes from the node the kernel knows for it, as getxattr serves
// them, without reading storage again (what makes a load cost no
// attribute read per segment); a segment replaced under that name behind
// the node's back, another inode, is read from storage, not given the old
// node's attributes.
func TestControlLoadFromNodeCache(t *testing.T) {
	x := newOpsFS(t)
	w := x.segment(x.mkdir(1, "model"), "w")
	x.setxattr(w, alloc.AttrDtype, "uint8")
	x.setxattr(w, alloc.AttrShape, "[8]")
	b := controlBackend{x.fsys}
	load := func(what string) ctl.Segment {
		t.Helper()
		segs, files, _, err := b.Load(rootPeer, "model", false, "", 10, new(any))
		fdpass.Close(files)
		if err != nil || len(segs) != 1 {
			t.Fatalf("load %s: %d segments, %v; want 1", what, len(segs), err)
		}
		return segs[0]
	}
	if s := load("after setxattr"); s.Dtype != "uint8" || s.Shape != "[8]" {
		t.Fatalf("load shows %s %s, want uint8 [8]", s.Dtype, s.Shape)
	}
	seg := filepath.Join(x.fsys.store.Dir, "model", "w")
	if err := unix.Setxattr(seg, alloc.StoredName(alloc.AttrShape), []byte("[2, 4]"), 0); err != nil {
		t.Fatal(err)
	}
	if s := load("with the node known"); s.Shape != "[8]" {
		t.Errorf("load shows shape %s, want the node's cached [8]: it read storage", s.Shape)
	}
	other := seg + ".new"
	if err := os.WriteFile(other, []byte("8 bytes!"), 0o644); err != nil {
		t.Fatal(err)
	}
	for attr, v := range map[string]string{alloc.AttrDtype: "uint8", alloc.AttrShape: "[4, 2]"} {
		if err := unix.Setxattr(other, alloc.StoredName(attr), []byte(v), 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Rename(other, seg); err != nil {
		t.Fatal(err)
	}
	if s := load("of a replaced segment"); s.Shape != "[4, 2]" {
		t.Errorf("load of a segment replaced behind the node shows shape %s, want storage's [4, 2]", s.Shape)
	}
}

// TestControlLoadNamesBounded: what a load holds of the names of the
// directories it walks is bounded (maxLoadNames), however many names a
// user gave them: past it the load fails, E2BIG, saying what to do, and
// gives back what it held; a smaller directory loads.
func TestControlLoadNamesBounded(t *testing.T) {
	defer func(was int) { maxLoadNames = was }(maxLoadNames)
	maxLoadNames = 64 << 10
	x := newOpsFS(t)
	small, big := x.mkdir(1, "small"), x.mkdir(1, "big")
	x.segment(small, "w")
	for i := range 1000 { // 1000 names of 100 bytes: past 64 KiB
		x.segment(big, fmt.Sprintf("%0100d", i))
	}
	b := controlBackend{x.fsys}
	_, files, _, err := b.Load(rootPeer, "big", false, "", 10, new(any))
	fdpass.Close(files)
	if !errors.Is(err, syscall.E2BIG) || !strings.Contains(err.Error(), "one at a time") {
		t.Errorf("a load of 1000 long names past a bound of 64 KiB: %v; want E2BIG saying what to do", err)
	}
	segs, files, _, err := b.Load(rootPeer, "small", false, "", 10, new(any))
	fdpass.Close(files)
	if err != nil || len(segs) != 1 {
		t.Errorf("a load of one segment after the refused one: %d segments, %v", len(segs), err)
	}
}

// TestControlLoadStoredAttrs: a load of a segment no node caches (the
// kernel never looked it up) keeps what it read of its attributes by
// inode, and the next load answers from that; a change of an attribute
// behind the daemon's back (as through a descriptor a load handed out)
// moves the inode's ctime, and the next load reads it, never the old one.
func TestControlLoadStoredAttrs(t *testing.T) {
	x := newOpsFS(t)
	x.mkdir(1, "model")
	seg := filepath.Join(x.fsys.store.Dir, "model", "w")
	if err := os.WriteFile(seg, []byte("8 bytes!"), 0o644); err != nil {
		t.Fatal(err)
	}
	for attr, v := range map[string]string{alloc.AttrDtype: "uint8", alloc.AttrShape: "[8]"} {
		if err := unix.Setxattr(seg, alloc.StoredName(attr), []byte(v), 0); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(settled) // what a newer ctime leaves uncached
	b := controlBackend{x.fsys}
	load := func(what, want string) {
		t.Helper()
		segs, files, _, err := b.Load(rootPeer, "model", false, "", 10, new(any))
		fdpass.Close(files)
		if err != nil || len(segs) != 1 || segs[0].Shape != want {
			t.Fatalf("load %s: %v, %v; want one segment of shape %s", what, segs, err, want)
		}
	}
	load("of a segment no node knows", "[8]")
	var st unix.Stat_t
	if err := unix.Stat(seg, &st); err != nil {
		t.Fatal(err)
	}
	if _, l, ok := x.fsys.stored.get(&st); !ok || l.Shape != "[8]" {
		t.Errorf("after a load, the daemon holds %v (%v) for the segment, want shape [8]", l, ok)
	}
	if err := unix.Setxattr(seg, alloc.StoredName(alloc.AttrShape), []byte("[2, 4]"), 0); err != nil {
		t.Fatal(err)
	}
	load("after the shape changed behind the daemon", "[2, 4]")
}

// TestStoredAttrsBounded: the daemon keeps at most maxStoredAttrs inodes'
// attributes, however many segments are loaded; the newest is kept.
func TestStoredAttrsBounded(t *testing.T) {
	defer func(was int) { maxStoredAttrs = was }(maxStoredAttrs)
	maxStoredAttrs = 4
	var c storedAttrs
	old := unix.NsecToTimespec(time.Now().Add(-time.Hour).UnixNano())
	for ino := range uint64(10) {
		c.put(&unix.Stat_t{Ino: ino, Ctim: old}, 0, alloc.Layout{Dtype: "uint8"})
	}
	if len(c.by) != maxStoredAttrs {
		t.Errorf("after 10 segments the daemon holds %d entries, want the bound, %d", len(c.by), maxStoredAttrs)
	}
	if _, _, ok := c.get(&unix.Stat_t{Ino: 9, Ctim: old}); !ok {
		t.Error("the last segment's attributes are not held")
	}
}
