package fs

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/gpu"
	"tensorfs/ledger"
)

// testDevices gives fsys a simulated device, as a mount with --gpu sim.
func testDevices(t *testing.T, fsys *filesystem) {
	t.Helper()
	d, err := newDevices(gpu.NewSim(0, 1<<30), fsys.store, fsys.ledger, fsys.handles, filepath.Join(t.TempDir(), "mnt"), nil, false, fsys.log)
	if err != nil {
		t.Fatal(err)
	}
	fsys.gpu = d // fsys.close spills it
}

// TestDeviceSegmentRemovedWhileOpen: a device segment unlinked while open
// keeps serving its handle from limbo; growing it then puts the new block
// in limbo beside the old, each once, and both go with the last close.
func TestDeviceSegmentRemovedWhileOpen(t *testing.T) {
	fsys := testFS(t)
	testDevices(t, fsys)
	dir := mkdir(t, &fsys.root.dirNode, "g")
	if errno := dir.Setxattr(callerCtx(0), alloc.AttrDevice, []byte("cuda:0"), 0); errno != 0 {
		t.Fatalf("set the directory's device: %v", errno)
	}
	var out fuse.EntryOut
	ch, fh, _, errno := dir.Create(callerCtx(0), "s", unix.O_RDWR, 0o644, &out)
	if errno != 0 {
		t.Fatalf("create: %v", errno)
	}
	dir.AddChild("s", ch, false)
	h, ok := fh.(*deviceHandle)
	if !ok {
		t.Fatal("a segment made in a cuda:0 directory is not on the device")
	}
	first := bytes.Repeat([]byte("a"), 1<<20)
	if _, errno := h.Write(callerCtx(0), first, 0); errno != 0 {
		t.Fatalf("write: %v", errno)
	}
	if errno := dir.Unlink(callerCtx(0), "s"); errno != 0 {
		t.Fatalf("unlink: %v", errno)
	}
	if blocks, _ := fsys.gpu.limbo.Stats(); blocks != 1 {
		t.Errorf("after unlink with a handle open, limbo holds %d blocks, want 1", blocks)
	}
	more := bytes.Repeat([]byte("b"), 4<<20) // past the capacity: a new block
	if _, errno := h.Write(callerCtx(0), more, int64(len(first))); errno != 0 {
		t.Fatalf("write past the capacity after unlink: %v", errno)
	}
	if blocks, _ := fsys.gpu.limbo.Stats(); blocks != 2 {
		t.Errorf("after the unlinked segment grew, limbo holds %d blocks, want 2 (old and new, once each)", blocks)
	}
	buf := make([]byte, 1)
	if r, errno := h.Read(callerCtx(0), buf, int64(len(first))); errno != 0 {
		t.Errorf("read of the unlinked segment: %v", errno)
	} else if b, _ := r.Bytes(buf); string(b) != "b" {
		t.Errorf("read of the unlinked segment gives %q, want b", b)
	}
	h.Release(callerCtx(0))
	if blocks, bytes := fsys.gpu.limbo.Stats(); blocks != 0 {
		t.Errorf("after the last close, limbo holds %d blocks (%d bytes), want none", blocks, bytes)
	}
}

// TestDeviceCounterRemovedHeld (ledger row "GPU consumer counters"): a
// removed segment's consumer counter that a consumer still holds open
// counts against its owner's bound until the consumer closes it: a user
// cannot pile up removed counter files, each an inode of the counters'
// tmpfs, beyond its bound. Another user's segments and root's get their
// counters meanwhile.
func TestDeviceCounterRemovedHeld(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: segments of another user")
	}
	fsys := testFS(t)
	testDevices(t, fsys)
	fsys.gpu.owners = newBudget("consumer counters", 1, math.MaxInt) // one counter for uid 1000
	dir := mkdir(t, &fsys.root.dirNode, "g")
	if errno := dir.Setxattr(callerCtx(0), alloc.AttrDevice, []byte("cuda:0"), 0); errno != 0 {
		t.Fatalf("set the directory's device: %v", errno)
	}
	create := func(name string, uid int) *deviceHandle {
		t.Helper()
		var out fuse.EntryOut
		ch, fh, _, errno := dir.Create(callerCtx(0), name, unix.O_RDWR, 0o644, &out)
		if errno != 0 {
			t.Fatalf("create %s: %v", name, errno)
		}
		dir.AddChild(name, ch, false)
		h := fh.(*deviceHandle)
		if err := unix.Fchown(int(h.seg.backing.Fd()), uid, uid); err != nil {
			t.Fatal(err)
		}
		return h
	}
	a := create("a", 1000)
	path, err := a.seg.refCounter()
	if err != nil {
		t.Fatal(err)
	}
	held, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	a.Release(callerCtx(0))
	if errno := dir.Unlink(callerCtx(0), "a"); errno != 0 {
		t.Fatalf("unlink: %v", errno)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("counter of the removed segment: %v", err)
	}
	b := create("b", 1000)
	defer b.Release(callerCtx(0))
	if _, err := b.seg.refCounter(); !errors.Is(err, syscall.EMFILE) {
		t.Errorf("uid 1000's second counter while its removed first is held: %v, want EMFILE", err)
	}
	for _, uid := range []int{1001, 0} {
		h := create(fmt.Sprintf("u%d", uid), uid)
		if _, err := h.seg.refCounter(); err != nil {
			t.Errorf("uid %d's counter while uid 1000 is at her bound: %v", uid, err)
		}
		h.Release(callerCtx(0))
	}
	held.Close()
	fsys.gpu.counters.Sweep()
	if _, err := b.seg.refCounter(); err != nil {
		t.Errorf("uid 1000's second counter once its removed first is let go: %v", err)
	}
}

// stallingDevice is a simulated device whose copies from files wait for
// a signal, as a slow or hung GPU would.
type stallingDevice struct {
	gpu.Device
	started chan struct{}
	release chan struct{}
}

func (d *stallingDevice) CopyFromFile(b gpu.Block, off int64, fd int, fileOff, n int64) error {
	d.started <- struct{}{}
	<-d.release
	return d.Device.CopyFromFile(b, off, fd, fileOff, n)
}

// TestDeviceCopyLeavesStatFree: while a copy into a device segment waits
// on the device, stat of the segment answers at once (its size is read
// without the copy's lock), and a copy larger than a chunk goes to the
// device a chunk at a time.
func TestDeviceCopyLeavesStatFree(t *testing.T) {
	fsys := testFS(t)
	dev := &stallingDevice{Device: gpu.NewSim(0, 1<<30), started: make(chan struct{}), release: make(chan struct{})}
	d, err := newDevices(dev, fsys.store, fsys.ledger, fsys.handles, filepath.Join(t.TempDir(), "mnt"), nil, false, fsys.log)
	if err != nil {
		t.Fatal(err)
	}
	fsys.gpu = d
	g := mkdir(t, &fsys.root.dirNode, "g")
	if errno := g.Setxattr(callerCtx(0), alloc.AttrDevice, []byte("cuda:0"), 0); errno != 0 {
		t.Fatal(errno)
	}
	seg := mkseg(t, g, "w")
	dseg := seg.storage().(device).seg
	src, err := os.CreateTemp(t.TempDir(), "src")
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	size := int64(2*copyChunk + 4096)
	if err := src.Truncate(size); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- dseg.fromFile(int(src.Fd()), 0, 0, size) }()
	for chunk := 0; chunk < 3; chunk++ {
		<-dev.started // the copy holds its chunk on the device
		statted := make(chan int64, 1)
		go func() {
			var a fuse.AttrOut
			seg.Getattr(callerCtx(0), nil, &a)
			statted <- int64(a.Size)
		}()
		select {
		case got := <-statted:
			if got != size {
				t.Errorf("stat during the copy: %d bytes, want %d", got, size)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("stat waited for a copy on the device")
		}
		dev.release <- struct{}{}
	}
	if err := <-done; err != nil {
		t.Fatalf("the copy: %v", err)
	}
}

// TestDeviceLimboCountsAllocation (ledger row "GPU device memory in
// limbo"): a block in limbo and a live block's backing reservation count
// what the device allocated for them (its granularity), not the bytes
// asked; and a user's blocks in limbo stop at her share of it: a truncate
// that would put one more there is ENOSPC and changes nothing, while
// another user's and root's go on.
func TestDeviceLimboCountsAllocation(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: a segment of another user")
	}
	fsys := testFS(t)
	testDevices(t, fsys)
	g := fsys.gpu.dev.Granularity()
	fsys.gpu.limboShare = ledger.New().Row(ledger.Spec{Name: "limbo", Unit: "byte", PerUID: 2 * g, Total: math.MaxInt64,
		Over: syscall.ENOSPC, Full: syscall.ENOSPC})
	dir := mkdir(t, &fsys.root.dirNode, "g")
	if errno := dir.Setxattr(callerCtx(0), alloc.AttrDevice, []byte("cuda:0"), 0); errno != 0 {
		t.Fatalf("set the directory's device: %v", errno)
	}
	// open makes a segment of uid's, held open: the open handle keeps
	// limbo's blocks.
	open := func(name string, uid int) *devSeg {
		t.Helper()
		var out fuse.EntryOut
		ch, fh, _, errno := dir.Create(callerCtx(0), name, unix.O_RDWR, 0o644, &out)
		if errno != 0 {
			t.Fatalf("create: %v", errno)
		}
		dir.AddChild(name, ch, false)
		h := fh.(*deviceHandle)
		t.Cleanup(func() { h.Release(callerCtx(0)) })
		if err := unix.Fchown(int(h.seg.backing.Fd()), uid, uid); err != nil {
			t.Fatal(err)
		}
		return h.seg
	}
	// round puts one block of seg's in limbo: a page, then nothing.
	round := func(seg *devSeg) error {
		if err := seg.resize(4096); err != nil {
			t.Fatalf("truncate to a page: %v", err)
		}
		if seg.reserved != gpu.DeviceBytes(fsys.gpu.dev, seg.block.Size) || seg.reserved < g {
			t.Errorf("a page's backing reservation is %d bytes, want its allocation's %d", seg.reserved, gpu.DeviceBytes(fsys.gpu.dev, seg.block.Size))
		}
		if _, err := seg.ipc(); err != nil {
			t.Fatal(err)
		}
		return seg.resize(0)
	}
	seg := open("s", 1000)
	for i := int64(1); i <= 2; i++ {
		if err := round(seg); err != nil {
			t.Fatalf("round %d: %v", i, err)
		}
		if n := fsys.gpu.limboBytes.Load(); n != i*g {
			t.Errorf("after %d rounds limbo counts %d bytes, want %d (%d allocations)", i, n, i*g, i)
		}
	}
	if err := round(seg); !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("a third page into uid 1000's full share of limbo: %v, want ENOSPC", err)
	}
	if n := fsys.gpu.limboBytes.Load(); n != 2*g || seg.Size() != 4096 {
		t.Errorf("after the refusal limbo counts %d bytes and the segment has %d, want %d and 4096", n, seg.Size(), 2*g)
	}
	for _, uid := range []int{1001, 0} {
		if err := round(open(fmt.Sprintf("u%d", uid), uid)); err != nil {
			t.Errorf("uid %d's block into limbo while uid 1000's share is full: %v", uid, err)
		}
	}
}

// countingDevice is a simulated device that counts its allocations.
type countingDevice struct {
	gpu.Device
	allocs atomic.Int64
}

func (d *countingDevice) Alloc(size int64) (gpu.Block, error) {
	d.allocs.Add(1)
	return d.Device.Alloc(size)
}

// TestDeviceWriteGrowthGeometric: a device segment written in cp's
// 128 KiB chunks to 32 MiB is moved to a larger block O(log n) times, not
// once per write (a copy quadratic in the size); its bytes are the
// writes'.
func TestDeviceWriteGrowthGeometric(t *testing.T) {
	fsys := testFS(t)
	dev := &countingDevice{Device: gpu.NewSim(0, 1<<30)}
	d, err := newDevices(dev, fsys.store, fsys.ledger, fsys.handles, filepath.Join(t.TempDir(), "mnt"), nil, false, fsys.log)
	if err != nil {
		t.Fatal(err)
	}
	fsys.gpu = d
	g := mkdir(t, &fsys.root.dirNode, "g")
	if errno := g.Setxattr(callerCtx(0), alloc.AttrDevice, []byte("cuda:0"), 0); errno != 0 {
		t.Fatal(errno)
	}
	seg := mkseg(t, g, "w").storage().(device).seg
	const chunk, size = 128 << 10, 32 << 20
	data := make([]byte, chunk)
	for off := 0; off < size; off += chunk {
		data[0] = byte(off / chunk)
		if err := seg.write(data, int64(off)); err != nil {
			t.Fatalf("write at %d: %v", off, err)
		}
	}
	if n := dev.allocs.Load(); n > 12 { // log2(32 MiB / 128 KiB) = 8, and room
		t.Errorf("%d writes of 128 KiB made %d allocations, want O(log n)", size/chunk, n)
	}
	if seg.Size() != size {
		t.Errorf("size %d, want %d", seg.Size(), size)
	}
	buf := make([]byte, 1)
	for _, i := range []int{0, 1, size/chunk - 1} {
		if _, err := seg.read(buf, int64(i*chunk)); err != nil || buf[0] != byte(i) {
			t.Errorf("chunk %d reads %d (%v), want %d", i, buf[0], err, byte(i))
		}
	}
}
