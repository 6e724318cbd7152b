package fs

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// gateFS passes every request on, and holds them all off once frozen: a
// daemon that hands its mount over freezes it, so that what it hands
// over is what the kernel was told, and the requests it holds off die
// with it, for the kernel to send its successor (NotifyResend).
type gateFS struct {
	fuse.RawFileSystem
	// mu is held for reading by every request in flight, and frozen
	// by a handover.
	mu gateLock
}

// freeze waits up to wait for the requests in flight to finish and holds
// off the rest; false if they did not finish (nothing is held off then).
func (f *gateFS) freeze(wait time.Duration) bool { return f.mu.freeze(wait) }

// thaw serves requests again after freeze.
func (f *gateFS) thaw() { f.mu.thaw() }

// parked runs wait, a wait of a request in flight (the caller's) that
// changes nothing (an open waiting for its segment's pull, a walk of a
// subtree waiting for the caller's others and walking, a scan of every
// process's mappings for refcount or holders), outside the
// gate where fsys has one: a handover goes on meanwhile rather than wait
// for it, and the request, once wait returns, waits for the thaw of a
// handover that failed; a handover that succeeds ends this daemon before
// it answers, and the kernel sends the request again to its successor
// (NotifyResend). A mount whose kernel does not resend has no gate, and
// the handover waits for the request (up to handoverWait).
func (f *filesystem) parked(wait func()) {
	g := f.gate.Load()
	if g == nil {
		wait()
		return
	}
	g.mu.RUnlock()
	defer g.mu.RLock()
	wait()
}

// gateBias is taken off gateLock.n while it is frozen.
const gateBias = 1 << 40

// gateLock is a reader lock that a freeze can give up: a sync.RWMutex
// whose Lock times out leaves that Lock waiting, and every request that
// comes after it held off until the requests in flight finish (one
// opening a segment still being pulled, for as long as the pull takes),
// for all the mount's users, after the handover has been refused.
type gateLock struct {
	// n is the requests in flight, less gateBias while frozen.
	n      atomic.Int64
	mu     sync.Mutex
	frozen bool
	// thawed is closed at the thaw of a freeze; changed, while a freeze
	// waits, once a request in flight leaves.
	thawed  chan struct{}
	changed chan struct{}
}

// RLock enters a request; it waits while frozen.
func (g *gateLock) RLock() {
	for {
		if g.n.Add(1) > 0 {
			return
		}
		g.RUnlock()
		g.mu.Lock()
		frozen, thawed := g.frozen, g.thawed
		g.mu.Unlock()
		if frozen {
			<-thawed
		}
	}
}

// RUnlock leaves a request; a freeze waiting for it is told.
func (g *gateLock) RUnlock() {
	if g.n.Add(-1) < 0 {
		g.mu.Lock()
		if g.changed != nil {
			close(g.changed)
			g.changed = nil
		}
		g.mu.Unlock()
	}
}

// freeze holds off new requests and waits up to wait for those in flight
// to leave; if they do not, it thaws and returns false.
func (g *gateLock) freeze(wait time.Duration) bool {
	timer := time.NewTimer(wait)
	defer timer.Stop()
	g.mu.Lock()
	if g.frozen {
		g.mu.Unlock()
		return false
	}
	g.frozen, g.thawed = true, make(chan struct{})
	g.n.Add(-gateBias)
	for g.n.Load() != -gateBias {
		changed := make(chan struct{})
		g.changed = changed
		g.mu.Unlock()
		select {
		case <-changed:
		case <-timer.C:
			g.mu.Lock()
			g.changed = nil
			g.mu.Unlock()
			g.thaw()
			return false
		}
		g.mu.Lock()
	}
	g.mu.Unlock()
	return true
}

// thaw ends a freeze: the requests held off go on.
func (g *gateLock) thaw() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.frozen {
		g.frozen = false
		g.n.Add(gateBias)
		close(g.thawed)
	}
}

func (f *gateFS) Lookup(cancel <-chan struct{}, header *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Lookup(cancel, header, name, out)
}

func (f *gateFS) Forget(nodeid, nlookup uint64) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	f.RawFileSystem.Forget(nodeid, nlookup)
}

func (f *gateFS) GetAttr(cancel <-chan struct{}, input *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.GetAttr(cancel, input, out)
}

func (f *gateFS) SetAttr(cancel <-chan struct{}, input *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.SetAttr(cancel, input, out)
}

func (f *gateFS) Mknod(cancel <-chan struct{}, input *fuse.MknodIn, name string, out *fuse.EntryOut) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Mknod(cancel, input, name, out)
}

func (f *gateFS) Mkdir(cancel <-chan struct{}, input *fuse.MkdirIn, name string, out *fuse.EntryOut) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Mkdir(cancel, input, name, out)
}

func (f *gateFS) Unlink(cancel <-chan struct{}, header *fuse.InHeader, name string) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Unlink(cancel, header, name)
}

func (f *gateFS) Rmdir(cancel <-chan struct{}, header *fuse.InHeader, name string) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Rmdir(cancel, header, name)
}

func (f *gateFS) Rename(cancel <-chan struct{}, input *fuse.RenameIn, oldName string, newName string) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Rename(cancel, input, oldName, newName)
}

func (f *gateFS) Link(cancel <-chan struct{}, input *fuse.LinkIn, filename string, out *fuse.EntryOut) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Link(cancel, input, filename, out)
}

func (f *gateFS) Symlink(cancel <-chan struct{}, header *fuse.InHeader, pointedTo string, linkName string, out *fuse.EntryOut) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Symlink(cancel, header, pointedTo, linkName, out)
}

func (f *gateFS) Readlink(cancel <-chan struct{}, header *fuse.InHeader) ([]byte, fuse.Status) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Readlink(cancel, header)
}

func (f *gateFS) Access(cancel <-chan struct{}, input *fuse.AccessIn) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Access(cancel, input)
}

func (f *gateFS) GetXAttr(cancel <-chan struct{}, header *fuse.InHeader, attr string, dest []byte) (uint32, fuse.Status) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.GetXAttr(cancel, header, attr, dest)
}

func (f *gateFS) ListXAttr(cancel <-chan struct{}, header *fuse.InHeader, dest []byte) (uint32, fuse.Status) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.ListXAttr(cancel, header, dest)
}

func (f *gateFS) SetXAttr(cancel <-chan struct{}, input *fuse.SetXAttrIn, attr string, data []byte) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.SetXAttr(cancel, input, attr, data)
}

func (f *gateFS) RemoveXAttr(cancel <-chan struct{}, header *fuse.InHeader, attr string) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.RemoveXAttr(cancel, header, attr)
}

func (f *gateFS) Create(cancel <-chan struct{}, input *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Create(cancel, input, name, out)
}

func (f *gateFS) Tmpfile(cancel <-chan struct{}, input *fuse.CreateIn, out *fuse.CreateOut) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Tmpfile(cancel, input, out)
}

func (f *gateFS) Open(cancel <-chan struct{}, input *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Open(cancel, input, out)
}

func (f *gateFS) Read(cancel <-chan struct{}, input *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Read(cancel, input, buf)
}

func (f *gateFS) Lseek(cancel <-chan struct{}, in *fuse.LseekIn, out *fuse.LseekOut) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Lseek(cancel, in, out)
}

func (f *gateFS) GetLk(cancel <-chan struct{}, input *fuse.LkIn, out *fuse.LkOut) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.GetLk(cancel, input, out)
}

func (f *gateFS) SetLk(cancel <-chan struct{}, input *fuse.LkIn) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.SetLk(cancel, input)
}

func (f *gateFS) SetLkw(cancel <-chan struct{}, input *fuse.LkIn) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.SetLkw(cancel, input)
}

func (f *gateFS) Release(cancel <-chan struct{}, input *fuse.ReleaseIn) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	f.RawFileSystem.Release(cancel, input)
}

func (f *gateFS) Write(cancel <-chan struct{}, input *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Write(cancel, input, data)
}

func (f *gateFS) Writev(cancel <-chan struct{}, input *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Writev(cancel, input, data)
}

func (f *gateFS) CopyFileRange(cancel <-chan struct{}, input *fuse.CopyFileRangeIn) (uint32, fuse.Status) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.CopyFileRange(cancel, input)
}

func (f *gateFS) Ioctl(cancel <-chan struct{}, input *fuse.IoctlIn, inbuf []byte, output *fuse.IoctlOut, outbuf []byte) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Ioctl(cancel, input, inbuf, output, outbuf)
}

func (f *gateFS) Flush(cancel <-chan struct{}, input *fuse.FlushIn) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Flush(cancel, input)
}

func (f *gateFS) Fsync(cancel <-chan struct{}, input *fuse.FsyncIn) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Fsync(cancel, input)
}

func (f *gateFS) Fallocate(cancel <-chan struct{}, input *fuse.FallocateIn) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Fallocate(cancel, input)
}

func (f *gateFS) OpenDir(cancel <-chan struct{}, input *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.OpenDir(cancel, input, out)
}

func (f *gateFS) ReadDir(cancel <-chan struct{}, input *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.ReadDir(cancel, input, out)
}

func (f *gateFS) ReadDirPlus(cancel <-chan struct{}, input *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.ReadDirPlus(cancel, input, out)
}

func (f *gateFS) ReleaseDir(input *fuse.ReleaseIn) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	f.RawFileSystem.ReleaseDir(input)
}

func (f *gateFS) FsyncDir(cancel <-chan struct{}, input *fuse.FsyncIn) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.FsyncDir(cancel, input)
}

func (f *gateFS) StatFs(cancel <-chan struct{}, input *fuse.InHeader, out *fuse.StatfsOut) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.StatFs(cancel, input, out)
}

func (f *gateFS) Statx(cancel <-chan struct{}, input *fuse.StatxIn, out *fuse.StatxOut) fuse.Status {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.RawFileSystem.Statx(cancel, input, out)
}
