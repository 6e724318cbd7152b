package fs

import (
	"fmt"
	"os"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/fdpass"
)

// device is a segment in GPU memory (devSeg, device.go): the daemon
// copies every read and write; the backing file, empty while mounted,
// keeps the segment's name, owner, flags and attributes, and its
// recorded size.
type device struct{ seg *devSeg }

func (device) kind() alloc.Kind { return alloc.Device }

func (device) attrs(m *alloc.Ref, fn func(*alloc.Ref) error) error { return fn(m) }

// overlay is the backing file's stat, with the size of the device memory
// (read without waiting for a copy into it).
func (d device) overlay(m *alloc.Ref, st *unix.Stat_t) error {
	st.Size = d.seg.Size()
	st.Blocks = (st.Size + 511) / 512
	return nil
}

func (d device) open(n *segmentNode, m *alloc.Ref, h handle, flags uint32) (segmentHandle, error) {
	d.seg.opened()
	return &deviceHandle{handle: h, seg: d.seg}, nil
}

func (d device) resize(m *alloc.Ref, size int64) error { return d.seg.resize(size) }

// descriptor: device memory has no host descriptor to map; clients open
// it through the mount, or by its CUDA IPC handle.
func (device) descriptor(*alloc.Ref, bool) (*os.File, error) { return nil, nil }

// export hands a peer a POSIX descriptor of the segment's device memory
// (the control socket's export of a KEEPFD segment), with the access it
// asked for, on an open file description of its own (gpu.Device.Export
// makes a new one for each call; the sim's is an owner-only memfd, sealed
// against resizing, which no other user can open again for writing
// through /proc/self/fd). A read-only export is a read-only reopen of
// that memory's file. Memory whose descriptor cannot be reopened (CUDA's
// own shareable handles, which any holder can map writable) goes only to
// a peer that asks for write, and may: a read-only export of it is
// refused.
func (d device) export(write bool) (*os.File, error) {
	f, err := d.seg.export()
	if err != nil || write {
		return f, err
	}
	defer f.Close()
	ro, err := fdpass.Reopen(int(f.Fd()), unix.O_RDONLY)
	if err != nil {
		return nil, fmt.Errorf("%w: this device memory cannot be handed out read-only (%v): ask for write, which needs write permission on the segment", syscall.EACCES, err)
	}
	return os.NewFile(uintptr(ro), "device memory"), nil
}

func (device) mapped(*alloc.Ref) (fileID, uint32, bool) { return fileID{}, 0, false }

func (device) handle(*alloc.Ref) (string, error) {
	return "", fmt.Errorf("%w: device memory has no host file; use user.tensorfs.cuda.ipc_handle", alloc.ErrNoAttr)
}

func (d device) release() error {
	d.seg.d.drop(d.seg)
	return nil
}

// exporter is a kind whose control-socket export is not a host
// descriptor of its bytes (device memory).
type exporter interface {
	export(write bool) (*os.File, error)
}

// gpuName is the device the mount serves, "" for none.
func (fsys *filesystem) gpuName() string {
	if fsys.gpu == nil {
		return ""
	}
	return fsys.gpu.dev.Name()
}

// moveDevice makes the empty segment n, whose backing object is m, follow
// the device just stored on it: into device memory, or back to the
// backing. n.opening is held for writing, and n has no open handle.
func (fsys *filesystem) moveDevice(n *segmentNode, m *alloc.Ref) error {
	p, err := m.Path()
	if err != nil {
		return err
	}
	dev, err := alloc.ReadDevice(p)
	if err != nil {
		return err
	}
	cur, onDevice := n.storage().(device)
	switch {
	case dev != "cpu" && !onDevice:
		seg, err := fsys.gpu.segment(m)
		if err != nil {
			// The segment stays on the CPU (a lease on its backing file
			// stands in the way, say), and so must its stored device.
			if rerr := alloc.StoreDevice(p, "cpu"); rerr != nil {
				return fmt.Errorf("%w; and the stored device is still %s: %v", err, dev, rerr)
			}
			return err
		}
		n.kind.store(device{seg})
	case dev == "cpu" && onDevice:
		fsys.gpu.drop(cur.seg)
		n.kind.store(host{})
	}
	return nil
}

// inheritDevice gives the new object a, made in the directory open at
// dirfd, the directory's device; for a new segment in a cuda:N directory
// it returns the device storage.
func (fsys *filesystem) inheritDevice(dirfd int, a *alloc.Ref) (storage, error) {
	dev, err := alloc.ReadDevice(alloc.FdPath(dirfd))
	if err != nil || dev == "cpu" || a.IsSymlink() {
		return nil, err
	}
	p, _ := a.Path()
	if err := alloc.StoreDevice(p, dev); err != nil {
		return nil, err
	}
	if a.Stat().Mode&syscall.S_IFMT != syscall.S_IFREG {
		return nil, nil
	}
	if fsys.gpu == nil || fsys.gpu.dev.Name() != dev {
		return nil, fmt.Errorf("%w: the directory's device %s is not served by this mount", alloc.ErrNoDevice, dev)
	}
	seg, err := fsys.gpu.segment(a)
	if err != nil {
		return nil, err
	}
	return device{seg}, nil
}

// cudaAttr answers the user.tensorfs.cuda.* attributes of a device
// segment: raw 64-byte handles, decimal offset (always 0: the segment has
// its allocation to itself), and "PATH:0" of its consumer reference
// counter file.
func cudaAttr(seg *devSeg, attr string) ([]byte, error) {
	if attr == alloc.AttrCudaRefCounter {
		path, err := seg.refCounter()
		return []byte(path + ":0"), err
	}
	info, err := seg.ipc()
	if err != nil {
		return nil, err
	}
	switch attr {
	case alloc.AttrCudaIPCHandle:
		return info.MemHandle[:], nil
	case alloc.AttrCudaOffset:
		return []byte("0"), nil
	case alloc.AttrCudaEventHandle:
		return info.EventHandle[:], nil
	}
	return nil, alloc.ErrNoAttr
}
