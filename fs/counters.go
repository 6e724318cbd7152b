package fs

import (
	"sync/atomic"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// opcode is a FUSE request type that counters counts.
type opcode int

// The counted opcodes, named after the kernel's FUSE_ constants.
const (
	opLOOKUP opcode = iota
	opFORGET
	opGETATTR
	opSETATTR
	opMKNOD
	opMKDIR
	opUNLINK
	opRMDIR
	opRENAME
	opGETXATTR
	opSETXATTR
	opLISTXATTR
	opCREATE
	opOPEN
	opREAD
	opWRITE
	opRELEASE
	opFLUSH
	opFALLOCATE
	opOPENDIR
	opREADDIR
	opREADDIRPLUS
	opSTATFS
	opCOPYFILERANGE
	numOpcodes
)

var opcodeNames = [numOpcodes]string{"LOOKUP", "FORGET", "GETATTR", "SETATTR", "MKNOD", "MKDIR", "UNLINK", "RMDIR", "RENAME", "GETXATTR", "SETXATTR", "LISTXATTR", "CREATE", "OPEN", "READ", "WRITE", "RELEASE", "FLUSH", "FALLOCATE", "OPENDIR", "READDIR", "READDIRPLUS", "STATFS", "COPY_FILE_RANGE"}

// counters counts FUSE requests by opcode, so stats and benchmarks can
// show where daemon time goes (a passthrough mount serves no READ/WRITE).
// It takes no lock: every request of every thread passes through it.
type counters [numOpcodes]atomic.Int64

func (c *counters) add(op opcode) { c[op].Add(1) }

// snapshot returns the counts of the opcodes seen so far, by name.
func (c *counters) snapshot() map[string]int64 {
	out := make(map[string]int64, numOpcodes)
	for op := range c {
		if v := c[op].Load(); v > 0 {
			out[opcodeNames[op]] = v
		}
	}
	return out
}

// countingFS wraps the node bridge and counts each request it serves.
type countingFS struct {
	fuse.RawFileSystem
	c *counters
}

func (f *countingFS) Lookup(cancel <-chan struct{}, h *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	f.c.add(opLOOKUP)
	return f.RawFileSystem.Lookup(cancel, h, name, out)
}

func (f *countingFS) Forget(nodeid, nlookup uint64) {
	f.c.add(opFORGET)
	f.RawFileSystem.Forget(nodeid, nlookup)
}

func (f *countingFS) GetAttr(cancel <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	f.c.add(opGETATTR)
	return f.RawFileSystem.GetAttr(cancel, in, out)
}

func (f *countingFS) SetAttr(cancel <-chan struct{}, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	f.c.add(opSETATTR)
	return f.RawFileSystem.SetAttr(cancel, in, out)
}

func (f *countingFS) Mknod(cancel <-chan struct{}, in *fuse.MknodIn, name string, out *fuse.EntryOut) fuse.Status {
	f.c.add(opMKNOD)
	return f.RawFileSystem.Mknod(cancel, in, name, out)
}

func (f *countingFS) Mkdir(cancel <-chan struct{}, in *fuse.MkdirIn, name string, out *fuse.EntryOut) fuse.Status {
	f.c.add(opMKDIR)
	return f.RawFileSystem.Mkdir(cancel, in, name, out)
}

func (f *countingFS) Unlink(cancel <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	f.c.add(opUNLINK)
	return f.RawFileSystem.Unlink(cancel, h, name)
}

func (f *countingFS) Rmdir(cancel <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	f.c.add(opRMDIR)
	return f.RawFileSystem.Rmdir(cancel, h, name)
}

func (f *countingFS) Rename(cancel <-chan struct{}, in *fuse.RenameIn, oldName, newName string) fuse.Status {
	f.c.add(opRENAME)
	return f.RawFileSystem.Rename(cancel, in, oldName, newName)
}

func (f *countingFS) GetXAttr(cancel <-chan struct{}, h *fuse.InHeader, attr string, dest []byte) (uint32, fuse.Status) {
	f.c.add(opGETXATTR)
	return f.RawFileSystem.GetXAttr(cancel, h, attr, dest)
}

func (f *countingFS) SetXAttr(cancel <-chan struct{}, in *fuse.SetXAttrIn, attr string, data []byte) fuse.Status {
	f.c.add(opSETXATTR)
	return f.RawFileSystem.SetXAttr(cancel, in, attr, data)
}

func (f *countingFS) ListXAttr(cancel <-chan struct{}, h *fuse.InHeader, dest []byte) (uint32, fuse.Status) {
	f.c.add(opLISTXATTR)
	return f.RawFileSystem.ListXAttr(cancel, h, dest)
}

func (f *countingFS) Create(cancel <-chan struct{}, in *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	f.c.add(opCREATE)
	return f.RawFileSystem.Create(cancel, in, name, out)
}

func (f *countingFS) Open(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	f.c.add(opOPEN)
	return f.RawFileSystem.Open(cancel, in, out)
}

func (f *countingFS) Read(cancel <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	f.c.add(opREAD)
	return f.RawFileSystem.Read(cancel, in, buf)
}

func (f *countingFS) Write(cancel <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	f.c.add(opWRITE)
	return f.RawFileSystem.Write(cancel, in, data)
}

func (f *countingFS) Writev(cancel <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	f.c.add(opWRITE)
	return f.RawFileSystem.Writev(cancel, in, data)
}

// Release counts a RELEASE once it is served, not as it comes: the kernel
// awaits no answer to it, so a count that has gone up is how a client
// learns that the handle it closed is gone from the daemon (and from the
// ledger).
func (f *countingFS) Release(cancel <-chan struct{}, in *fuse.ReleaseIn) {
	f.RawFileSystem.Release(cancel, in)
	f.c.add(opRELEASE)
}

func (f *countingFS) Flush(cancel <-chan struct{}, in *fuse.FlushIn) fuse.Status {
	f.c.add(opFLUSH)
	return f.RawFileSystem.Flush(cancel, in)
}

func (f *countingFS) Fallocate(cancel <-chan struct{}, in *fuse.FallocateIn) fuse.Status {
	f.c.add(opFALLOCATE)
	return f.RawFileSystem.Fallocate(cancel, in)
}

func (f *countingFS) OpenDir(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	f.c.add(opOPENDIR)
	return f.RawFileSystem.OpenDir(cancel, in, out)
}

func (f *countingFS) ReadDir(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	f.c.add(opREADDIR)
	return f.RawFileSystem.ReadDir(cancel, in, out)
}

func (f *countingFS) ReadDirPlus(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	f.c.add(opREADDIRPLUS)
	return f.RawFileSystem.ReadDirPlus(cancel, in, out)
}

func (f *countingFS) StatFs(cancel <-chan struct{}, h *fuse.InHeader, out *fuse.StatfsOut) fuse.Status {
	f.c.add(opSTATFS)
	return f.RawFileSystem.StatFs(cancel, h, out)
}

func (f *countingFS) CopyFileRange(cancel <-chan struct{}, in *fuse.CopyFileRangeIn) (uint32, fuse.Status) {
	f.c.add(opCOPYFILERANGE)
	return f.RawFileSystem.CopyFileRange(cancel, in)
}
