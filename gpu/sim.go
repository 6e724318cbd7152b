package gpu

import (
	"encoding/binary"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"tensorfs/fdpass"
	"tensorfs/gpu/internal/devmem"
)

// DefaultSimCapacity is the simulated device memory of NewSim with capacity
// 0, and of a sim helper process.
const DefaultSimCapacity = 16 << 30

const (
	// simGranularity is what sim allocations round up to, as the cuda
	// backend's do (2 MiB for cuMemAlloc, and the granularity of
	// exportable memory, 2 MiB on current GPUs).
	simGranularity = 2 << 20
	// simStaging is the size of each sim staging buffer: small, so that
	// copies cross many buffer boundaries.
	simStaging = 64 << 10
)

// Sim is a Device simulated on host memory, for machines without a GPU.
// It behaves as the cuda backend does: an allocation of its own for every
// block, rounded up to 2 MiB and zeroed, copies through double-buffered
// staging, IPC information with deterministic fake handles (see IPCInfo),
// and exportable blocks. Every device allocation is a memfd mapped into
// this process, so the fd from Export, or /proc/PID/fd/N named by an IPC
// handle, really shares the block's bytes. The memfd is owner-only and
// sealed against any change of size (sealedMemfd): /proc/PID/fd/N opens
// for this process's user (and root) alone, as a descriptor of another
// user's process is a CUDA handle only to its holder, and no export can
// shrink the memory under this process's mapping.
type Sim struct {
	name     string
	capacity int64
	used     int64 // device bytes allocated; newMem and freeMem update it under the table's lock
	table    *devmem.Table[*simMem]
	lanes    *devmem.Lanes
}

var _ Device = (*Sim)(nil)

// simMem is one simulated device allocation.
type simMem struct {
	fd   int
	data []byte // the memfd, mapped shared
}

// simLane is a lane whose copies run synchronously, so wait has nothing to
// wait for.
type simLane struct{ bufs [2][]byte }

func (l *simLane) Buffers() *[2][]byte { return &l.bufs }
func (l *simLane) Wait(int) error      { return nil }
func (l *simLane) Close() error        { return nil }

// NewSim returns a simulated device named "cuda:index" with capacity bytes
// of device memory (DefaultSimCapacity when capacity is 0 or less).
func NewSim(index int, capacity int64) *Sim {
	if capacity <= 0 {
		capacity = DefaultSimCapacity
	}
	s := &Sim{name: fmt.Sprintf("cuda:%d", index), capacity: capacity}
	s.table = devmem.NewTable(s.newMem, s.freeMem)
	s.lanes = devmem.NewLanes(devmem.MaxLanes, func() (devmem.Lane, error) {
		return &simLane{bufs: [2][]byte{make([]byte, simStaging), make([]byte, simStaging)}}, nil
	})
	return s
}

// newMem makes a sealed memfd (sealedMemfd) of size bytes rounded up to
// simGranularity; a new memfd reads as zeros.
func (s *Sim) newMem(size int64, _ bool) (*simMem, int64, error) {
	size = devmem.RoundUp(size, simGranularity)
	if size > s.capacity-s.used {
		return nil, 0, fmt.Errorf("%w: %d bytes asked, %d of %d free", ErrOutOfMemory, size, s.capacity-s.used, s.capacity)
	}
	fd, err := sealedMemfd("tensorfs-sim", size)
	if err != nil {
		return nil, 0, err
	}
	data, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, 0, fmt.Errorf("mmap memfd: %w", err)
	}
	s.used += size
	return &simMem{fd: fd, data: data}, size, nil
}

func (s *Sim) freeMem(m *simMem) error {
	s.used -= int64(len(m.data))
	err := unix.Munmap(m.data)
	if cerr := unix.Close(m.fd); err == nil {
		err = cerr
	}
	return err
}

// Name returns "cuda:N".
func (s *Sim) Name() string { return s.name }

// Backend returns "sim".
func (s *Sim) Backend() string { return "sim" }

// Granularity returns 2 MiB, what sim allocations round up to.
func (s *Sim) Granularity() int64 { return simGranularity }

// Alloc implements Device.
func (s *Sim) Alloc(size int64) (Block, error) {
	b, err := s.table.Alloc(size, false)
	return Block(b), err
}

// AllocExportable implements Device.
func (s *Sim) AllocExportable(size int64) (Block, error) {
	b, err := s.table.Alloc(size, true)
	return Block(b), err
}

// Free implements Device.
func (s *Sim) Free(b Block) error { return s.table.Free(devmem.Block(b)) }

// CopyIn implements Device.
func (s *Sim) CopyIn(b Block, off int64, src []byte) error {
	return s.upload(b, off, int64(len(src)), devmem.CopyFill(src))
}

// CopyOut implements Device.
func (s *Sim) CopyOut(b Block, off int64, dst []byte) error {
	return s.download(b, off, int64(len(dst)), devmem.CopyDrain(dst))
}

// CopyFromFile implements Device.
func (s *Sim) CopyFromFile(b Block, off int64, fd int, fileOff, n int64) error {
	return s.upload(b, off, n, devmem.PreadFill(fd, fileOff))
}

// CopyToFile implements Device.
func (s *Sim) CopyToFile(b Block, off int64, fd int, fileOff, n int64) error {
	return s.download(b, off, n, devmem.PwriteDrain(fd, fileOff))
}

// upload runs devmem.StagedUpload into the n bytes of b at off.
func (s *Sim) upload(b Block, off, n int64, fill func([]byte, int64) error) error {
	a, release, err := s.table.Acquire(devmem.Block(b), off, n)
	if err != nil {
		return err
	}
	defer release()
	l, err := s.lanes.Get()
	if err != nil {
		return err
	}
	defer s.lanes.Put(l)
	mem := a.Mem.data[off:]
	bufs := l.Buffers()
	return devmem.StagedUpload(l, n, fill, func(i int, pos int64, k int) error {
		copy(mem[pos:], bufs[i][:k])
		return nil
	})
}

// download runs devmem.StagedDownload from the n bytes of b at off.
func (s *Sim) download(b Block, off, n int64, drain func([]byte, int64) error) error {
	a, release, err := s.table.Acquire(devmem.Block(b), off, n)
	if err != nil {
		return err
	}
	defer release()
	l, err := s.lanes.Get()
	if err != nil {
		return err
	}
	defer s.lanes.Put(l)
	mem := a.Mem.data[off:]
	bufs := l.Buffers()
	return devmem.StagedDownload(l, n, func(i int, pos int64, k int) error {
		copy(bufs[i][:k], mem[pos:])
		return nil
	}, drain)
}

// IPC implements Device with the fake handles described at IPCInfo.
func (s *Sim) IPC(b Block) (IPCInfo, error) {
	a, release, err := s.table.Acquire(devmem.Block(b), 0, 0)
	if err != nil {
		return IPCInfo{}, err
	}
	defer release()
	if a.Exportable {
		return IPCInfo{}, fmt.Errorf("%w: block %d is exportable; use Export", ErrNoIPC, b.ID)
	}
	var info IPCInfo
	copy(info.MemHandle[:], "tensorfs-sim-mem")
	binary.LittleEndian.PutUint64(info.MemHandle[16:], b.ID)
	binary.LittleEndian.PutUint64(info.MemHandle[24:], uint64(a.Size))
	binary.LittleEndian.PutUint32(info.MemHandle[32:], uint32(os.Getpid()))
	binary.LittleEndian.PutUint32(info.MemHandle[36:], uint32(a.Mem.fd))
	copy(info.EventHandle[:], "tensorfs-sim-evt")
	binary.LittleEndian.PutUint64(info.EventHandle[16:], b.ID)
	return info, nil
}

// Export implements Device: the file is a new open file description of
// the block's memfd, opened again through /proc/self/fd and checked to be
// that memfd, never a duplicate of this process's own: a seek, a lock or
// a change of flags through one export reaches no other.
func (s *Sim) Export(b Block) (*os.File, error) {
	a, release, err := s.table.Acquire(devmem.Block(b), 0, 0)
	if err != nil {
		return nil, err
	}
	defer release()
	if !a.Exportable {
		return nil, fmt.Errorf("%w: block %d", ErrNotExportable, b.ID)
	}
	fd, err := fdpass.Reopen(a.Mem.fd, unix.O_RDWR)
	if err != nil {
		return nil, fmt.Errorf("reopen memfd: %w", err)
	}
	return os.NewFile(uintptr(fd), "tensorfs-sim-export"), nil
}

// memfdSeals are the seals of every memfd this package maps: its size
// can never change, so no holder of a descriptor, an export's included,
// can shrink it under a mapping (a touch past the end would be SIGBUS),
// nor grow it, nor add or remove a seal.
const memfdSeals = unix.F_SEAL_GROW | unix.F_SEAL_SHRINK | unix.F_SEAL_SEAL

// sealedMemfd returns a new memfd of size bytes, zeroed, owner-only (0600:
// the link /proc/PID/fd/N of a descriptor given out opens it for no one
// else) and sealed with memfdSeals.
func sealedMemfd(name string, size int64) (int, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("ftruncate memfd: %w", err)
	}
	if err := unix.Fchmod(fd, 0o600); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("fchmod memfd: %w", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, memfdSeals); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("seal memfd: %w", err)
	}
	return fd, nil
}

// Stats implements Device.
func (s *Sim) Stats() Stats { return Stats(s.table.Stats()) }

// Close frees every block. Later calls fail with ErrUnavailable.
func (s *Sim) Close() error {
	err := s.table.Close()
	if lerr := s.lanes.Close(); err == nil {
		err = lerr
	}
	return err
}
