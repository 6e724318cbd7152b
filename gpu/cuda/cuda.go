//go:build cuda

package cuda

// The backend: gorgonia.org/cu for the context, allocations, copies,
// streams and staging events; the small C functions below for what cu
// lacks (IPC handles, interprocess events, pinned host memory and the
// virtual memory management calls behind AllocExportable).

/*
#cgo LDFLAGS: -lcuda
#include <cuda.h>
#include <string.h>

// tfs_prop describes device memory exportable as a POSIX file descriptor.
static void tfs_prop(CUmemAllocationProp *p, int dev) {
	memset(p, 0, sizeof *p);
	p->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	p->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	p->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	p->location.id = dev;
}

// tfs_vmm_granularity sets *g to the allocation granularity of exportable
// memory, or to 0 when the device cannot export memory as a file descriptor.
static CUresult tfs_vmm_granularity(int dev, size_t *g) {
	int vmm = 0, posix = 0;
	CUmemAllocationProp p;
	CUresult r;

	*g = 0;
	r = cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
	if (r == CUDA_SUCCESS)
		r = cuDeviceGetAttribute(&posix, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
	if (r != CUDA_SUCCESS || !vmm || !posix)
		return r;
	tfs_prop(&p, dev);
	return cuMemGetAllocationGranularity(g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
}

// tfs_vmm_alloc creates size bytes (a multiple of the granularity) of
// exportable memory, maps them at a reserved address range and makes them
// readable and writable by dev.
static CUresult tfs_vmm_alloc(int dev, size_t size, CUmemGenericAllocationHandle *h, CUdeviceptr *ptr) {
	CUmemAllocationProp p;
	CUmemAccessDesc a;
	CUresult r;

	tfs_prop(&p, dev);
	r = cuMemCreate(h, size, &p, 0);
	if (r != CUDA_SUCCESS)
		return r;
	r = cuMemAddressReserve(ptr, size, 0, 0, 0);
	if (r != CUDA_SUCCESS)
		goto release;
	r = cuMemMap(*ptr, size, 0, *h, 0);
	if (r != CUDA_SUCCESS)
		goto unreserve;
	memset(&a, 0, sizeof a);
	a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	a.location.id = dev;
	a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	r = cuMemSetAccess(*ptr, size, &a, 1);
	if (r == CUDA_SUCCESS)
		return r;
	cuMemUnmap(*ptr, size);
unreserve:
	cuMemAddressFree(*ptr, size);
release:
	cuMemRelease(*h);
	return r;
}

// tfs_vmm_free undoes tfs_vmm_alloc and returns the first error.
static CUresult tfs_vmm_free(CUmemGenericAllocationHandle h, CUdeviceptr ptr, size_t size) {
	CUresult r = cuMemUnmap(ptr, size);
	CUresult r2 = cuMemAddressFree(ptr, size);
	CUresult r3 = cuMemRelease(h);
	if (r != CUDA_SUCCESS)
		return r;
	return r2 != CUDA_SUCCESS ? r2 : r3;
}

static CUresult tfs_vmm_export(CUmemGenericAllocationHandle h, int *fd) {
	return cuMemExportToShareableHandle(fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
}

// tfs_zero clears size bytes at ptr and waits until they are clear: the
// lanes' non-blocking streams do not wait for the legacy default stream.
static CUresult tfs_zero(CUdeviceptr ptr, size_t size) {
	CUresult r = cuMemsetD8(ptr, 0, size);
	if (r != CUDA_SUCCESS)
		return r;
	return cuStreamSynchronize(0);
}

// tfs_ipc_mem copies the IPC handle of the allocation at ptr to out.
static CUresult tfs_ipc_mem(CUdeviceptr ptr, void *out) {
	CUipcMemHandle h;
	CUresult r = cuIpcGetMemHandle(&h, ptr);
	if (r == CUDA_SUCCESS)
		memcpy(out, h.reserved, sizeof h.reserved);
	return r;
}

// tfs_ipc_event creates an interprocess event and copies its handle to out.
static CUresult tfs_ipc_event(CUevent *ev, void *out) {
	CUipcEventHandle h;
	CUresult r = cuEventCreate(ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
	if (r != CUDA_SUCCESS)
		return r;
	r = cuIpcGetEventHandle(&h, *ev);
	if (r != CUDA_SUCCESS) {
		cuEventDestroy(*ev);
		return r;
	}
	memcpy(out, h.reserved, sizeof h.reserved);
	return r;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"unsafe"

	"gorgonia.org/cu"

	"tensorfs/gpu"
	"tensorfs/gpu/internal/devmem"
)

// cudaStaging is the size of each pinned staging buffer of a lane.
const cudaStaging = 8 << 20

// ipcGranularity is what cuMemAlloc sizes round up to. The driver may
// place small cuMemAlloc allocations side by side in one larger block, and
// an IPC handle then maps that whole block; allocations of a multiple of
// 2 MiB are never placed so (CUDA C Programming Guide, "Interprocess
// Communication"), so a handle reaches its own block alone.
const ipcGranularity = 2 << 20

// cudaDevice is the cuda backend. Every CUDA call runs in run, on a locked
// OS thread with the device's primary context current.
type cudaDevice struct {
	name        string
	dev         cu.Device
	ctx         cu.CUContext
	granularity int64 // of exportable allocations; 0 when the device cannot export
	table       *devmem.Table[*cudaMem]
	lanes       *devmem.Lanes

	mu     sync.Mutex          // guards events, pinned and cudaMem.ipc
	events map[uint64]ipcEvent // interprocess events of blocks, by block ID
	pinned []hostRange         // host memory registered by Pin
}

// cudaMem is one device allocation.
type cudaMem struct {
	ptr        cu.DevicePtr
	size       int64
	exportable bool                           // made by tfs_vmm_alloc
	handle     C.CUmemGenericAllocationHandle // when exportable
	ipc        *[64]byte                      // its IPC handle, once asked for
}

type ipcEvent struct {
	ev     C.CUevent
	handle [64]byte
}

type hostRange struct{ start, end uintptr }

// cudaLane is a lane: two pinned buffers, a stream and an event per buffer.
type cudaLane struct {
	d      *cudaDevice
	host   [2]unsafe.Pointer
	bufs   [2][]byte
	stream cu.Stream
	done   [2]cu.Event
}

var (
	_ gpu.Device = (*cudaDevice)(nil)
	_ gpu.Pinner = (*cudaDevice)(nil)
)

// Open opens CUDA device index (cuInit ran in gorgonia.org/cu's init).
func Open(index int) (gpu.Device, error) {
	n, err := cu.NumDevices()
	if err != nil {
		return nil, cuWrap("cuDeviceGetCount", err)
	}
	if index >= n {
		return nil, fmt.Errorf("%w: cuda:%d asked for, %d CUDA devices present", gpu.ErrInvalid, index, n)
	}
	dev, err := cu.GetDevice(index)
	if err != nil {
		return nil, cuWrap("cuDeviceGet", err)
	}
	ctx, err := dev.RetainPrimaryCtx()
	if err != nil {
		return nil, cuWrap("cuDevicePrimaryCtxRetain", err)
	}
	d := &cudaDevice{name: fmt.Sprintf("cuda:%d", index), dev: dev, ctx: ctx, events: make(map[uint64]ipcEvent)}
	err = d.run(func() error {
		var g C.size_t
		err := cuErr("cuMemGetAllocationGranularity", C.tfs_vmm_granularity(C.int(dev), &g))
		d.granularity = int64(g)
		return err
	})
	if err != nil {
		dev.ReleasePrimaryCtx()
		return nil, err
	}
	d.table = devmem.NewTable(d.newMem, d.freeMem)
	d.lanes = devmem.NewLanes(devmem.MaxLanes, d.newLane)
	return d, nil
}

// run calls f on a locked OS thread with the device's context current.
func (d *cudaDevice) run(f func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := cu.SetCurrentContext(d.ctx); err != nil {
		return cuWrap("cuCtxSetCurrent", err)
	}
	return f()
}

// cuErr turns a CUresult from the C functions above into an error.
func cuErr(call string, r C.CUresult) error {
	if r == C.CUDA_SUCCESS {
		return nil
	}
	var name *C.char
	text := fmt.Sprintf("CUresult %d", int(r))
	if C.cuGetErrorName(r, &name) == C.CUDA_SUCCESS && name != nil {
		text = C.GoString(name)
	}
	if r == C.CUDA_ERROR_OUT_OF_MEMORY {
		return fmt.Errorf("%w: %s: %s", gpu.ErrOutOfMemory, call, text)
	}
	return fmt.Errorf("%s: %s", call, text)
}

// cuWrap names the call an error of gorgonia.org/cu came from.
func cuWrap(call string, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, cu.OutOfMemory) {
		return fmt.Errorf("%w: %s: %v", gpu.ErrOutOfMemory, call, err)
	}
	return fmt.Errorf("%s: %v", call, err)
}

// newMem makes a zeroed allocation: whole, since a consumer of its IPC
// handle or export sees every byte, those past the block's size included.
func (d *cudaDevice) newMem(size int64, exportable bool) (*cudaMem, int64, error) {
	m := &cudaMem{exportable: exportable}
	if exportable && d.granularity == 0 {
		return nil, 0, fmt.Errorf("%w: %s has no virtual memory management with POSIX file descriptors", gpu.ErrNotExportable, d.name)
	}
	g := int64(ipcGranularity)
	if exportable {
		g = d.granularity
	}
	m.size = devmem.RoundUp(size, g)
	err := d.run(func() error {
		if exportable {
			var ptr C.CUdeviceptr
			if err := cuErr("cuMemCreate", C.tfs_vmm_alloc(C.int(d.dev), C.size_t(m.size), &m.handle, &ptr)); err != nil {
				return err
			}
			m.ptr = cu.DevicePtr(ptr)
		} else {
			var err error
			if m.ptr, err = cu.MemAlloc(m.size); err != nil {
				return cuWrap("cuMemAlloc", err)
			}
		}
		if err := cuErr("cuMemsetD8", C.tfs_zero(C.CUdeviceptr(m.ptr), C.size_t(m.size))); err != nil {
			d.freeMem(m)
			return err
		}
		return nil
	})
	if err != nil {
		return nil, 0, err
	}
	return m, m.size, nil
}

func (d *cudaDevice) freeMem(m *cudaMem) error {
	return d.run(func() error {
		if m.exportable {
			return cuErr("cuMemUnmap", C.tfs_vmm_free(m.handle, C.CUdeviceptr(m.ptr), C.size_t(m.size)))
		}
		return cuWrap("cuMemFree", cu.MemFree(m.ptr))
	})
}

func (d *cudaDevice) newLane() (devmem.Lane, error) {
	l := &cudaLane{d: d}
	err := d.run(func() error {
		for i := range l.host {
			if err := cuErr("cuMemHostAlloc", C.cuMemHostAlloc(&l.host[i], cudaStaging, C.CU_MEMHOSTALLOC_PORTABLE)); err != nil {
				return err
			}
			l.bufs[i] = unsafe.Slice((*byte)(l.host[i]), cudaStaging)
			var err error
			if l.done[i], err = cu.MakeEvent(cu.DisableTiming); err != nil {
				return cuWrap("cuEventCreate", err)
			}
		}
		var err error
		l.stream, err = cu.MakeStream(cu.NonBlocking)
		return cuWrap("cuStreamCreate", err)
	})
	if err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

func (l *cudaLane) Buffers() *[2][]byte { return &l.bufs }

// Wait runs inside cudaDevice.run, as do the staged copies that call it.
func (l *cudaLane) Wait(i int) error {
	return cuWrap("cuEventSynchronize", l.done[i].Synchronize())
}

func (l *cudaLane) Close() error {
	return l.d.run(func() error {
		var errs []error
		for i := range l.host {
			if l.host[i] != nil {
				errs = append(errs, cuWrap("cuMemFreeHost", cu.MemFreeHost(l.host[i])))
			}
			if l.done[i] != (cu.Event{}) {
				errs = append(errs, cuWrap("cuEventDestroy", cu.DestroyEvent(&l.done[i])))
			}
		}
		if l.stream != (cu.Stream{}) {
			errs = append(errs, cuWrap("cuStreamDestroy", l.stream.Destroy()))
		}
		return errors.Join(errs...)
	})
}

// cstream is s as this package's C type.
func cstream(s cu.Stream) C.CUstream { return C.CUstream(unsafe.Pointer(s.C())) }

// Name returns "cuda:N".
func (d *cudaDevice) Name() string { return d.name }

// Backend returns "cuda".
func (d *cudaDevice) Backend() string { return "cuda" }

// Granularity returns what allocations round up to: 2 MiB
// (ipcGranularity), or the exportable memory's granularity if larger (both
// are powers of two), so that DeviceBytes counts no block short.
func (d *cudaDevice) Granularity() int64 { return max(ipcGranularity, d.granularity) }

func (d *cudaDevice) Alloc(size int64) (gpu.Block, error) {
	b, err := d.table.Alloc(size, false)
	return gpu.Block(b), err
}

func (d *cudaDevice) AllocExportable(size int64) (gpu.Block, error) {
	if d.granularity == 0 {
		return gpu.Block{}, fmt.Errorf("%w: %s has no virtual memory management with POSIX file descriptors", gpu.ErrNotExportable, d.name)
	}
	b, err := d.table.Alloc(size, true)
	return gpu.Block(b), err
}

func (d *cudaDevice) Free(b gpu.Block) error {
	d.mu.Lock()
	e, ok := d.events[b.ID]
	delete(d.events, b.ID)
	d.mu.Unlock()
	err := d.table.Free(devmem.Block(b))
	if ok {
		if derr := d.run(func() error { return cuErr("cuEventDestroy", C.cuEventDestroy(e.ev)) }); err == nil {
			err = derr
		}
	}
	return err
}

// CopyIn copies directly when src lies in memory registered by Pin (the
// helper's staging area), through a lane otherwise.
func (d *cudaDevice) CopyIn(b gpu.Block, off int64, src []byte) error {
	if d.isPinned(src) {
		return d.direct(b, off, int64(len(src)), func(dev cu.DevicePtr) error {
			return cuWrap("cuMemcpyHtoD", cu.MemcpyHtoD(dev, unsafe.Pointer(unsafe.SliceData(src)), int64(len(src))))
		}, true)
	}
	return d.upload(b, off, int64(len(src)), devmem.CopyFill(src))
}

// CopyOut copies directly when dst lies in memory registered by Pin,
// through a lane otherwise.
func (d *cudaDevice) CopyOut(b gpu.Block, off int64, dst []byte) error {
	if d.isPinned(dst) {
		return d.direct(b, off, int64(len(dst)), func(dev cu.DevicePtr) error {
			return cuWrap("cuMemcpyDtoH", cu.MemcpyDtoH(unsafe.Pointer(unsafe.SliceData(dst)), dev, int64(len(dst))))
		}, false)
	}
	return d.download(b, off, int64(len(dst)), devmem.CopyDrain(dst))
}

func (d *cudaDevice) CopyFromFile(b gpu.Block, off int64, fd int, fileOff, n int64) error {
	return d.upload(b, off, n, devmem.PreadFill(fd, fileOff))
}

func (d *cudaDevice) CopyToFile(b gpu.Block, off int64, fd int, fileOff, n int64) error {
	return d.download(b, off, n, devmem.PwriteDrain(fd, fileOff))
}

// direct runs a synchronous copy of the n bytes of b at off, given their
// device address; write says it changes the block.
func (d *cudaDevice) direct(b gpu.Block, off, n int64, xfer func(cu.DevicePtr) error, write bool) error {
	a, release, err := d.table.Acquire(devmem.Block(b), off, n)
	if err != nil {
		return err
	}
	defer release()
	if n == 0 {
		return nil
	}
	return d.run(func() error {
		if err := xfer(a.Mem.ptr + cu.DevicePtr(off)); err != nil || !write {
			return err
		}
		return d.recordWrite(b, cu.Stream{})
	})
}

// upload runs devmem.StagedUpload into the n bytes of b at off on a lane.
func (d *cudaDevice) upload(b gpu.Block, off, n int64, fill func([]byte, int64) error) error {
	a, release, err := d.table.Acquire(devmem.Block(b), off, n)
	if err != nil {
		return err
	}
	defer release()
	l, err := d.lanes.Get()
	if err != nil {
		return err
	}
	defer d.lanes.Put(l)
	cl := l.(*cudaLane)
	dev := a.Mem.ptr + cu.DevicePtr(off)
	return d.run(func() error {
		err := devmem.StagedUpload(l, n, fill, func(i int, pos int64, k int) error {
			if err := cu.MemcpyHtoDAsync(dev+cu.DevicePtr(pos), cl.host[i], int64(k), cl.stream); err != nil {
				return cuWrap("cuMemcpyHtoDAsync", err)
			}
			return cuWrap("cuEventRecord", cl.done[i].Record(cl.stream))
		})
		if err != nil {
			return err
		}
		return d.recordWrite(b, cl.stream)
	})
}

// download runs devmem.StagedDownload from the n bytes of b at off on a lane.
func (d *cudaDevice) download(b gpu.Block, off, n int64, drain func([]byte, int64) error) error {
	a, release, err := d.table.Acquire(devmem.Block(b), off, n)
	if err != nil {
		return err
	}
	defer release()
	l, err := d.lanes.Get()
	if err != nil {
		return err
	}
	defer d.lanes.Put(l)
	cl := l.(*cudaLane)
	dev := a.Mem.ptr + cu.DevicePtr(off)
	return d.run(func() error {
		return devmem.StagedDownload(l, n, func(i int, pos int64, k int) error {
			if err := cu.MemcpyDtoHAsync(cl.host[i], dev+cu.DevicePtr(pos), int64(k), cl.stream); err != nil {
				return cuWrap("cuMemcpyDtoHAsync", err)
			}
			return cuWrap("cuEventRecord", cl.done[i].Record(cl.stream))
		}, drain)
	})
}

// recordWrite records b's interprocess event, if it has one, on stream
// after a write; it runs inside run.
func (d *cudaDevice) recordWrite(b gpu.Block, stream cu.Stream) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	e, ok := d.events[b.ID]
	if !ok {
		return nil
	}
	return cuErr("cuEventRecord", C.cuEventRecord(e.ev, cstream(stream)))
}

// IPC implements Device; the event is made on the first call for a block
// and recorded after each later write to it.
func (d *cudaDevice) IPC(b gpu.Block) (gpu.IPCInfo, error) {
	a, release, err := d.table.Acquire(devmem.Block(b), 0, 0)
	if err != nil {
		return gpu.IPCInfo{}, err
	}
	defer release()
	m := a.Mem
	if m.exportable {
		return gpu.IPCInfo{}, fmt.Errorf("%w: block %d is exportable; use Export", gpu.ErrNoIPC, b.ID)
	}
	var info gpu.IPCInfo
	err = d.run(func() error {
		d.mu.Lock()
		defer d.mu.Unlock()
		if m.ipc == nil {
			var h [64]byte
			if err := cuErr("cuIpcGetMemHandle", C.tfs_ipc_mem(C.CUdeviceptr(m.ptr), unsafe.Pointer(&h[0]))); err != nil {
				return err
			}
			m.ipc = &h
		}
		info.MemHandle = *m.ipc
		e, ok := d.events[b.ID]
		if !ok {
			if err := cuErr("cuIpcGetEventHandle", C.tfs_ipc_event(&e.ev, unsafe.Pointer(&e.handle[0]))); err != nil {
				return err
			}
			// Writes so far have completed; recording now orders a
			// consumer after them all the same.
			if err := cuErr("cuEventRecord", C.cuEventRecord(e.ev, nil)); err != nil {
				C.cuEventDestroy(e.ev)
				return err
			}
			d.events[b.ID] = e
		}
		info.EventHandle = e.handle
		return nil
	})
	return info, err
}

func (d *cudaDevice) Export(b gpu.Block) (*os.File, error) {
	a, release, err := d.table.Acquire(devmem.Block(b), 0, 0)
	if err != nil {
		return nil, err
	}
	defer release()
	m := a.Mem
	if !m.exportable {
		return nil, fmt.Errorf("%w: block %d", gpu.ErrNotExportable, b.ID)
	}
	var fd C.int
	if err := d.run(func() error { return cuErr("cuMemExportToShareableHandle", C.tfs_vmm_export(m.handle, &fd)) }); err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), "cuda-export"), nil
}

func (d *cudaDevice) Stats() gpu.Stats { return gpu.Stats(d.table.Stats()) }

// Close frees every block, lane and event and releases the primary context.
func (d *cudaDevice) Close() error {
	errs := []error{d.table.Close(), d.lanes.Close()}
	d.mu.Lock()
	events := d.events
	d.events = make(map[uint64]ipcEvent)
	d.mu.Unlock()
	errs = append(errs, d.run(func() error {
		for _, e := range events {
			C.cuEventDestroy(e.ev)
		}
		return nil
	}))
	errs = append(errs, cuWrap("cuDevicePrimaryCtxRelease", d.dev.ReleasePrimaryCtx()))
	return errors.Join(errs...)
}

// Pin page-locks mem, so that CopyIn and CopyOut from and to it copy
// directly at DMA speed.
func (d *cudaDevice) Pin(mem []byte) (func() error, error) {
	p := unsafe.Pointer(unsafe.SliceData(mem))
	err := d.run(func() error {
		return cuErr("cuMemHostRegister", C.cuMemHostRegister(p, C.size_t(len(mem)), C.CU_MEMHOSTREGISTER_PORTABLE))
	})
	if err != nil {
		return nil, err
	}
	r := hostRange{uintptr(p), uintptr(p) + uintptr(len(mem))}
	d.mu.Lock()
	d.pinned = append(d.pinned, r)
	d.mu.Unlock()
	return func() error {
		d.mu.Lock()
		for i, q := range d.pinned {
			if q == r {
				d.pinned = append(d.pinned[:i], d.pinned[i+1:]...)
				break
			}
		}
		d.mu.Unlock()
		return d.run(func() error { return cuErr("cuMemHostUnregister", C.cuMemHostUnregister(p)) })
	}, nil
}

// isPinned reports whether b lies in memory registered by Pin.
func (d *cudaDevice) isPinned(b []byte) bool {
	if len(b) == 0 {
		return false
	}
	start := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	end := start + uintptr(len(b))
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, r := range d.pinned {
		if r.start <= start && end <= r.end {
			return true
		}
	}
	return false
}
