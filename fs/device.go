package fs

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/gpu"
	"tensorfs/ledger"
)

// devices serves the mount's device segments, whose bytes live in GPU
// memory (package gpu, through its helper process). Their backing files
// stay empty while mounted; a clean unmount spills the bytes into them
// and the next mount restores them (DESIGN.md §6).
type devices struct {
	dev   gpu.Device
	limbo *gpu.Limbo
	// counters holds the segments' consumer reference counters, one file
	// each.
	counters *gpu.CounterDir
	log      *slog.Logger
	// stop ends the limbo collector (spill closes it); wg waits for it.
	stop chan struct{}
	wg   sync.WaitGroup
	// collectMu is held by the limbo collector while it collects; held
	// says a handover holds it off (holdCollects).
	collectMu sync.Mutex
	held      bool
	// taking is true in a successor until it serves the mount (settle):
	// the blocks, counters and backing files are its predecessor's too,
	// so a successor that fails spills nothing and removes no counter.
	taking bool

	// mu protects segs, every device segment by backing inode number.
	mu   sync.Mutex
	segs map[uint64]*devSeg

	// store is the backing, whose free space bounds the device bytes
	// (reserve); handles is the mount's descriptor budget, which each
	// segment's open backing file counts against (its owner's).
	store   *alloc.Store
	handles *ledger.Row
	// growMu serialises the reservations of growing segments with the
	// free space they check; limboBytes is the device memory waiting in
	// limbo, which that space must also hold. Both count what the device
	// allocated (gpu.DeviceBytes), not what the blocks asked for.
	growMu     sync.Mutex
	limboBytes atomic.Int64
	// limboShare bounds the device memory in limbo of each user (by the
	// segment's owner when its block went there), so that no user's
	// limbo takes the whole capacity.
	limboShare *ledger.Row

	// owners bounds the consumer counters the segments of each user hold
	// (by the segment's owner when its counter was made), removed ones a
	// consumer still holds open or mapped too (gpu.Counter.Remove).
	owners *ledger.Row

	// pending are the backing files of the device segments a successor
	// restores once it has taken the mount over (claimDevices).
	pending []*os.File
	// orphans are, in a successor until Adopt has run, the removed
	// segments that open handles hold, by backing inode (claims.orphan).
	orphans map[uint64]*devSeg
	// adopted are, in a successor that claimed the device until it
	// serves, the counter files it adopted, by name: settle removes the
	// predecessor's others then (keepCounters), so that a successor that
	// fails changes none.
	adopted map[string]adopted
}

// maxCountersPerUID bounds the consumer counters the segments of one user
// hold, a quarter of what the counters' tmpfs has room for, so that no
// user can take every counter (gpu.OpenCounterDir); all users together
// hold at most gpu.MaxCounters, root's reserve included.
const maxCountersPerUID = 4096

// devSeg is one device segment.
type devSeg struct {
	d *devices
	// ino is the backing file's inode number, its key in devices.segs.
	ino uint64
	// mu protects the fields below; it is held across device calls, so
	// copies into one segment are serialised.
	mu sync.Mutex
	// block holds the bytes; its Size is the capacity, at least size
	// (appending writes grow it geometrically). Size 0: no memory yet.
	block gpu.Block
	// size is the segment's size; written with mu held, read without it
	// (Size), so that stat never waits for a copy.
	size atomic.Int64
	// exportable is true when block came from AllocExportable (export).
	exportable bool
	// handedOut is true once block's IPC handle, or a descriptor of it,
	// left the daemon: only then may a consumer map it, and only then
	// does a replaced block wait in limbo (replace).
	handedOut bool
	// backing is the backing file, open for spilling; nil once removed.
	backing *os.File
	// reserved is how many bytes of the backing file's space are set
	// aside for the spill (reserve): the device memory block takes.
	reserved int64
	// uid owned the backing file when the segment was made; its open
	// backing file is one of that user's descriptors (handles).
	uid uint32
	// limboUID owns the blocks the segment puts in limbo: its owner when
	// it last grew or shrank to a new block, or was removed (limboShare).
	limboUID uint32
	// opens counts the open handles; atomic, so that the limbo can ask.
	opens atomic.Int64

	// cmu protects the fields below. The limbo's predicates take it, not
	// mu; where both are taken, mu comes first.
	cmu sync.Mutex
	// removed is true once the segment's last name is gone; it is set with
	// mu and cmu held, so either suffices to read it.
	removed bool
	// counter is the consumer reference counter, nil until a consumer
	// asks for it; it goes when the segment is removed and none of its
	// blocks waits in limbo (retired).
	counter *gpu.Counter
	retired int
	// counterUID owned the segment when its counter was made; the
	// counter counts against that user's bound.
	counterUID uint32
}

// newDevices serves dev for store, mounted at mountpoint: it prepares the
// directory of consumer reference counters among the mount's state files
// (in the state directory, which others may pass through but not list)
// and restores the segments an earlier mount left, whose backing files
// recovery found (it takes them over, and closes those it cannot
// restore). A successor (takeover) keeps the counters' tmpfs and restores
// the segments once it has the mount (claimDevices).
func newDevices(dev gpu.Device, store *alloc.Store, l *ledger.Ledger, handles *ledger.Row, mountpoint string, restore []*os.File, takeover bool, log *slog.Logger) (*devices, error) {
	if err := alloc.MakeStateDir(); err != nil {
		return nil, err
	}
	openCounters := gpu.OpenCounterDir
	if takeover {
		openCounters = gpu.KeepCounterDir
	}
	counters, err := openCounters(alloc.StatePath(mountpoint, ".refcounters"))
	if err != nil {
		return nil, err
	}
	counters.SetLog(log)
	var st unix.Statfs_t
	if err := store.Statfs(&st); err != nil {
		return nil, err
	}
	capacity := int64(st.Blocks) * st.Bsize
	d := &devices{dev: dev, limbo: gpu.NewLimbo(dev), counters: counters, log: log, segs: map[uint64]*devSeg{}, stop: make(chan struct{}), store: store, handles: handles,
		owners: l.Row(ledger.Spec{Name: "GPU consumer counters", Unit: "counter",
			PerUID: maxCountersPerUID, Total: gpu.MaxCounters, Over: syscall.EMFILE, Full: syscall.ENFILE}),
		limboShare: l.Row(ledger.Spec{Name: "GPU device memory in limbo", Unit: "byte",
			PerUID: capacity / 16, Total: capacity, Over: syscall.ENOSPC, Full: syscall.ENOSPC})}
	if takeover {
		d.pending, d.taking = restore, true
	} else {
		d.restoreAll(restore)
		d.startCollecting()
	}
	return d, nil
}

// startCollecting starts the limbo collector (collect). A successor
// starts it only once it has opened the handles it inherited, which hold
// blocks in limbo too (Mount).
func (d *devices) startCollecting() {
	d.wg.Add(1)
	go d.collect()
}

// restoreAll restores the segments whose backing files are files.
func (d *devices) restoreAll(files []*os.File) {
	for _, f := range files {
		if err := d.restore(f); err != nil {
			d.log.Warn("device segment not restored", "path", f.Name(), "err", err)
			f.Close()
		}
	}
}

// restore brings the device segment whose backing file is open at f back
// into device memory: its spilled bytes, or zeros after a crash lost them.
// On success the segment keeps f.
func (d *devices) restore(f *os.File) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return err
	}
	p := alloc.FdPath(int(f.Fd()))
	ds, err := alloc.ReadDeviceState(p)
	if err != nil {
		return err
	}
	// The segment takes f once the spilled bytes are on the device: the
	// spill's space becomes the reservation for the next one.
	seg := &devSeg{d: d, ino: st.Ino}
	if err := seg.resize(ds.Size); err != nil {
		return err
	}
	if ds.Spilled && ds.Size > 0 {
		if err := d.dev.CopyFromFile(seg.block, 0, int(f.Fd()), 0, ds.Size); err != nil {
			return err
		}
	} else if ds.Size > 0 {
		d.log.Warn("device segment lost its contents in a crash; it reads as zeros", "path", f.Name(), "bytes", ds.Size)
	}
	if err := f.Truncate(0); err != nil {
		return err
	}
	seg.backing, seg.uid = f, st.Uid
	if err := seg.reserve(gpu.DeviceBytes(d.dev, seg.block.Size)); err != nil {
		d.log.Warn("device segment restored without backing space for its next spill: a clean unmount may lose it", "path", f.Name(), "bytes", ds.Size, "err", err)
	}
	if err := alloc.WriteDeviceState(p, alloc.DeviceState{Size: ds.Size}); err != nil {
		return err
	}
	d.handles.Add(st.Uid, 1) // what an earlier mount held, whatever the bound now
	d.mu.Lock()
	d.segs[st.Ino] = seg
	d.mu.Unlock()
	return nil
}

// segment returns the device segment whose backing file is m, making it
// when it is new. The backing file is opened off devices.mu, which every
// device segment shares, and never waits for a lease (alloc.ErrLeased).
func (d *devices) segment(m *alloc.Ref) (*devSeg, error) {
	ino := m.Stat().Ino
	d.mu.Lock()
	seg := d.segs[ino]
	d.mu.Unlock()
	if seg != nil {
		return seg, nil
	}
	var st unix.Stat_t // the owner now: a create gives the file to its caller after m was opened
	if err := unix.Fstat(m.Fd(), &st); err != nil {
		return nil, err
	}
	uid := st.Uid
	if err := d.handles.Take(uid, 1); err != nil {
		return nil, err
	}
	fd, err := m.Open(unix.O_RDWR)
	if err != nil {
		d.handles.Give(uid, 1)
		return nil, err
	}
	d.mu.Lock()
	if seg = d.segs[ino]; seg == nil {
		seg = &devSeg{d: d, ino: ino, backing: os.NewFile(uintptr(fd), "device segment"), uid: uid}
		d.segs[ino] = seg
		fd = -1
	}
	d.mu.Unlock()
	if fd >= 0 {
		unix.Close(fd) // another request made the segment meanwhile
		d.handles.Give(uid, 1)
	}
	return seg, nil
}

// drop removes a segment whose last name went: its memory goes to limbo,
// where open handles keep reading and writing it until the last closes
// and no consumer counter refers to it. Its backing file stays open until
// then too: it records the block, for a successor that takes the handles
// over (claims.orphan).
func (d *devices) drop(seg *devSeg) {
	d.mu.Lock()
	if d.segs[seg.ino] != seg {
		d.mu.Unlock()
		return
	}
	delete(d.segs, seg.ino)
	d.mu.Unlock()
	seg.mu.Lock()
	defer seg.mu.Unlock()
	seg.cmu.Lock()
	seg.removed = true
	seg.cmu.Unlock()
	if uid, err := seg.owner(); err == nil {
		seg.limboUID = uid
	}
	// Open handles keep using the block; limbo frees it only once none
	// is open and no consumer counter refers to it. Limbo counts it before
	// its reservation is given back, so that no growth finds its room free.
	seg.retire(seg.block)
	if err := seg.reserve(0); err != nil {
		d.log.Warn("backing space set aside for a device segment not given back", "file", seg.backing.Name(), "err", err)
	}
	if seg.opens.Load() == 0 {
		seg.closeBacking()
	}
	seg.cmu.Lock()
	seg.removeCounterLocked()
	seg.cmu.Unlock()
}

// collect frees limbo blocks nobody refers to any more, and lets go of
// removed counter files nobody holds any more (gpu.CounterDir.Sweep),
// every second, until spill stops it.
func (d *devices) collect() {
	defer d.wg.Done()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
			d.collectMu.Lock()
			if !d.held {
				d.limbo.Collect()
				d.counters.Sweep()
			}
			d.collectMu.Unlock()
		case <-d.stop:
			return
		}
	}
}

// holdCollects holds the limbo collector off (hold) or lets it go on:
// while a successor claims the GPU helper, this daemon's frees are
// refused, and a block a refused free dropped from its limbo would stay
// allocated should the successor fail.
func (d *devices) holdCollects(hold bool) {
	d.collectMu.Lock()
	d.held = hold
	d.collectMu.Unlock()
}

// spill copies every device segment into its backing file, for the next
// mount to restore, stops the limbo collector and releases the device
// and the counters. A successor that failed before it served (taking)
// only ends its session of the GPU helper, which serves its predecessor
// again: the segments, their backing files and counters are the
// predecessor's.
func (d *devices) spill() {
	close(d.stop)
	d.wg.Wait()
	if d.taking {
		d.dev.Close()
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, seg := range d.segs {
		seg.mu.Lock()
		if err := seg.spillLocked(); err != nil {
			d.log.Error("device segment not spilled; its contents are lost", "file", seg.backing.Name(), "err", err)
		}
		seg.mu.Unlock()
	}
	d.dev.Close()
	if err := d.counters.RemoveAll(); err != nil {
		d.log.Warn("reference counters not removed", "err", err)
	}
}

func (seg *devSeg) spillLocked() error {
	fd := int(seg.backing.Fd())
	if err := unix.Ftruncate(fd, seg.size.Load()); err != nil {
		return err
	}
	if seg.size.Load() > 0 {
		if err := seg.d.dev.CopyToFile(seg.block, 0, fd, 0, seg.size.Load()); err != nil {
			return err
		}
	}
	return alloc.WriteDeviceState(alloc.FdPath(fd), alloc.DeviceState{Size: seg.size.Load(), Spilled: true})
}

// retire puts a block that left its segment in limbo: it is freed once
// the segment has no open handle and its consumer counter is zero. Limbo
// counts the device memory the block takes, not its size, against
// limboUID's share, whatever the bound (withReserve checks it first).
func (seg *devSeg) retire(b gpu.Block) {
	if b.Size == 0 {
		return
	}
	seg.cmu.Lock()
	seg.retired++
	counter := ""
	if seg.counter != nil {
		counter = seg.counter.Name()
	}
	seg.cmu.Unlock()
	n, uid := gpu.DeviceBytes(seg.d.dev, b.Size), seg.limboUID
	if counter != "" { // a successor charges the block to uid too
		if err := seg.tag(b, uid, counter); err != nil {
			seg.d.log.Debug("a block bound for limbo keeps its tag", "err", err)
		}
	}
	seg.d.limboBytes.Add(n)
	seg.d.limboShare.Add(uid, n)
	seg.d.limbo.Add(b, func() bool {
		seg.cmu.Lock()
		defer seg.cmu.Unlock()
		if seg.opens.Load() > 0 || seg.counter != nil && seg.counter.Value() > 0 {
			return true
		}
		seg.d.limboBytes.Add(-n)
		seg.d.limboShare.Give(uid, n)
		seg.retired--
		seg.removeCounterLocked()
		return false
	})
}

// replace makes nb the segment's block; the old one waits in limbo while
// consumers may hold it, and is freed at once if its IPC handle or a
// descriptor of it never left the daemon (handedOut): no consumer can
// map it. A removed segment's block is in limbo already (drop), so there
// nb joins it.
func (seg *devSeg) replace(nb gpu.Block) {
	switch {
	case seg.removed:
		seg.retire(nb)
	case seg.handedOut:
		seg.retire(seg.block)
	case seg.block.Size > 0:
		seg.d.dev.Free(seg.block)
	}
	seg.block, seg.handedOut = nb, false
}

// removeCounterLocked removes the counter file of a removed segment once
// none of its blocks waits in limbo: nothing is left for it to protect.
// It counts against its owner's bound until no consumer holds it.
func (seg *devSeg) removeCounterLocked() {
	if !seg.removed || seg.retired > 0 || seg.counter == nil {
		return
	}
	if err := seg.counter.Remove(seg.d.giveCounter(seg.counterUID)); err != nil {
		seg.d.log.Warn("reference counter not removed", "file", seg.counter.Path(), "err", err)
	}
	seg.counter = nil
}

// giveCounter returns what gives a counter of uid back to its bound, for
// gpu.Counter.Remove.
func (d *devices) giveCounter(uid uint32) func() {
	return func() { d.owners.Give(uid, 1) }
}

// Size returns the segment's size in bytes, without waiting for a copy.
func (seg *devSeg) Size() int64 { return seg.size.Load() }

// resize gives the segment size bytes (truncate), keeping its leading
// bytes. Growth within the block's capacity zeroes the new bytes; other
// changes move to a block of exactly size bytes, the old one waiting in
// limbo while consumers may hold it. It takes mu, as every change of the
// block and the size does (an export swaps the block under it).
func (seg *devSeg) resize(size int64) error {
	if size > alloc.MaxSegmentSize {
		return fmt.Errorf("%w: %d bytes", alloc.ErrTooBig, size)
	}
	seg.mu.Lock()
	defer seg.mu.Unlock()
	if size >= seg.size.Load() && size <= seg.block.Size && size > 0 {
		return seg.growInPlace(size)
	}
	return seg.withReserve(size, func() error { return seg.realloc(size, size) })
}

// extend grows the segment to end for a write past its end. Capacity at
// least doubles, so a segment written by appends is copied O(log n) times.
func (seg *devSeg) extend(end int64) error {
	if end > alloc.MaxSegmentSize {
		return fmt.Errorf("%w: %d bytes", alloc.ErrTooBig, end)
	}
	if end <= seg.block.Size {
		return seg.growInPlace(end)
	}
	capacity := min(max(end, 2*seg.block.Size), alloc.MaxSegmentSize)
	return seg.withReserve(capacity, func() error { return seg.realloc(capacity, end) })
}

// withReserve runs change, which moves the segment to a block of capacity
// bytes (0: none), with room set aside first for the device memory the
// new block takes: in the backing file (reserve), beside the old block's
// when that is to wait in limbo (handedOut), since limbo takes its room
// over; in limbo itself when the segment is removed. A block bound for
// limbo is first charged to its owner's share of it (chargeLimbo), which
// retire then charges again for as long as the block stays. After, the
// reservation is what the segment's block takes; a failed change gives
// back what it set aside.
func (seg *devSeg) withReserve(capacity int64, change func() error) error {
	d := seg.d
	need := gpu.DeviceBytes(d.dev, capacity)
	if seg.removed {
		if need == 0 {
			return change()
		}
		uncharge, err := d.chargeLimbo(seg.limboUID, need, true)
		if err != nil {
			return err
		}
		defer uncharge()
		return change()
	}
	old := seg.reserved
	if seg.handedOut && seg.block.Size > 0 {
		uid, err := seg.owner()
		if err != nil {
			return err
		}
		held := gpu.DeviceBytes(d.dev, seg.block.Size)
		uncharge, err := d.chargeLimbo(uid, held, false)
		if err != nil {
			return err
		}
		defer uncharge()
		seg.limboUID = uid
		need += held
	}
	if err := seg.reserve(max(need, old)); err != nil {
		return err
	}
	if err := change(); err != nil {
		seg.reserve(old)
		return err
	}
	return seg.reserve(gpu.DeviceBytes(d.dev, seg.block.Size))
}

// reserve sets aside size bytes of the backing file's space for the
// segment's spill at a clean unmount (DESIGN.md §6): allocated beyond the
// file's end, which stays 0 while mounted, so the device bytes count
// against the backing's capacity like host bytes, a full backing answers
// ENOSPC to the growth, and no user can fill the backing to empty the
// segment at unmount. Device memory waiting in limbo counts too: a growth
// must leave the backing room for it, so that what the device holds, in
// segments and in limbo, never passes the capacity (limbo blocks hold
// only until their handles close or their counters drop, and then give
// their room back). A smaller size gives the rest back.
func (seg *devSeg) reserve(size int64) error {
	if seg.backing == nil || size == seg.reserved {
		return nil
	}
	fd := int(seg.backing.Fd())
	if size > seg.reserved {
		d := seg.d
		d.growMu.Lock()
		defer d.growMu.Unlock()
		// With nothing in limbo, fallocate alone says whether it fits.
		if d.limboBytes.Load() > 0 {
			if err := d.fitsLocked(size - seg.reserved); err != nil {
				return err
			}
		}
		if err := unix.Fallocate(fd, unix.FALLOC_FL_KEEP_SIZE, seg.reserved, size-seg.reserved); err != nil {
			if errors.Is(err, unix.ENOSPC) {
				return fmt.Errorf("%w: no backing space to set aside for the segment's spill: %v", alloc.ErrNoSpace, err)
			}
			return err
		}
	} else {
		// A hole frees whole blocks only: it runs to the reservation's
		// end rounded up past any block or huge page.
		const align = 2 << 20
		end := (seg.reserved + align - 1) &^ (align - 1)
		if err := unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, size, end-size); err != nil {
			return err
		}
	}
	seg.reserved = size
	return nil
}

// fitsLocked checks that n more bytes of device memory fit in the
// backing's free space beside what limbo holds; growMu is held.
func (d *devices) fitsLocked(n int64) error {
	var st unix.Statfs_t
	if err := d.store.Statfs(&st); err != nil {
		return err
	}
	limbo := d.limboBytes.Load()
	if free := int64(st.Bavail) * st.Bsize; n > free-limbo {
		return fmt.Errorf("%w: %d bytes more do not fit: the backing has %d free, of which device memory waiting in limbo takes %d", alloc.ErrNoSpace, n, free, limbo)
	}
	return nil
}

// chargeLimbo charges n bytes of device memory bound for limbo to uid's
// share of it and, when fit, counts them in limbo if they fit in the
// backing beside it (a removed segment's new block, which has no backing
// file to reserve in). The returned func takes the charge back.
func (d *devices) chargeLimbo(uid uint32, n int64, fit bool) (uncharge func(), err error) {
	d.growMu.Lock()
	defer d.growMu.Unlock()
	if fit {
		if err := d.fitsLocked(n); err != nil {
			return nil, err
		}
	}
	if err := d.limboShare.Take(uid, n); err != nil {
		return nil, fmt.Errorf("%d bytes of device memory bound for limbo: %w", n, err)
	}
	if fit {
		d.limboBytes.Add(n)
	}
	return func() {
		if fit {
			d.limboBytes.Add(-n)
		}
		d.limboShare.Give(uid, n)
	}, nil
}

// owner returns the uid that owns the segment's backing file now.
func (seg *devSeg) owner() (uint32, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(seg.backing.Fd()), &st); err != nil {
		return 0, err
	}
	return st.Uid, nil
}

// growInPlace grows the segment to size within its block, zeroing the
// bytes between the old and the new end.
func (seg *devSeg) growInPlace(size int64) error {
	if err := seg.zero(seg.block, seg.size.Load(), size); err != nil {
		return err
	}
	seg.size.Store(size)
	return seg.recordSize()
}

// realloc moves the segment's first size bytes to a zeroed block of
// capacity bytes; the old block waits in limbo while consumers may hold it.
func (seg *devSeg) realloc(capacity, size int64) error {
	var nb gpu.Block
	if capacity > 0 {
		var err error
		if nb, err = seg.alloc(capacity); err != nil {
			return err
		}
		if err := seg.copyPrefix(nb, min(seg.size.Load(), size)); err != nil {
			seg.d.dev.Free(nb)
			return err
		}
	}
	seg.replace(nb)
	seg.size.Store(size)
	seg.exportable = false
	return seg.recordSize()
}

// recordSize notes the segment's size on its backing file, so that a
// crash loses the bytes but not the size.
func (seg *devSeg) recordSize() error {
	if seg.backing == nil {
		return nil
	}
	return alloc.WriteDeviceState(alloc.FdPath(int(seg.backing.Fd())), alloc.DeviceState{Size: seg.size.Load(), Block: seg.block.ID})
}

// alloc allocates a block (zeroed by the device), collecting the limbo
// once if the device is full.
func (seg *devSeg) alloc(size int64) (gpu.Block, error) {
	b, err := seg.d.dev.Alloc(size)
	if errors.Is(err, gpu.ErrOutOfMemory) && seg.d.limbo.Collect() > 0 {
		b, err = seg.d.dev.Alloc(size)
	}
	if errors.Is(err, gpu.ErrOutOfMemory) {
		return b, fmt.Errorf("%w: device memory: %v", alloc.ErrNoSpace, err)
	}
	if err != nil {
		return b, err
	}
	return b, seg.tagNew(b)
}

// tagNew tags a block just allocated for the segment (tag), freeing it if
// that fails.
func (seg *devSeg) tagNew(b gpu.Block) error {
	seg.cmu.Lock()
	uid, counter := seg.uid, ""
	if seg.counter != nil {
		uid, counter = seg.counterUID, seg.counter.Name()
	}
	seg.cmu.Unlock()
	if err := seg.tag(b, uid, counter); err != nil {
		seg.d.dev.Free(b)
		return err
	}
	return nil
}

// blockTag is what a block's tag in the GPU helper says
// (gpu.Survivor.Tag), for a successor that claims it (claimDevices): the
// segment it is of, by backing inode, the uid its device memory counts
// against in limbo and its counter against, and the segment's consumer
// counter file, if any.
type blockTag struct {
	Ino     uint64 `json:"ino"`
	UID     uint32 `json:"uid"`
	Counter string `json:"counter,omitempty"`
}

// tag gives b the segment's tag, with uid and counter, when the device's
// blocks outlive the daemon.
func (seg *devSeg) tag(b gpu.Block, uid uint32, counter string) error {
	s, ok := seg.d.dev.(gpu.Survivor)
	if !ok || b.Size == 0 {
		return nil
	}
	t, _ := json.Marshal(blockTag{Ino: seg.ino, UID: uid, Counter: counter})
	return s.Tag(b, t)
}

// zero clears bytes [from, to) of block b.
func (seg *devSeg) zero(b gpu.Block, from, to int64) error {
	zero := make([]byte, min(max(to-from, 0), 1<<20))
	for off := from; off < to; off += int64(len(zero)) {
		if err := seg.d.dev.CopyIn(b, off, zero[:min(int64(len(zero)), to-off)]); err != nil {
			return err
		}
	}
	return nil
}

// copyPrefix copies the first n bytes of the segment into nb.
func (seg *devSeg) copyPrefix(nb gpu.Block, n int64) error {
	buf := make([]byte, min(n, 4<<20))
	for off := int64(0); off < n; off += int64(len(buf)) {
		chunk := buf[:min(int64(len(buf)), n-off)]
		if err := seg.d.dev.CopyOut(seg.block, off, chunk); err != nil {
			return err
		}
		if err := seg.d.dev.CopyIn(nb, off, chunk); err != nil {
			return err
		}
	}
	return nil
}

// read copies bytes at off into buf and returns how many there were.
func (seg *devSeg) read(buf []byte, off int64) (int, error) {
	seg.mu.Lock()
	defer seg.mu.Unlock()
	if off >= seg.size.Load() {
		return 0, nil
	}
	n := min(int64(len(buf)), seg.size.Load()-off)
	return int(n), seg.d.dev.CopyOut(seg.block, off, buf[:n])
}

// write copies data to off, growing the segment as a file grows.
func (seg *devSeg) write(data []byte, off int64) error {
	seg.mu.Lock()
	defer seg.mu.Unlock()
	if end := off + int64(len(data)); end > seg.size.Load() {
		if err := seg.extend(end); err != nil {
			return err
		}
	}
	return seg.d.dev.CopyIn(seg.block, off, data)
}

// copyChunk is the most a copy between a host file and device memory
// moves while it holds the segment's lock: larger copies release it
// between chunks, so reads, writes and stats of the segment interleave.
const copyChunk = 64 << 20

// fromFile copies n bytes of the host file fd at fileOff to off, growing
// the segment as needed; the device reads the file itself.
func (seg *devSeg) fromFile(fd int, fileOff, off, n int64) error {
	if err := seg.grow(off + n); err != nil {
		return err
	}
	for done := int64(0); done < n; {
		c := min(copyChunk, n-done)
		seg.mu.Lock()
		if off+done+c > seg.size.Load() { // shrunk meanwhile
			seg.mu.Unlock()
			return fmt.Errorf("%w: the segment shrank during the copy", syscall.EIO)
		}
		err := seg.d.dev.CopyFromFile(seg.block, off+done, fd, fileOff+done, c)
		seg.mu.Unlock()
		if err != nil {
			return err
		}
		done += c
	}
	return nil
}

// toFile copies up to n bytes at off into the host file fd at fileOff and
// returns how many there were.
func (seg *devSeg) toFile(fd int, off, fileOff, n int64) (int64, error) {
	var done int64
	for done < n {
		seg.mu.Lock()
		c := min(copyChunk, n-done, seg.size.Load()-off-done)
		var err error
		if c > 0 {
			err = seg.d.dev.CopyToFile(seg.block, off+done, fd, fileOff+done, c)
		}
		seg.mu.Unlock()
		if c <= 0 || err != nil {
			return done, err
		}
		done += c
	}
	return done, nil
}

// grow extends the segment to end bytes if it is shorter (fallocate, a
// copy into it).
func (seg *devSeg) grow(end int64) error {
	seg.mu.Lock()
	defer seg.mu.Unlock()
	if end > seg.size.Load() {
		return seg.extend(end)
	}
	return nil
}

// ipc returns the segment's IPC information; ErrNoAttr while it has no
// bytes.
func (seg *devSeg) ipc() (gpu.IPCInfo, error) {
	seg.mu.Lock()
	defer seg.mu.Unlock()
	if seg.block.Size == 0 {
		return gpu.IPCInfo{}, fmt.Errorf("%w: the segment has no device memory yet", alloc.ErrNoAttr)
	}
	info, err := seg.d.dev.IPC(seg.block)
	seg.handedOut = seg.handedOut || err == nil
	return info, err
}

// refCounter returns the path of the segment's consumer counter file,
// making it on first use with the segment's access (followLocked).
func (seg *devSeg) refCounter() (string, error) {
	seg.mu.Lock()
	defer seg.mu.Unlock()
	seg.cmu.Lock()
	defer seg.cmu.Unlock()
	if seg.counter != nil {
		return seg.counter.Path(), nil
	}
	if seg.removed {
		return "", fmt.Errorf("%w: the segment was removed before a consumer asked for a counter", alloc.ErrNoAttr)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(seg.backing.Fd()), &st); err != nil {
		return "", err
	}
	if err := seg.d.owners.Take(st.Uid, 1); err != nil {
		return "", err
	}
	c, err := seg.d.counters.New()
	if err != nil {
		seg.d.owners.Give(st.Uid, 1)
		return "", err
	}
	seg.counter, seg.counterUID = c, st.Uid
	err = c.Charge(st.Uid) // for a successor that finds it retired
	if err == nil {
		err = seg.followLocked()
	}
	if err == nil { // a successor finds the counter by the block's tag
		err = seg.tag(seg.block, st.Uid, c.Name())
	}
	if err != nil {
		seg.counter = nil
		c.Remove(seg.d.giveCounter(st.Uid))
		return "", err
	}
	return c.Path(), nil
}

// followLocked gives the consumer counter, if any, the owner and group of
// the segment and read and write for exactly the classes that may read
// it; mu and cmu are held.
func (seg *devSeg) followLocked() error {
	if seg.counter == nil || seg.backing == nil {
		return nil
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(seg.backing.Fd()), &st); err != nil {
		return err
	}
	return seg.counter.Follow(st.Uid, st.Gid, st.Mode)
}

// followAccess makes the consumer counter, if any, follow a chmod or
// chown of the segment.
func (seg *devSeg) followAccess() {
	seg.mu.Lock()
	defer seg.mu.Unlock()
	seg.cmu.Lock()
	defer seg.cmu.Unlock()
	if err := seg.followLocked(); err != nil {
		seg.d.log.Error("reference counter does not follow the segment's owner and mode", "file", seg.counter.Path(), "err", err)
	}
}

// opened and closed count the segment's open handles.
func (seg *devSeg) opened() { seg.opens.Add(1) }

// closed closes a removed segment's backing file at its last close.
func (seg *devSeg) closed() {
	if seg.opens.Add(-1) == 0 {
		seg.mu.Lock()
		if seg.removed && seg.opens.Load() == 0 {
			seg.closeBacking()
		}
		seg.mu.Unlock()
	}
	seg.d.limbo.Collect()
}

// closeBacking closes the backing file, if still open, and gives its
// descriptor back to its owner's budget; mu is held.
func (seg *devSeg) closeBacking() {
	if seg.backing == nil {
		return
	}
	seg.backing.Close()
	seg.backing = nil
	seg.d.handles.Give(seg.uid, 1)
}

// backingRef returns a reference to the backing file while it is open (a
// removed segment's, while handles hold it).
func (seg *devSeg) backingRef() (*alloc.Ref, error) {
	seg.mu.Lock()
	defer seg.mu.Unlock()
	if seg.backing == nil {
		return nil, fmt.Errorf("%w: the segment's attributes went with its last name", syscall.ENOENT)
	}
	return alloc.OpenRef(int(seg.backing.Fd()), "", 0)
}

// export returns a POSIX descriptor of the segment's device memory, for
// the control socket's export of KEEPFD segments. The first export moves
// the bytes to an exportable (VMM) allocation; the old block goes to limbo.
func (seg *devSeg) export() (*os.File, error) {
	seg.mu.Lock()
	defer seg.mu.Unlock()
	if seg.size.Load() == 0 {
		return nil, fmt.Errorf("%w: the segment has no device memory yet", alloc.ErrInvalid)
	}
	if !seg.exportable {
		if err := seg.withReserve(seg.size.Load(), seg.moveExportable); err != nil {
			return nil, err
		}
	}
	f, err := seg.d.dev.Export(seg.block)
	seg.handedOut = seg.handedOut || err == nil
	return f, err
}

// moveExportable moves the segment's bytes to an exportable block of its
// size; the old block goes to limbo (replace).
func (seg *devSeg) moveExportable() error {
	nb, err := seg.d.dev.AllocExportable(seg.size.Load())
	if err != nil {
		return err
	}
	if err := seg.tagNew(nb); err != nil {
		return err
	}
	if err := seg.copyPrefix(nb, seg.size.Load()); err != nil {
		seg.d.dev.Free(nb)
		return err
	}
	seg.replace(nb)
	seg.exportable = true
	return nil
}
