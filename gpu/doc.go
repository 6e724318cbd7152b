// Package gpu is tensorfs's device memory: GPU segments live in blocks of
// a Device (DESIGN.md §6). It knows nothing of FUSE and returns Go errors,
// the sentinel ones from errors.go where a caller must tell them apart.
//
// # Backends
//
// A Device has three backends behind one interface:
//
//   - cuda: a real GPU through gorgonia.org/cu plus small cgo shims for
//     what cu lacks (IPC handles, interprocess events, pinned host memory,
//     virtual memory management), in package gpu/cuda. Built with -tags
//     cuda and imported only by the helper command gpu/cmd/tensorfs-gpu,
//     so that no build of the daemon links libcuda, tag or no tag;
//     scripts/cuda-sdk.sh fetches the headers and link stub to build and
//     vet it without a GPU.
//   - sim: NewSim, device memory simulated on host memory with the same
//     behaviour, so that every path is tested on machines without a GPU.
//   - none: Unavailable, no device at all (`--gpu none`).
//
// sim and cuda share their block table and staging lanes
// (gpu/internal/devmem).
//
// Every block has a device allocation of its own, rounded up to 2 MiB and
// zeroed: an IPC handle maps a whole allocation, so a handle given out for
// one segment must reach nothing else (DESIGN.md §4). Small blocks are not
// pooled for that reason. Copies go through pinned staging buffers, two
// per copy, double-buffered so that host reads and writes overlap device
// copies.
//
// # The helper process
//
// The daemon never talks to CUDA itself. Start runs the backend in a
// helper process and returns a Device that forwards each call over a
// socket (HelperMain is the helper's side; proto.go describes
// the protocol). A CUDA failure, even one that kills the process, costs
// the helper and the device memory it held, never the daemon: calls then
// fail with ErrUnavailable, whose text ends with the helper's last line of
// output, and host segments go on. Start again for a new helper; blocks of
// the old one are gone.
//
// A helper outlives its daemon while its door is held (Door; the keeper
// holds a duplicate, and of the helper's pidfd): a successor opens a
// session of its own (Attach: a helper that does not answer it within a
// control call's deadline is killed through the pidfd, and gone, before
// Attach returns),
// claims the helper (Survivor.Claim: the other sessions' calls are refused
// once those in flight are answered), finds its segments' blocks by the
// tags its predecessor gave them (Survivor.Tag), and ends the other
// sessions once it serves (Survivor.Settle). See DESIGN.md §12.
//
// A helper that hangs cannot wedge the daemon either: every call has a
// deadline, 10 s for a control call (Alloc, AllocExportable, Free, IPC,
// Export, Stats) and 10 s plus 1 s per 16 MiB for a copy (10.25 s for a
// 4 MiB round trip through staging, 74 s for 1 GiB). At most
// devmem.MaxLanes copies are in flight, one per lane of the helper, so a
// copy's deadline measures its own work. A call unanswered at its
// deadline is taken for a hung driver: the daemon kills the helper
// (SIGKILL to its process group, or through its pidfd if a predecessor
// started it), logs one error line naming the call and
// its wait, and that call, every call in flight and every later one fail
// with ErrUnavailable, saying that GPU segments are off. Host segments go
// on. The environment variable SimStallEnv makes a sim helper stall, for
// tests of this only.
//
// gorgonia.org/cu's init calls cuInit and exits the process when that
// fails, in every process that links it. So the cuda helper is a binary
// of its own (gpu/cmd/tensorfs-gpu, calling HelperMain with cuda.Open),
// passed to Start as exe; the daemon never imports gpu/cuda. A helper that
// cannot initialise CUDA exits before it serves, and Start reports why.
//
// The daemon's side, with the cmd wiring `tensorfs gpu-helper ARGS` to
// HelperMain(ARGS, stderr, nil) for sim:
//
//	dev, err := gpu.Start(exe, backend, 0, log) // backend from --gpu
//	if err != nil {
//		log.Warn("GPU segments are off", "err", err) // one line: why
//		dev = gpu.Unavailable(err)
//	}
//	defer dev.Close()
//
// where exe is the daemon's own executable for sim, and a tensorfs-gpu
// built with -tags cuda for cuda.
//
// # Sharing with consumers
//
// A consumer opens a block with its own CUDA stack from IPC (or Export
// for a block from AllocExportable) while it holds the segment's file open
// or a reference counter (a Counter of a CounterDir: one 8-byte file per
// segment, the daemon's, which a POSIX ACL opens to exactly those who may
// read the segment; as root, on a tmpfs of its own of 64 MiB). Blocks
// whose segment was unlinked or shrunk while referenced wait in a Limbo
// until Collect finds them unreferenced, as PyTorch's CudaIPCSentDataLimbo
// does. Collects run one at a time, and one that arrives during another
// waits for it: a block unreferenced when Collect is called has left the
// limbo when it returns.
//
// # Caveats
//
// Free a block only when no consumer can still reach it: its device memory
// may be handed out again at once, to another segment. A Device's Block
// values mean nothing to another Device, nor to a new helper (a session
// attached to the same helper shares them).
//
// A copy from or to a file counts the file's time too: a file copy that
// stalls on its file (a descriptor of a hung filesystem) past the deadline
// takes the helper down like a hung driver.
//
// A legacy CUDA IPC mapping (cuIpcOpenMemHandle) is always read-write:
// whoever may read a segment and has its handle can also write its device
// memory. And the counters are a contract among a segment's readers: one
// of them can drop the counter while another still uses the memory.
package gpu
