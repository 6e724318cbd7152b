package fs

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/gpu"
)

// claimDevices restores the device segments of a mount this daemon took
// over (DESIGN.md §12), once it has it: the predecessor's GPU helper
// lives on, this daemon claims it (gpu.Survivor.Claim; settle ends the
// predecessor's session once this one serves), and each segment takes its
// block with its bytes, IPC handle and consumer counter, as the backing
// file records it (alloc.DeviceState.Block) and the block's tag confirms
// (blockTag).
// A segment whose block is gone is restored as after a crash. A removed
// segment that open handles hold (orphans: its backing file handed over,
// by node ID) takes its block back too, in limbo until its last close
// (claims.orphan); one whose block is gone fails, EIO. Blocks no segment
// holds wait in limbo while their counter holds them (charged to the uid
// their tag names); the rest are freed, in one log line. A claim that
// fails leaves every device segment EIO, in one log line.
func (fsys *filesystem) claimDevices(orphans map[uint64]int) {
	d := fsys.gpu
	files := d.pending
	d.pending = nil
	removed := d.deviceOrphans(orphans)
	s, ok := d.dev.(gpu.Survivor)
	if !ok {
		d.restoreAll(files)
		d.adopted = map[string]adopted{}
		fsys.unrestore(removed, fmt.Errorf("%w: the GPU helper's blocks were not taken over", gpu.ErrUnavailable))
		return
	}
	owned, err := s.Claim()
	if err != nil {
		d.log.Error("takeover: the GPU helper's blocks could not be claimed; device segments fail (EIO)", "err", err)
		fsys.unrestore(append(files, removed...), fmt.Errorf("%w: the GPU helper was lost in the handover: %v", gpu.ErrUnavailable, err))
		return
	}
	blocks := map[uint64]gpu.Owned{}
	for _, o := range owned {
		blocks[o.Block.ID] = o
	}
	c := &claims{d: d, counters: map[string]adopted{}, ghosts: map[string]*devSeg{}}
	var restored, lost []*os.File
	for _, f := range files {
		if ok, err := c.segment(f, blocks); err != nil {
			d.log.Warn("device segment not restored", "path", f.Name(), "err", err)
			f.Close()
		} else if ok {
			restored = append(restored, f)
		} else {
			lost = append(lost, f)
		}
	}
	d.restoreAll(lost)
	for _, f := range removed {
		if err := c.orphan(f, blocks); err != nil {
			d.log.Warn("takeover: a removed device segment that open handles hold lost its device memory; they fail (EIO)", "node", f.Name(), "err", err)
			fsys.unrestore([]*os.File{f}, fmt.Errorf("%w: the segment's device memory was lost in the handover: %v", gpu.ErrUnavailable, err))
		}
	}
	freed := c.rest(blocks)
	d.adopted = c.counters // settle keeps them
	d.log.Info("takeover: device segments claimed their blocks of the GPU helper", "claimed", len(restored), "restored", len(lost), "limbo", len(blocks)-freed, "freed", freed)
}

// settle ends the GPU helper's sessions of other daemons, once this one
// serves the mount it took over, and removes the predecessor's counter
// files no segment adopted (keepCounters): until then a predecessor whose
// successor fails gets the device and its counters back.
func (d *devices) settle() {
	d.taking = false
	if d.adopted != nil {
		d.keepCounters(d.adopted)
		d.adopted = nil
	}
	if s, ok := d.dev.(gpu.Survivor); ok {
		if err := s.Settle(); err != nil {
			d.log.Warn("takeover: the predecessor's session of the GPU helper not ended", "err", err)
		}
	}
}

// claims is what claimDevices adopted: the counter files by name, and the
// removed segments whose blocks wait in limbo, by their counter's name.
type claims struct {
	d        *devices
	counters map[string]adopted
	ghosts   map[string]*devSeg
}

// segment restores the device segment whose backing file is f with its
// block of blocks, which it takes out; false, f kept, if it has none.
func (c *claims) segment(f *os.File, blocks map[uint64]gpu.Owned) (bool, error) {
	d := c.d
	seg, err := c.claim(f, blocks)
	if seg == nil {
		return false, err
	}
	if err := seg.reserve(gpu.DeviceBytes(d.dev, seg.block.Size)); err != nil {
		d.log.Warn("device segment taken over without backing space for its next spill: a clean unmount may lose it", "path", f.Name(), "err", err)
	}
	d.mu.Lock()
	d.segs[seg.ino] = seg
	d.mu.Unlock()
	seg.followAccess()
	return true, nil
}

// orphan takes over the removed device segment whose backing file is f,
// which open handles hold, with its block of blocks: the block waits in
// limbo, as drop left it, until the last handle closes and its counter,
// if any, is zero; the backing file is kept until that last close, for
// the next successor. Adopt finds the segment by its node ID (orphan).
func (c *claims) orphan(f *os.File, blocks map[uint64]gpu.Owned) error {
	seg, err := c.claim(f, blocks)
	if seg == nil {
		if err == nil {
			err = errors.New("the GPU helper has no block for it")
		}
		return err
	}
	d := c.d
	seg.mu.Lock()
	seg.cmu.Lock()
	seg.removed = true
	seg.cmu.Unlock()
	seg.retire(seg.block)
	seg.mu.Unlock()
	d.mu.Lock()
	if d.orphans == nil {
		d.orphans = map[uint64]*devSeg{}
	}
	d.orphans[seg.ino] = seg
	d.mu.Unlock()
	return nil
}

// claim makes the device segment whose backing file is f, with its block
// of blocks, which it takes out, and charges its backing file to its
// owner; nil, f kept, if it has none.
func (c *claims) claim(f *os.File, blocks map[uint64]gpu.Owned) (*devSeg, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, err
	}
	ds, err := alloc.ReadDeviceState(alloc.FdPath(int(f.Fd())))
	if err != nil {
		return nil, err
	}
	o, t, ok := segmentBlock(blocks, st.Ino, ds)
	if !ok {
		return nil, nil
	}
	delete(blocks, o.Block.ID)
	seg := &devSeg{d: c.d, ino: st.Ino, block: o.Block, exportable: o.Exportable, backing: f, uid: st.Uid, limboUID: t.UID,
		reserved: st.Blocks * 512}
	// Whether its handle left the predecessor is not known: as if it did.
	seg.handedOut = true
	seg.size.Store(ds.Size)
	if t.Counter != "" {
		if seg.counter, _ = c.counter(t.Counter, t.UID); seg.counter != nil {
			seg.counterUID = t.UID
		}
	}
	c.d.handles.Add(st.Uid, 1) // what the predecessor held, whatever the bound now
	return seg, nil
}

// deviceOrphans returns a duplicate of each descriptor of orphans (the
// backing files of segments in no directory, handed over by node ID)
// whose file is a segment on this mount's device.
func (d *devices) deviceOrphans(orphans map[uint64]int) []*os.File {
	var files []*os.File
	for id, fd := range orphans {
		var st unix.Stat_t
		if unix.Fstat(fd, &st) != nil {
			continue
		}
		mk, err := alloc.ReadMarker(alloc.FdPath(fd), &st)
		if err != nil || mk.Kind != alloc.Device || mk.Device != d.dev.Name() {
			continue
		}
		if dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0); err == nil {
			files = append(files, os.NewFile(uintptr(dup), fmt.Sprintf("node %d", id)))
		}
	}
	return files
}

// orphan returns the removed segment of backing inode ino that
// claimDevices took over, nil for none.
func (d *devices) orphan(ino uint64) *devSeg {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.orphans[ino]
}

// settleOrphans ends Adopt for the removed segments taken over: one no
// handle opened again lets its backing file go (its block goes from
// limbo once its counter, if any, is zero).
func (d *devices) settleOrphans() {
	d.mu.Lock()
	orphans := d.orphans
	d.orphans = nil
	d.mu.Unlock()
	for _, seg := range orphans {
		seg.mu.Lock()
		if seg.opens.Load() == 0 {
			seg.closeBacking()
		}
		seg.mu.Unlock()
	}
}

// segmentBlock returns the block of blocks that segment ino, whose
// backing file records ds, owns: the one it records, or, should the
// predecessor have died between a new block and its record, its newest
// large enough. A block's tag must name the segment.
func segmentBlock(blocks map[uint64]gpu.Owned, ino uint64, ds alloc.DeviceState) (gpu.Owned, blockTag, bool) {
	if o, ok := blocks[ds.Block]; ok {
		if t, ok := parseTag(o.Tag); ok && t.Ino == ino && o.Block.Size >= ds.Size {
			return o, t, true
		}
	}
	var best gpu.Owned
	var bestTag blockTag
	for _, o := range blocks {
		if t, ok := parseTag(o.Tag); ok && t.Ino == ino && o.Block.Size >= ds.Size && ds.Size > 0 && o.Block.ID > best.Block.ID {
			best, bestTag = o, t
		}
	}
	return best, bestTag, best.Block.ID != 0
}

// parseTag decodes a block's tag; false for none or a malformed one.
func parseTag(b []byte) (blockTag, bool) {
	var t blockTag
	return t, len(b) > 0 && json.Unmarshal(b, &t) == nil && t.Ino != 0
}

// counter adopts the counter file name, charged to uid once, and returns
// it: nil and no error if the file is gone (nothing it counted can hold
// memory any more), nil and why if it could not be adopted.
func (c *claims) counter(name string, uid uint32) (*gpu.Counter, error) {
	if a, ok := c.counters[name]; ok {
		return a.c, a.err
	}
	ctr, err := c.d.counters.Adopt(name)
	switch {
	case errors.Is(err, unix.ENOENT):
		err = nil
	case err != nil:
		c.d.log.Warn("takeover: a consumer counter could not be taken over; the memory it guards stays in limbo until unmount", "counter", name, "err", err)
	default:
		c.d.owners.Add(uid, 1) // what the predecessor held, whatever the bound now
	}
	c.counters[name] = adopted{ctr, err}
	return ctr, err
}

// adopted is a counter file's adoption: the counter, or why not.
type adopted struct {
	c   *gpu.Counter
	err error
}

// rest puts the blocks no segment claimed in limbo, where what held them
// still does: beside a live segment's block (its handles and counter),
// or in a removed segment's stand-in (a ghost, which holds its counter
// until its last block goes; one whose counter could not be adopted holds
// its blocks until unmount). It frees the others, which no consumer can
// count on (untagged, or their counter gone), and returns how many.
func (c *claims) rest(blocks map[uint64]gpu.Owned) (freed int) {
	for _, id := range slices.Sorted(maps.Keys(blocks)) {
		o := blocks[id]
		seg := c.holder(o.Tag)
		if seg == nil {
			c.d.dev.Free(o.Block)
			freed++
			continue
		}
		seg.mu.Lock()
		seg.retire(o.Block)
		seg.mu.Unlock()
	}
	if freed > 0 {
		c.d.log.Warn("takeover: freed the GPU helper's blocks that no segment or consumer counter claims", "blocks", freed)
	}
	return freed
}

// holder returns the segment whose limbo a block tagged tag joins, with
// the tag's uid as its limbo's; nil for none.
func (c *claims) holder(tag []byte) *devSeg {
	t, ok := parseTag(tag)
	if !ok {
		return nil
	}
	var ctr *gpu.Counter
	var err error
	if t.Counter != "" {
		ctr, err = c.counter(t.Counter, t.UID)
	}
	c.d.mu.Lock()
	seg := c.d.segs[t.Ino]
	c.d.mu.Unlock()
	if seg == nil || err != nil {
		seg = c.ghost(t, ctr, err)
	}
	if seg == nil {
		return nil
	}
	seg.mu.Lock()
	seg.limboUID = t.UID
	seg.cmu.Lock()
	if seg.counter == nil && ctr != nil { // a live segment whose block's tag missed it
		seg.counter, seg.counterUID = ctr, t.UID
	}
	seg.cmu.Unlock()
	seg.mu.Unlock()
	return seg
}

// ghost returns the stand-in of a removed segment whose blocks counter
// ctr guards (err: it could not be adopted, and they are held), by the
// counter's name; nil if the counter is gone.
func (c *claims) ghost(t blockTag, ctr *gpu.Counter, err error) *devSeg {
	if g, ok := c.ghosts[t.Counter]; ok {
		return g
	}
	var g *devSeg
	if ctr != nil || err != nil {
		g = &devSeg{d: c.d, ino: t.Ino, removed: true, counter: ctr, counterUID: t.UID, limboUID: t.UID}
		if err != nil {
			g.opens.Store(1) // never closed: held until unmount
		}
	}
	if t.Counter != "" {
		c.ghosts[t.Counter] = g
	}
	return g
}

// keepCounters removes the counter files of the predecessor's that no
// segment adopted (counters, by name), or tried to; those a consumer
// still holds, and the predecessor's retired ones, it keeps retired,
// charged to the uid each was made for until nobody holds it.
func (d *devices) keepCounters(counters map[string]adopted) {
	keep := map[string]bool{}
	for name, a := range counters {
		keep[name] = a.c != nil || a.err != nil
	}
	charge := func(uid uint32) func() {
		d.owners.Add(uid, 1) // what the predecessor held, whatever the bound now
		return d.giveCounter(uid)
	}
	if err := d.counters.RemoveUnadopted(keep, charge); err != nil {
		d.log.Warn("takeover: the predecessor's unclaimed consumer counters not removed", "err", err)
	}
}

// FailAfterClaimEnv names the environment variable that makes a
// successor fail its takeover once it has claimed the GPU helper's
// blocks, after the duration it gives (e.g. "2s"), for tests of a failed
// restart only: the predecessor must serve on as it was.
const FailAfterClaimEnv = "TENSORFS_TEST_FAIL_AFTER_CLAIM"

// failAfterClaim is FailAfterClaimEnv's hook: nil when it is not set.
func failAfterClaim() error {
	v := os.Getenv(FailAfterClaimEnv)
	if v == "" {
		return nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return fmt.Errorf("%s: %v", FailAfterClaimEnv, err)
	}
	time.Sleep(d)
	return fmt.Errorf("failed after the GPU claim, as %s=%s asks", FailAfterClaimEnv, v)
}
