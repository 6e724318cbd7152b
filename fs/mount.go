// Package fs is tensorfs's FUSE front end: the only package that imports
// go-fuse. It translates FUSE requests into operations on the backing
// store of package alloc and maps their errors to errnos (toErrno).
//
// Data never passes through the daemon in passthrough mode: opens hand
// the kernel a backing descriptor (FOPEN_PASSTHROUGH) and read, write and
// mmap run against the backing tmpfs file. Without passthrough the daemon
// serves read and write from the same descriptor.
//
// The daemon must never mmap a file of its own mount (go-fuse's
// documented deadlock); tests do that from child processes.
package fs

import (
	"context"
	"fmt"
	"log"
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

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ctl"
	"tensorfs/gpu"
)

// Options configures a mount.
type Options struct {
	// Mountpoint is the absolute path to mount at.
	Mountpoint string
	// Store holds the segments.
	Store *alloc.Store
	// NoPassthrough forces the daemon to serve read and write itself.
	NoPassthrough bool
	// AllowOther lets other users in; the kernel checks permissions.
	AllowOther bool
	// Debug logs every FUSE request.
	Debug bool
	// Log receives refusals and events.
	Log *slog.Logger
	// Socket is the path of the control socket; "" for none.
	Socket string
	// GPU serves device segments; nil for none.
	GPU gpu.Device
	// Recovered is what Recover found mapped; nil for nothing.
	Recovered *Recovered
	// Purge is called when the daemon's user or root asks over the
	// control socket for the backing to be purged when the daemon exits
	// (ctl.Config.Purge); nil refuses.
	Purge func() error
}

// Server is a mounted tensorfs.
type Server struct {
	*fuse.Server
	fs  *filesystem
	ctl *ctl.Server
}

// Close stops the control socket and spills device segments into their
// backing files for the next mount; call it once the mount is gone.
func (s *Server) Close() error {
	s.fs.watches.close()
	if s.fs.gpu != nil {
		s.fs.gpu.spill()
	}
	if s.ctl == nil {
		return nil
	}
	return s.ctl.Close()
}

// Mode says how data is served: "passthrough" or "classic".
func (s *Server) Mode() string { return s.fs.mode() }

// filesystem is the state shared by all nodes of one mount.
type filesystem struct {
	store *alloc.Store
	log   *slog.Logger
	root  *node
	// socket is the control socket's path, "" if none.
	socket string
	// allowOther is true when users other than the daemon's may enter.
	allowOther bool
	// gpu serves device segments; nil when the mount has no GPU.
	gpu *devices
	// passthrough is true when opens are answered with FOPEN_PASSTHROUGH.
	passthrough bool
	requests    counters
	started     time.Time
	// imports holds the descriptors of imported (FROMFD) segments.
	imports imports
	// handles bounds the descriptors open segments keep, per uid.
	handles *handleBudget
	// tgidsMu protects tgids, the process of each thread that opened a
	// segment; thread ids are not reused before the pid space wraps.
	tgidsMu sync.Mutex
	tgids   map[uint32]uint32
	// fuseDev is the mount's device number, which mappings through it
	// carry, and oldDevs those of earlier mounts of the backing that
	// processes still map; maps knows who maps what; watches wait for the
	// last mapping of UNLINK segments (mappings.go).
	fuseDev atomic.Uint64
	oldDevs []uint64
	maps    mapTable
	watches watchSet
}

func (fsys *filesystem) mode() string {
	if fsys.passthrough {
		return "passthrough"
	}
	return "classic"
}

// maxRequest is the largest read or write request the kernel sends.
const maxRequest = 1<<20 - 8192

// Mount mounts tensorfs at opts.Mountpoint and returns once the kernel
// serves it. It owns opts.GPU from then on: Server.Close releases it, and
// so does a failed Mount, with everything else it acquired.
func Mount(opts Options) (_ *Server, err error) {
	fsys := &filesystem{
		store:      opts.Store,
		log:        opts.Log,
		socket:     opts.Socket,
		allowOther: opts.AllowOther,
		started:    time.Now(),
		tgids:      map[uint32]uint32{},
		handles:    newHandleBudget(),
	}
	root := fsys.newNode(syscall.S_IFDIR, nil)
	defer func() {
		if err == nil {
			return
		}
		switch {
		case fsys.gpu != nil:
			fsys.gpu.spill() // restored segments go back to their backing files
		case opts.GPU != nil:
			opts.GPU.Close()
		}
		if root.dir.fd >= 0 {
			unix.Close(root.dir.fd)
		}
	}()
	if opts.Recovered != nil {
		fsys.oldDevs = opts.Recovered.devs
	}
	if opts.GPU != nil && opts.GPU.Backend() != "none" {
		if fsys.gpu, err = newDevices(opts.GPU, opts.Store, opts.Mountpoint, opts.Log); err != nil {
			return nil, fmt.Errorf("GPU segments: %w", err)
		}
	}
	if root.dir.fd, err = unix.FcntlInt(uintptr(opts.Store.RootFd), unix.F_DUPFD_CLOEXEC, 0); err != nil {
		return nil, err
	}
	fsys.root = root

	// Kernel caching: entries, absent names and attributes are kept one
	// second. Every change made through the mount updates the kernel's
	// copy, and the daemon tells the kernel of the names it adds
	// (imports) or removes (UNLINK) itself.
	timeout := time.Second
	fopts := &fusefs.Options{
		EntryTimeout:    &timeout,
		AttrTimeout:     &timeout,
		NegativeTimeout: &timeout,
		// Modes are exactly what the caller asked for: the kernel has
		// applied the caller's umask; ours (0) must not apply twice.
		NullPermissions: true,
		Logger:          log.New(os.Stderr, "go-fuse: ", 0),
		MountOptions: fuse.MountOptions{
			FsName: "tensorfs",
			Name:   "tensorfs",
			// Permissions are always checked by the kernel.
			Options:    []string{"default_permissions"},
			AllowOther: opts.AllowOther,
			// As root, mount(2) directly; otherwise fusermount3.
			DirectMount: os.Geteuid() == 0,
			// Large requests keep the classic path fast; two pages under
			// 1 MiB so that a read, its reply header and go-fuse's spare
			// page fit the largest pipe (pipe-max-size, 1 MiB) and splice.
			MaxWrite:     maxRequest,
			MaxReadAhead: maxRequest,
			// Record locks are not negotiated: a mount is one machine's,
			// and the kernel keeps them itself exactly as on tmpfs (POSIX
			// locks per process, gone with any close or exit; flock per
			// open file; F_GETLK names the holder; F_SETLKW interruptible),
			// so close() needs no FLUSH either (FOPEN_NOFLUSH).
			EnableLocks: false,
			// O_TRUNC arrives with OPEN rather than as a separate
			// SETATTR, so an EXCLUSIVE directory can refuse it.
			// HANDLE_KILLPRIV_V2 spares every write(2) a GETXATTR of
			// security.capability (FUSE superblocks are not SB_NOSEC) and
			// hands clearing set-id bits to the daemon, which never sees a
			// passthrough write: it clears them when a user other than
			// root opens a segment for writing (dropSetid), and on a
			// truncate the kernel marks FATTR_KILL_SUIDGID. READDIRPLUS_AUTO
			// lets the kernel ask for attributes with a listing only when
			// the lister also stats the entries (ls -l, not os.listdir).
			ExtraCapabilities: fuse.CAP_ATOMIC_O_TRUNC | fuse.CAP_HANDLE_KILLPRIV_V2 | fuse.CAP_READDIRPLUS_AUTO,
			// Symbolic links never change; the kernel may keep them.
			EnableSymlinkCaching: true,
			Debug:                opts.Debug,
			DisableXAttrs:        false,
		},
	}
	if opts.Debug {
		fopts.Logger = log.New(os.Stderr, "go-fuse: ", log.Lmicroseconds)
	}
	bridge := fusefs.NewNodeFS(root, fopts)
	srv, err := fuse.NewServer(&countingFS{RawFileSystem: bridge, c: &fsys.requests}, opts.Mountpoint, &fopts.MountOptions)
	if err != nil {
		return nil, fmt.Errorf("mount %s: %w", opts.Mountpoint, err)
	}
	go srv.Serve()
	if err := srv.WaitMount(); err != nil {
		srv.Unmount()
		return nil, err
	}
	widenReadahead(opts.Mountpoint, fsys.log)
	if !opts.NoPassthrough {
		if err := probePassthrough(srv, opts.Store.RootFd); err != nil {
			fsys.log.Warn("FUSE passthrough unavailable, the daemon serves read and write itself", "why", err)
		} else {
			fsys.passthrough = true
		}
	}
	fsys.afterMount(opts.Mountpoint, opts.Recovered)
	s := &Server{Server: srv, fs: fsys}
	if opts.Socket != "" {
		s.ctl, err = ctl.Listen(ctl.Config{Path: opts.Socket, Backend: controlBackend{fsys}, Errno: toErrno, Log: opts.Log, Private: !opts.AllowOther, Owner: uint32(os.Geteuid()), Purge: opts.Purge})
		if err != nil {
			srv.Unmount()
			return nil, fmt.Errorf("control socket: %w", err)
		}
	}
	return s, nil
}

// widenReadahead lets the kernel read ahead as much as one request holds
// (the default window is 128 KiB), so that the classic path serves few,
// large READs. It needs root; without, the default stays.
func widenReadahead(mountpoint string, log *slog.Logger) {
	var st unix.Stat_t
	if err := unix.Stat(mountpoint, &st); err != nil {
		return
	}
	p := fmt.Sprintf("/sys/class/bdi/%d:%d/read_ahead_kb", unix.Major(st.Dev), unix.Minor(st.Dev))
	if err := os.WriteFile(p, []byte(strconv.Itoa(maxRequest/1024)), 0); err != nil {
		log.Debug("readahead window left at the kernel's default", "err", err)
	}
}

// probePassthrough checks that the kernel accepts backing files from
// this daemon: it must offer FUSE passthrough and let us register one
// (root, CAP_SYS_ADMIN in the initial namespace).
func probePassthrough(srv *fuse.Server, dirfd int) error {
	if srv.KernelSettings().Flags64()&fuse.CAP_PASSTHROUGH == 0 {
		return fmt.Errorf("the kernel does not offer FUSE passthrough")
	}
	fd, err := unix.Openat(dirfd, ".", unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("probe file: %w", err)
	}
	defer unix.Close(fd)
	id, errno := srv.RegisterBackingFd(&fuse.BackingMap{Fd: int32(fd)})
	if errno != 0 {
		return fmt.Errorf("registering a backing file: %w (passthrough needs root)", errno)
	}
	srv.UnregisterBackingFd(id)
	return nil
}

// errno logs a refusal with its reason and returns the errno for it.
func (fsys *filesystem) errno(op string, n *node, name string, err error) syscall.Errno {
	if err == nil {
		return 0
	}
	if name != "" {
		err = fmt.Errorf("%s: %w", name, err)
	}
	fsys.refuse(op, n, err)
	return toErrno(err)
}

// refuse logs why a request was refused. Plain absence is not worth a line.
func (fsys *filesystem) refuse(op string, n *node, err error) {
	if e := toErrno(err); e == syscall.ENOENT || e == syscall.EEXIST && op == "create" {
		return
	}
	fsys.log.Info("refused", "op", op, "path", n.Path(nil), "err", err)
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

// reclaimLater removes an UNLINK segment that no one holds any more. The
// removal runs outside the request that released the handle, since it
// notifies the kernel; other segments cost only a cached flag check.
func (fsys *filesystem) reclaimLater(n *node) {
	if f, err := n.flags(); err == nil && f&alloc.Unlink != 0 {
		go fsys.reclaim(n)
	}
}

// reclaim removes n's names if it is an UNLINK segment without holders;
// while processes still map it, a watch waits for the last mapping.
func (fsys *filesystem) reclaim(n *node) {
	if len(n.openHandles()) > 0 || fsys.watchMapped(n) {
		return
	}
	for {
		name, parent := n.Parent()
		if parent == nil {
			return
		}
		err := parent.Operations().(*node).withDir(func(fd int) error {
			var st unix.Stat_t
			if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil || st.Ino != n.StableAttr().Ino {
				return syscall.ENOENT
			}
			r := fsys.lastLinkRedirect(fd, name)
			if err := unix.Unlinkat(fd, name, 0); err != nil {
				return err
			}
			return fsys.release(r)
		})
		parent.RmChild(name)
		parent.NotifyDelete(name, n.EmbeddedInode())
		if err == nil {
			fsys.log.Info("removed UNLINK segment without holders", "name", name)
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

// stats is the root's user.tensorfs.stats.
func (fsys *filesystem) stats() map[string]any {
	var sfs unix.Statfs_t
	fsys.store.Statfs(&sfs)
	segs, bytes := fsys.subtreeUsage(fsys.store.RootFd)
	var ru unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &ru)
	rss, peak := memoryUse()
	return map[string]any{
		"mode":      fsys.mode(),
		"segments":  segs,
		"bytes":     bytes,
		"capacity":  int64(sfs.Blocks) * sfs.Bsize,
		"used":      int64(sfs.Blocks-sfs.Bfree) * sfs.Bsize,
		"backing":   fsys.store.Dir,
		"limbo":     fsys.limboStats(),
		"gpu":       fsys.gpuStats(),
		"requests":  fsys.requests.snapshot(),
		"daemon":    map[string]any{"pid": os.Getpid(), "cpu_seconds": cpuSeconds(&ru), "rss_bytes": rss, "max_rss_bytes": peak, "goroutines": runtime.NumGoroutine()},
		"uptime_ns": strconv.FormatInt(int64(time.Since(fsys.started)), 10),
	}
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
	b, _ := os.ReadFile("/proc/self/status")
	for _, line := range strings.Split(string(b), "\n") {
		k, v, _ := strings.Cut(line, ":")
		kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		switch k {
		case "VmRSS":
			rss = kb * 1024
		case "VmHWM":
			peak = kb * 1024
		}
	}
	return rss, peak
}

func cpuSeconds(ru *unix.Rusage) float64 {
	return float64(ru.Utime.Sec+ru.Stime.Sec) + float64(ru.Utime.Usec+ru.Stime.Usec)/1e6
}

// sharedFile makes the disk file of a new SHARED segment whose marker is
// open at markerFd and named name below the directory at rel in the mount.
func (fsys *filesystem) sharedFile(markerFd int, name, rel string, flags int, mode uint32) (int, string, error) {
	if fsys.store.Disk == "" {
		return -1, "", fmt.Errorf("%w: the directory is SHARED", alloc.ErrNoDisk)
	}
	return fsys.store.CreateShared(alloc.FdPath(markerFd), rel+"/"+name, flags, mode)
}
