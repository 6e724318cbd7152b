package fs

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"slices"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/gpu"
)

// claimDevices restores the device segments of a mount this daemon took
// over (DESIGN.md §12), once it has it: the predecessor's GPU helper
// lives on, and each segment claims its block (gpu.Survivor.Claim) with
// its bytes, IPC handle and consumer counter, as the backing file records
// it (alloc.DeviceState.Block) and the block's tag confirms (blockTag).
// A segment whose block is gone is restored as after a crash. Blocks no
// segment holds wait in limbo while their counter holds them (charged to
// the uid their tag names); the rest are freed, in one log line. A claim
// that fails leaves every device segment EIO, in one log line.
func (fsys *filesystem) claimDevices() {
	d := fsys.gpu
	files := d.pending
	d.pending = nil
	s, ok := d.dev.(gpu.Survivor)
	if !ok {
		d.restoreAll(files)
		d.keepCounters(nil)
		return
	}
	owned, err := s.Claim()
	if err != nil {
		d.log.Error("takeover: the GPU helper's blocks could not be claimed; device segments fail (EIO)", "err", err)
		fsys.unrestore(files, fmt.Errorf("%w: the GPU helper was lost in the handover: %v", gpu.ErrUnavailable, err))
		return
	}
	blocks := map[uint64]gpu.Owned{}
	for _, o := range owned {
		blocks[o.Block.ID] = o
	}
	c := &claims{d: d, counters: map[string]*gpu.Counter{}, ghosts: map[string]*devSeg{}}
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
	freed := c.rest(blocks)
	d.keepCounters(c.counters)
	d.log.Info("takeover: device segments claimed their blocks of the GPU helper", "claimed", len(restored), "restored", len(lost), "limbo", len(blocks)-freed, "freed", freed)
}

// claims is what claimDevices adopted: the counter files by name, and the
// removed segments whose blocks wait in limbo, by their counter's name.
type claims struct {
	d        *devices
	counters map[string]*gpu.Counter
	ghosts   map[string]*devSeg
}

// segment restores the device segment whose backing file is f with its
// block of blocks, which it takes out; false, f kept, if it has none.
func (c *claims) segment(f *os.File, blocks map[uint64]gpu.Owned) (bool, error) {
	d := c.d
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return false, err
	}
	ds, err := alloc.ReadDeviceState(alloc.FdPath(int(f.Fd())))
	if err != nil {
		return false, err
	}
	o, t, ok := segmentBlock(blocks, st.Ino, ds)
	if !ok {
		return false, nil
	}
	delete(blocks, o.Block.ID)
	seg := &devSeg{d: d, ino: st.Ino, block: o.Block, exportable: o.Exportable, backing: f, uid: st.Uid, limboUID: t.UID,
		reserved: st.Blocks * 512}
	// Whether its handle left the predecessor is not known: as if it did.
	seg.handedOut = true
	seg.size.Store(ds.Size)
	if t.Counter != "" {
		if seg.counter = c.counter(t.Counter, t.UID); seg.counter != nil {
			seg.counterUID = t.UID
		}
	}
	if err := seg.reserve(gpu.DeviceBytes(d.dev, o.Block.Size)); err != nil {
		d.log.Warn("device segment taken over without backing space for its next spill: a clean unmount may lose it", "path", f.Name(), "err", err)
	}
	d.handles.Add(st.Uid, 1) // what the predecessor held, whatever the bound now
	d.mu.Lock()
	d.segs[st.Ino] = seg
	d.mu.Unlock()
	seg.followAccess()
	return true, nil
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
// it; nil if it cannot.
func (c *claims) counter(name string, uid uint32) *gpu.Counter {
	if ctr, ok := c.counters[name]; ok {
		return ctr
	}
	ctr, err := c.d.counters.Adopt(name)
	if err != nil {
		c.d.log.Warn("takeover: a consumer counter could not be taken over; the memory it guarded is freed when nothing else holds it", "counter", name, "err", err)
		c.counters[name] = nil
		return nil
	}
	c.d.owners.Add(uid, 1) // what the predecessor held, whatever the bound now
	c.counters[name] = ctr
	return ctr
}

// rest puts the blocks no segment claimed in limbo, where their counter
// still holds them: beside a live segment's block, or in a removed
// segment's (a ghost, which holds its counter until its last block goes);
// it frees the others, no consumer can count on, and returns how many.
func (c *claims) rest(blocks map[uint64]gpu.Owned) (freed int) {
	for _, id := range slices.Sorted(maps.Keys(blocks)) {
		o := blocks[id]
		t, ok := parseTag(o.Tag)
		var seg *devSeg
		if ok {
			c.d.mu.Lock()
			seg = c.d.segs[t.Ino]
			c.d.mu.Unlock()
			if seg == nil && t.Counter != "" {
				seg = c.ghost(t)
			}
		}
		if seg == nil {
			c.d.dev.Free(o.Block)
			freed++
			continue
		}
		seg.mu.Lock()
		seg.limboUID = t.UID
		seg.retire(o.Block)
		seg.mu.Unlock()
	}
	if freed > 0 {
		c.d.log.Warn("takeover: freed the GPU helper's blocks that no segment or consumer counter claims", "blocks", freed)
	}
	return freed
}

// ghost returns the removed segment whose blocks counter t.Counter
// guards, nil if that counter is gone.
func (c *claims) ghost(t blockTag) *devSeg {
	if g, ok := c.ghosts[t.Counter]; ok {
		return g
	}
	var g *devSeg
	if ctr := c.counter(t.Counter, t.UID); ctr != nil {
		g = &devSeg{d: c.d, ino: t.Ino, removed: true, counter: ctr, counterUID: t.UID, limboUID: t.UID}
	}
	c.ghosts[t.Counter] = g
	return g
}

// keepCounters removes the counter files of the predecessor's that no
// segment adopted (counters, by name).
func (d *devices) keepCounters(counters map[string]*gpu.Counter) {
	adopted := map[string]bool{}
	for name, c := range counters {
		adopted[name] = c != nil
	}
	if err := d.counters.RemoveUnadopted(adopted); err != nil {
		d.log.Warn("takeover: the predecessor's unclaimed consumer counters not removed", "err", err)
	}
}
