package fs

import (
	"sync"
	"sync/atomic"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// counters counts FUSE requests by opcode, so stats and benchmarks can
// show where daemon time goes (a passthrough mount serves no READ/WRITE).
type counters struct {
	mu sync.Mutex
	m  map[string]*atomic.Int64
}

func (c *counters) add(op string) {
	c.mu.Lock()
	v := c.m[op]
	if v == nil {
		if c.m == nil {
			c.m = map[string]*atomic.Int64{}
		}
		v = new(atomic.Int64)
		c.m[op] = v
	}
	c.mu.Unlock()
	v.Add(1)
}

func (c *counters) snapshot() map[string]int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int64, len(c.m))
	for k, v := range c.m {
		out[k] = v.Load()
	}
	return out
}

// countingFS wraps the node bridge and counts each request it serves.
type countingFS struct {
	fuse.RawFileSystem
	c *counters
}

func (f *countingFS) Lookup(cancel <-chan struct{}, h *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	f.c.add("LOOKUP")
	return f.RawFileSystem.Lookup(cancel, h, name, out)
}

func (f *countingFS) Forget(nodeid, nlookup uint64) {
	f.c.add("FORGET")
	f.RawFileSystem.Forget(nodeid, nlookup)
}

func (f *countingFS) GetAttr(cancel <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	f.c.add("GETATTR")
	return f.RawFileSystem.GetAttr(cancel, in, out)
}

func (f *countingFS) SetAttr(cancel <-chan struct{}, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	f.c.add("SETATTR")
	return f.RawFileSystem.SetAttr(cancel, in, out)
}

func (f *countingFS) Mknod(cancel <-chan struct{}, in *fuse.MknodIn, name string, out *fuse.EntryOut) fuse.Status {
	f.c.add("MKNOD")
	return f.RawFileSystem.Mknod(cancel, in, name, out)
}

func (f *countingFS) Mkdir(cancel <-chan struct{}, in *fuse.MkdirIn, name string, out *fuse.EntryOut) fuse.Status {
	f.c.add("MKDIR")
	return f.RawFileSystem.Mkdir(cancel, in, name, out)
}

func (f *countingFS) Unlink(cancel <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	f.c.add("UNLINK")
	return f.RawFileSystem.Unlink(cancel, h, name)
}

func (f *countingFS) Rmdir(cancel <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	f.c.add("RMDIR")
	return f.RawFileSystem.Rmdir(cancel, h, name)
}

func (f *countingFS) Rename(cancel <-chan struct{}, in *fuse.RenameIn, oldName, newName string) fuse.Status {
	f.c.add("RENAME")
	return f.RawFileSystem.Rename(cancel, in, oldName, newName)
}

func (f *countingFS) GetXAttr(cancel <-chan struct{}, h *fuse.InHeader, attr string, dest []byte) (uint32, fuse.Status) {
	f.c.add("GETXATTR")
	return f.RawFileSystem.GetXAttr(cancel, h, attr, dest)
}

func (f *countingFS) SetXAttr(cancel <-chan struct{}, in *fuse.SetXAttrIn, attr string, data []byte) fuse.Status {
	f.c.add("SETXATTR")
	return f.RawFileSystem.SetXAttr(cancel, in, attr, data)
}

func (f *countingFS) ListXAttr(cancel <-chan struct{}, h *fuse.InHeader, dest []byte) (uint32, fuse.Status) {
	f.c.add("LISTXATTR")
	return f.RawFileSystem.ListXAttr(cancel, h, dest)
}

func (f *countingFS) Create(cancel <-chan struct{}, in *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	f.c.add("CREATE")
	return f.RawFileSystem.Create(cancel, in, name, out)
}

func (f *countingFS) Open(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	f.c.add("OPEN")
	return f.RawFileSystem.Open(cancel, in, out)
}

func (f *countingFS) Read(cancel <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	f.c.add("READ")
	return f.RawFileSystem.Read(cancel, in, buf)
}

func (f *countingFS) Write(cancel <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	f.c.add("WRITE")
	return f.RawFileSystem.Write(cancel, in, data)
}

func (f *countingFS) Writev(cancel <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	f.c.add("WRITE")
	return f.RawFileSystem.Writev(cancel, in, data)
}

func (f *countingFS) Release(cancel <-chan struct{}, in *fuse.ReleaseIn) {
	f.c.add("RELEASE")
	f.RawFileSystem.Release(cancel, in)
}

func (f *countingFS) Flush(cancel <-chan struct{}, in *fuse.FlushIn) fuse.Status {
	f.c.add("FLUSH")
	return f.RawFileSystem.Flush(cancel, in)
}

func (f *countingFS) Fallocate(cancel <-chan struct{}, in *fuse.FallocateIn) fuse.Status {
	f.c.add("FALLOCATE")
	return f.RawFileSystem.Fallocate(cancel, in)
}

func (f *countingFS) OpenDir(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	f.c.add("OPENDIR")
	return f.RawFileSystem.OpenDir(cancel, in, out)
}

func (f *countingFS) ReadDir(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	f.c.add("READDIR")
	return f.RawFileSystem.ReadDir(cancel, in, out)
}

func (f *countingFS) ReadDirPlus(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	f.c.add("READDIRPLUS")
	return f.RawFileSystem.ReadDirPlus(cancel, in, out)
}

func (f *countingFS) StatFs(cancel <-chan struct{}, h *fuse.InHeader, out *fuse.StatfsOut) fuse.Status {
	f.c.add("STATFS")
	return f.RawFileSystem.StatFs(cancel, h, out)
}
