package fs

import (
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// handleFS is a raw filesystem that opens every file as handle 5
// (passthrough, backing 9, when passthrough is set) and records the
// handles its reads, releases and getattrs get.
type handleFS struct {
	fuse.RawFileSystem
	passthrough bool
	got         []uint64
}

func (f *handleFS) Open(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	out.Fh = 5
	if f.passthrough {
		out.OpenFlags, out.BackingID = fuse.FOPEN_PASSTHROUGH, 9
	}
	return fuse.OK
}

func (f *handleFS) Read(cancel <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	f.got = append(f.got, in.Fh)
	return nil, fuse.OK
}

func (f *handleFS) Release(cancel <-chan struct{}, in *fuse.ReleaseIn) { f.got = append(f.got, in.Fh) }

func (f *handleFS) GetAttr(cancel <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	if in.Flags()&fuse.FUSE_GETATTR_FH != 0 {
		f.got = append(f.got, in.Fh())
	} else {
		f.got = append(f.got, 0)
	}
	return fuse.OK
}

// TestHandoverHandles: a daemon of generation 2 gives the kernel its
// handles with the generation in the high bits and the bridge its own;
// an earlier daemon's handle that was not opened again is EBADF to a
// read, its node to a getattr, nothing to a release; opens and releases
// are journaled; a passthrough open of a node whose inode uses an
// earlier daemon's backing file names that file.
func TestHandoverHandles(t *testing.T) {
	inner := &handleFS{RawFileSystem: fuse.NewDefaultRawFileSystem()}
	h := NewHandoverFS(inner, 2)
	var journal []Record
	h.journal = func(r Record) { journal = append(journal, r) }

	var out fuse.OpenOut
	in := fuse.OpenIn{InHeader: fuse.InHeader{NodeId: 7, Caller: fuse.Caller{Owner: fuse.Owner{Uid: 1000, Gid: 1000}}}, Flags: syscall.O_RDWR}
	if st := h.Open(nil, &in, &out); !st.Ok() || out.Fh != 2<<32|5 {
		t.Fatalf("open: %v, handle %#x, want %#x", st, out.Fh, uint64(2<<32|5))
	}
	if _, st := h.Read(nil, &fuse.ReadIn{Fh: out.Fh}, nil); !st.Ok() {
		t.Fatalf("read of this daemon's handle: %v", st)
	}
	earlier := uint64(1<<32 | 5)
	if _, st := h.Read(nil, &fuse.ReadIn{Fh: earlier}, nil); st != fuse.Status(syscall.EBADF) {
		t.Fatalf("read of an earlier daemon's handle: %v, want EBADF", st)
	}
	h.GetAttr(nil, &fuse.GetAttrIn{InHeader: fuse.InHeader{NodeId: 7}, Flags_: fuse.FUSE_GETATTR_FH, Fh_: earlier}, &fuse.AttrOut{})
	h.Release(nil, &fuse.ReleaseIn{Fh: earlier})
	h.Release(nil, &fuse.ReleaseIn{InHeader: fuse.InHeader{NodeId: 7}, Fh: out.Fh})
	if want := []uint64{5, 0, 5}; len(inner.got) != len(want) || inner.got[0] != want[0] || inner.got[1] != want[1] || inner.got[2] != want[2] {
		t.Errorf("the bridge got handles %v, want %v (read, getattr by node, release)", inner.got, want)
	}
	if len(journal) != 2 || journal[0].Open == nil || journal[0].Open.Fh != out.Fh || journal[0].Open.UID != 1000 || journal[1].Release != out.Fh {
		t.Errorf("journal %+v, want the open and the release", journal)
	}

	inner.passthrough = true
	h.Adopt(State{Backing: []Backing{{Node: 7, ID: 3}}})
	if st := h.Open(nil, &in, &out); !st.Ok() || out.BackingID != 3 {
		t.Errorf("a passthrough open of a node with an inherited backing file names %d, want 3", out.BackingID)
	}
	if st := h.Open(nil, &fuse.OpenIn{InHeader: fuse.InHeader{NodeId: 8}}, &out); !st.Ok() || out.BackingID != 9 {
		t.Errorf("a passthrough open of another node names %d, want the bridge's 9", out.BackingID)
	}
}
