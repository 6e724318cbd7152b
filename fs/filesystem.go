package fs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/gpu"
	"tensorfs/ledger"
	"tensorfs/procfs"
)

// filesystem is the state shared by all nodes of one mount.
type filesystem struct {
	// usageWalks: a uid's walks of whole subtrees (rbytes, rsegments,
	// the root's stats, user.tensorfs.cluster) run one at a time, so that one user asking from
	// many threads takes one CPU's worth of walking, not every CPU.
	usageWalks oneAtATime

	store *alloc.Store
	log   *slog.Logger
	root  *rootNode
	// stored caches the attributes of host segments no node caches.
	stored storedAttrs
	// socket is the control socket's path, "" if none.
	socket string
	// allowOther is true when users other than the daemon's may enter.
	allowOther bool
	// gpu serves device segments; nil when the mount has no GPU.
	gpu *devices
	// unrestored holds the device segments this mount could not bring
	// into device memory (no GPU, or a failed restore), with why.
	unrestored inoErrors
	// pulled holds the segments of published directories (pulled kind).
	pulled pulledSet
	// cl is the mount's membership of a cluster; nil without --cluster.
	cl *clusterFS
	// passthrough is true once opens are answered with FOPEN_PASSTHROUGH;
	// it is decided after the kernel serves the mount.
	passthrough atomic.Bool
	// gate is the mount's handover gate once it serves, where the kernel
	// resends requests a daemon left unanswered (FUSE 7.40): a request
	// that waits for what may take long (an open for a pull) leaves it
	// meanwhile (parked), so that a handover need not wait for it.
	gate     atomic.Pointer[gateFS]
	requests counters
	started  time.Time
	// imports holds the imported (FROMFD) segments.
	imports imports
	// ledger charges what requests make the daemon hold to their uids
	// (package ledger): the rows below, the control socket's and the
	// cluster's.
	ledger *ledger.Ledger
	// handles bounds the descriptors open segments, imports and watches
	// keep, per uid; pidfds included.
	handles *ledger.Row
	// inodes charges the backing's objects to their owners.
	inodes *inodes
	// orphans are the segments open in no directory, for a successor.
	orphans orphans
	// threads bounds, per uid, the goroutines that may block in the
	// kernel on a request's behalf (fsMagic's).
	threads *ledger.Row
	// sharedPaths serialises the paths SHARED segments' disk files record
	// (at create) with the renames that change them (with --disk only);
	// no other lock is taken while it is held.
	sharedPaths sync.Mutex
	// unlinked gathers the UNLINK segments to remove into shared walks.
	unlinked unlinkBatch
	// dirs bounds the directory descriptors the daemon keeps.
	dirs *dirFds
	// tgidsMu protects tgids, the process of each thread that opened a
	// segment; thread ids are not reused before the pid space wraps.
	tgidsMu sync.Mutex
	tgids   map[uint32]uint32
	// fuseDev is the mount's device number, which mappings through it
	// carry, and oldDevs those of earlier mounts of the backing that
	// processes still map; maps knows who maps what; watches wait for the
	// last mapping of UNLINK segments (mappings.go), on pidfds they share.
	fuseDev atomic.Uint64
	oldDevs []uint64
	maps    mapTable
	watches watchSet
	pidfds  pidfds
	// reclaims counts the UNLINK reclaims running, so that close waits.
	reclaims sync.WaitGroup
}

// newFilesystem makes the state of a mount of opts.Store and its root
// node, as Mount and the unit tests share it. It owns opts.GPU and the
// device files recovery found from then on: close releases them, and so
// does a failed call.
func newFilesystem(opts Options) (_ *filesystem, err error) {
	fsys := &filesystem{
		store:      opts.Store,
		log:        opts.Log,
		socket:     opts.Socket,
		allowOther: opts.AllowOther,
		started:    time.Now(),
		tgids:      map[uint32]uint32{},
		ledger:     ledger.New(),
		dirs:       newDirFds(defaultDirFds),
	}
	fsys.handles = newHandleBudget(fsys.ledger)
	fsys.threads = newThreadBudget(fsys.ledger)
	fsys.inodes = newInodes(fsys.ledger, opts.Store.RootFd)
	fsys.imports.held = fsys.handles
	if fsys.log == nil {
		fsys.log = slog.New(slog.DiscardHandler)
	}
	for _, b := range []*ledger.Row{fsys.handles, fsys.threads, fsys.inodes.row} {
		s := b.Spec()
		fsys.log.Info(s.Name+" held for requests: limits", "per_uid", s.PerUID, "total", s.Total, "root_reserve", b.Reserve())
	}
	if err := fsys.inodes.countBacking(opts.Store.RootFd); err != nil {
		fsys.log.Error("the backing's objects could not all be counted; the owner of the directory the count could not finish is charged her whole share of inodes until the next mount", "err", err)
	}
	rec := opts.Recovered
	if rec == nil {
		rec = &Recovered{}
	}
	fsys.oldDevs = rec.devs
	fsys.pulled.fsys, fsys.pulled.fds.root = fsys, opts.Store.RootFd
	fsys.pulled.restore(rec.pulled, opts.Cluster != nil)
	if opts.GPU != nil && opts.GPU.Backend() != "none" {
		if fsys.gpu, err = newDevices(opts.GPU, opts.Store, fsys.ledger, fsys.handles, opts.Mountpoint, rec.devices, opts.Takeover != nil, fsys.log); err != nil {
			opts.GPU.Close()
			closeFiles(rec.devices)
			return nil, fmt.Errorf("GPU segments: %w", err)
		}
	} else {
		why := fmt.Errorf("%w: this device segment needs a mount with --gpu; its bytes are kept for one", alloc.ErrNoDevice)
		if opts.GPU != nil {
			// A takeover's helper that died: its device memory is gone.
			why = fmt.Errorf("%w: the GPU helper that held this device segment's memory is gone", gpu.ErrUnavailable)
			opts.GPU.Close()
		}
		fsys.unrestore(rec.devices, why)
	}
	fd, err := unix.FcntlInt(uintptr(opts.Store.RootFd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		fsys.close()
		return nil, err
	}
	fsys.root = &rootNode{*fsys.newDir()}
	fsys.dirs.pin(&fsys.root.dirNode, fd)
	return fsys, nil
}

// close ends what the mount runs: watches, reclaims, the device (its
// segments spilled into their backing files for the next mount) and the
// directories' descriptors. Call it once the kernel serves the mount no
// more.
func (fsys *filesystem) close() {
	fsys.watches.close()
	fsys.reclaims.Wait()
	if fsys.gpu != nil {
		fsys.gpu.spill()
	}
	fsys.dirs.closeIdle()
	if fsys.root != nil {
		unix.Close(fsys.root.fd)
	}
}

// unrestore marks the device segments whose backing files are files as
// unavailable for why, and closes the files.
func (fsys *filesystem) unrestore(files []*os.File, why error) {
	for _, f := range files {
		var st unix.Stat_t
		if unix.Fstat(int(f.Fd()), &st) == nil {
			fsys.unrestored.add(st.Ino, why)
		}
		f.Close()
	}
}

func closeFiles(fs []*os.File) {
	for _, f := range fs {
		f.Close()
	}
}

func (fsys *filesystem) mode() string {
	if fsys.passthrough.Load() {
		return "passthrough"
	}
	return "classic"
}

// backingFlags turns the flags of a FUSE open into those of the backing
// open, and says whether the handle is passthrough. In passthrough mode
// the kernel shares one backing file among all opens of a segment, so it
// is opened read-write without O_APPEND or O_DIRECT, which the kernel
// applies per open itself. A handle adopted from an earlier daemon
// (openAdopted) is never passthrough: the kernel's inode uses the
// backing file that daemon registered, and the handle is opened again
// only to be counted, with the access it was opened with.
func (fsys *filesystem) backingFlags(flags uint32) (int, bool) {
	if fsys.passthrough.Load() && flags&openAdopted == 0 {
		return unix.O_RDWR | unix.O_CLOEXEC, true
	}
	keep := unix.O_ACCMODE | unix.O_APPEND | unix.O_DIRECT | unix.O_SYNC | unix.O_DSYNC | unix.O_NOATIME
	return int(flags)&keep | unix.O_CLOEXEC, false
}

// errno is the one reply-and-log policy of the FUSE side: it maps err for
// the reply to op on n (name: the entry the request names, if any) and
// logs it. A request refused for a reason (permissions, flags, a bad
// value, capacity) is logged once at Info with the reason; a name or
// attribute that is absent, or a buffer too small for a value (ERANGE:
// the caller asks again with the size), is an answer, not a refusal, and
// is not logged; an error no rule knows is logged at Error and answered EIO.
func (fsys *filesystem) errno(op string, n *nodeBase, name string, err error) syscall.Errno {
	if err == nil {
		return 0
	}
	errno, known := mapErrno(err)
	if name != "" {
		err = fmt.Errorf("%s: %w", alloc.EscapeText(name), err)
	}
	switch {
	case !known:
		fsys.log.Error("unexpected error, answered EIO", "op", op, "path", alloc.EscapeText(n.path()), "err", err)
	case errno == syscall.ENOENT, errno == syscall.ENODATA, errno == syscall.ERANGE, errno == syscall.EEXIST && op == "create":
	default:
		fsys.log.Info("refused", "op", op, "path", alloc.EscapeText(n.path()), "err", err)
	}
	return errno
}

// errnoOf is errno for requests that name no entry.
func (fsys *filesystem) errnoOf(op string, n *nodeBase, err error) syscall.Errno {
	return fsys.errno(op, n, "", err)
}

// owner returns who a new backing object made in dirfd must belong to:
// the caller that created it, with the directory's group if it is
// set-group-ID. ok is false when the daemon is not root and the kernel
// made it the caller's already.
func (fsys *filesystem) owner(ctx context.Context, dirfd int) (uid, gid int, ok bool) {
	if os.Geteuid() != 0 {
		return 0, 0, false
	}
	c := caller(ctx)
	gid = int(c.Gid)
	var parent unix.Stat_t
	if err := unix.Fstat(dirfd, &parent); err == nil && parent.Mode&unix.S_ISGID != 0 {
		gid = int(parent.Gid)
	}
	return int(c.Uid), gid, true
}

// processOf returns the process (thread group) of a thread: FUSE names
// the calling thread, holders are processes.
func (fsys *filesystem) processOf(tid uint32) uint32 {
	fsys.tgidsMu.Lock()
	pid, ok := fsys.tgids[tid]
	fsys.tgidsMu.Unlock()
	if ok {
		return pid
	}
	pid = readTgid(tid)
	fsys.tgidsMu.Lock()
	if len(fsys.tgids) >= maxTgids {
		fsys.tgids = map[uint32]uint32{}
	}
	fsys.tgids[tid] = pid
	fsys.tgidsMu.Unlock()
	return pid
}

// maxTgids bounds the thread to process cache; it starts over when full.
const maxTgids = 1 << 16

// readTgid reads a thread's process from /proc.
func readTgid(tid uint32) uint32 {
	st, err := procfs.ReadStatus(int(tid))
	if err != nil {
		return tid
	}
	return uint32(st.Tgid)
}

// reclaimLater removes an UNLINK segment that no one holds any more, now
// that uid released its last handle. The removal runs outside the request
// that released the handle, since it notifies the kernel; other segments
// cost only a cached flag check.
func (fsys *filesystem) reclaimLater(n *segmentNode, uid uint32) {
	if n.orphan.Load() {
		fsys.orphaned(n)
		return
	}
	if f, err := n.flags(n); err == nil && f&alloc.Unlink != 0 {
		fsys.reclaims.Add(1)
		go func() {
			defer fsys.reclaims.Done()
			fsys.reclaim(n, uid)
		}()
	}
}

// orphaned gives back the inode of segment n, whose last name went, once
// no handle holds it: until then tmpfs keeps the inode, and so does its
// charge. No scan of the processes' mappings runs here (an unlink is a
// hot path): a mapping that outlives its close, or a descriptor that
// export or load handed out, holds the inode unseen, bounded by its
// holder's mappings and open-file limit, as on tmpfs.
func (fsys *filesystem) orphaned(n *segmentNode) {
	if len(n.openHandles()) == 0 {
		fsys.orphans.drop(n)
		fsys.inodes.gone(n.StableAttr().Ino)
	}
}

// reclaim removes n's names if it is an UNLINK segment without holders;
// while processes still map it, a watch charged to uid waits for the last
// mapping.
func (fsys *filesystem) reclaim(n *segmentNode, uid uint32) {
	ino := n.StableAttr().Ino
	if len(n.openHandles()) > 0 {
		return
	}
	if mapped, _ := fsys.watchMapped(n, uid, func() { fsys.removeUnlinked(ino) }); mapped {
		return // kept while mapped, even unwatched: fail safe
	}
	for {
		name, parent := n.Parent()
		if parent == nil {
			return
		}
		fsys.imports.handing.RLock() // an import's end waits out a handover
		err := dirOf(parent).withDir(func(fd int) error {
			var st unix.Stat_t
			if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil || st.Ino != n.StableAttr().Ino {
				return syscall.ENOENT
			}
			if err := unix.Unlinkat(fd, name, 0); err != nil {
				return err
			}
			if st.Nlink == 1 {
				return n.storage().release()
			}
			return nil
		})
		fsys.imports.handing.RUnlock()
		parent.RmChild(name)
		parent.NotifyDelete(name, n.EmbeddedInode())
		if err == nil {
			fsys.log.Info("removed UNLINK segment without holders", "name", alloc.EscapeText(name))
		}
	}
}

// notifyNewName tells the kernel that path (relative to the root) now
// exists, so that a cached "no such name" for it goes. A directory the
// kernel has not looked up has nothing cached.
func (fsys *filesystem) notifyNewName(path string) {
	dir := fsys.root.EmbeddedInode()
	parts := strings.Split(filepath.Clean(path), "/")
	for _, part := range parts[:len(parts)-1] {
		if dir = dir.GetChild(part); dir == nil {
			return
		}
	}
	dir.NotifyEntry(parts[len(parts)-1])
}

// stats is the root's user.tensorfs.stats as uid reads it. Its walk of
// the backing is uid's (subtreeUsage); a refused one is an error.
func (fsys *filesystem) stats(uid uint32) (map[string]any, error) {
	var sfs unix.Statfs_t
	fsys.store.Statfs(&sfs)
	segs, bytes, err := fsys.subtreeUsage(fsys.store.RootFd, uid, nil)
	if err != nil && !errors.Is(err, alloc.ErrTooDeep) { // too deep: what the walk reached
		return nil, err
	}
	var ru unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &ru)
	rss, peak := memoryUse()
	return map[string]any{
		"mode":       fsys.mode(),
		"huge_pages": fsys.store.HugePages,
		"segments":   segs,
		"bytes":      bytes,
		"capacity":   int64(sfs.Blocks) * sfs.Bsize,
		"used":       int64(sfs.Blocks-sfs.Bfree) * sfs.Bsize,
		"backing":    fsys.store.Dir,
		"limbo":      fsys.limboStats(),
		"gpu":        fsys.gpuStats(),
		"requests":   fsys.requests.snapshot(),
		"dir_fds":    fsys.dirs.stats(),
		"cluster":    fsys.clusterStats(),
		"ledger":     ledgerFor(fsys.ledger.Usage(), uid),
		"daemon":     map[string]any{"pid": os.Getpid(), "cpu_seconds": cpuSeconds(&ru), "rss_bytes": rss, "max_rss_bytes": peak, "goroutines": runtime.NumGoroutine()},
		"uptime_ns":  strconv.FormatInt(int64(time.Since(fsys.started)), 10),
	}, nil
}

// limboStats counts the device blocks waiting for their consumers, and
// how many times collections found a block still referenced ("kept").
func (fsys *filesystem) limboStats() map[string]int64 {
	if fsys.gpu == nil {
		return map[string]int64{"blocks": 0, "bytes": 0, "kept": 0}
	}
	blocks, bytes := fsys.gpu.limbo.Stats()
	return map[string]int64{"blocks": int64(blocks), "bytes": bytes, "kept": fsys.gpu.limbo.Kept()}
}

// gpuStats describes the device behind device segments.
func (fsys *filesystem) gpuStats() map[string]any {
	if fsys.gpu == nil {
		return map[string]any{"backend": "none"}
	}
	return map[string]any{"backend": fsys.gpu.dev.Backend(), "device": fsys.gpu.dev.Name(), "memory": fsys.gpu.dev.Stats()}
}

// memoryUse reads the daemon's resident set and its peak from
// /proc/self/status (getrusage's peak includes the parent's before exec).
func memoryUse() (rss, peak int64) {
	st, _ := procfs.ReadStatus(os.Getpid())
	return st.VmRSS, st.VmHWM
}

func cpuSeconds(ru *unix.Rusage) float64 {
	return float64(ru.Utime.Sec+ru.Stime.Sec) + float64(ru.Utime.Usec+ru.Stime.Usec)/1e6
}

// ledgerFor is the ledger's rows as uid may see them: root sees what each
// uid holds; any other user what it holds itself, as "by_uid" with its
// uid alone, and the totals, which name no one.
func ledgerFor(rows []ledger.Usage, uid uint32) []ledger.Usage {
	if uid == 0 {
		return rows
	}
	for i, r := range rows {
		rows[i].ByUID = nil
		if n := r.ByUID[uid]; n != 0 {
			rows[i].ByUID = map[uint32]int64{uid: n}
		}
	}
	return rows
}
