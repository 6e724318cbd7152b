package fs

import (
	"fmt"
	"log"
	"log/slog"
	"net"
	"os"
	"strconv"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/cluster"
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
	// Cluster, if set, makes the mount a node of that cluster (its Log
	// defaults to Log); nil joins none, and nothing of it runs.
	Cluster *cluster.Config
	// ClusterBounds bound what one user's publications take (with
	// Cluster).
	ClusterBounds ClusterBounds
	// Takeover, if set, returns the live connection of the mount at
	// Mountpoint, handed over by the daemon that serves it (or a keeper
	// that held it when its daemon died): Mount serves it instead of
	// mounting. Mount calls it once the filesystem is ready to serve, so
	// that a predecessor holds requests off for as short a time as can
	// be.
	Takeover func() (*Takeover, error)
	// Journal, if set, receives every change of what a successor takes
	// over (a keeper's copy, for a successor after a crash).
	Journal func(Record)
}

// Takeover is what a daemon hands its successor (Server.Handover): the
// FUSE connection, the INIT that set it up, the successor's generation
// and the predecessor's state.
type Takeover struct {
	Fd    int
	Init  []byte
	Gen   uint64
	State State
	// Crashed says the predecessor died: State has what it journaled
	// (handles, backing files) and no nodes, and every object of the
	// backing is registered instead (the kernel may hold any of them).
	Crashed bool
	// Orphans are descriptors of the backing files of the segments open
	// in no directory (unlinked while open), by node ID; Mount closes
	// them once it has taken them over.
	Orphans map[uint64]int
	// Imports are descriptors of the imported segments' files (the
	// senders'); Mount keeps those whose markers it finds and closes
	// the rest.
	Imports map[Import]int
	// Lease is a cluster node's etcd lease (0 for none), which the
	// successor keeps alive (cluster.Config.Resume); Listener its piece
	// server's socket (nil for none), which it serves on. Mount closes
	// Listener.
	Lease    int64
	Listener *os.File
	// Handoff tells the predecessor to stop and returns once it has;
	// Mount calls it once the successor can serve.
	Handoff func() error
}

// Server is a mounted tensorfs.
type Server struct {
	*fuse.Server
	fs  *filesystem
	ctl *ctl.Server
	// gate holds requests off while the mount is handed over; raw
	// keeps what a successor takes over.
	gate *gateFS
	raw  *HandoverFS
}

// handoverWait bounds how long a handover waits for the requests in
// flight to finish.
const handoverWait = 5 * time.Second

// Handover returns what a successor needs to take this mount over
// (Options.Takeover, without Handoff), once the requests in flight have
// finished; from then on it holds every request off (they die with this
// daemon, and the kernel sends them to the successor) until resume,
// which a handover that fails calls once it has closed t.Orphans and
// t.Imports.
func (s *Server) Handover() (t Takeover, resume func(), err error) {
	fd, err := ConnectionFd()
	if err != nil {
		return Takeover{}, nil, err
	}
	if !s.gate.freeze(handoverWait) {
		return Takeover{}, nil, fmt.Errorf("requests in flight did not finish within %v", handoverWait)
	}
	st := s.raw.State(s.fs.root.EmbeddedInode())
	st.Unnamed = s.fs.orphans.held()
	s.fs.imports.handing.Lock()
	if s.fs.gpu != nil {
		s.fs.gpu.holdCollects(true) // the successor claims the GPU helper
	}
	resume = func() {
		if s.fs.gpu != nil {
			s.fs.gpu.holdCollects(false)
		}
		s.fs.imports.handing.Unlock()
		s.gate.thaw()
	}
	t = Takeover{Fd: fd, Init: InitBytes(s.Server), Gen: s.raw.gen + 1, State: st, Orphans: s.fs.orphans.files(), Imports: s.fs.imports.files()}
	if s.fs.cl != nil {
		t.Lease = s.fs.cl.node.Lease()
	}
	return t, resume, nil
}

// ClusterListener returns a duplicate of the cluster piece server's
// socket, which the keeper keeps for a successor (Takeover.Listener); nil
// without a cluster.
func (s *Server) ClusterListener() (*os.File, error) {
	if s.fs.cl == nil {
		return nil, nil
	}
	return s.fs.cl.node.ListenerFile()
}

// Close stops the control socket, leaves the cluster, ends what the
// mount runs and spills device segments into their backing files for the
// next mount; call it once the mount is gone.
func (s *Server) Close() error {
	var err error
	if s.ctl != nil {
		err = s.ctl.Close()
	}
	if s.fs.cl != nil {
		s.fs.cl.close()
	}
	s.fs.close()
	return err
}

// Mode says how data is served: "passthrough" or "classic".
func (s *Server) Mode() string { return s.fs.mode() }

// maxRequest is the largest read or write request the kernel sends.
const maxRequest = 1<<20 - 8192

// Mount mounts tensorfs at opts.Mountpoint and returns once the kernel
// serves it. It owns opts.GPU from then on: Server.Close releases it, and
// so does a failed Mount, with everything else it acquired.
func Mount(opts Options) (_ *Server, err error) {
	fsys, err := newFilesystem(opts)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			if fsys.cl != nil {
				fsys.cl.close()
			}
			fsys.close()
		}
	}()
	// A successor takes the mount over once ready to serve, and a
	// cluster node's lease and socket with it, before it joins.
	var t *Takeover
	if opts.Takeover != nil {
		if t, err = opts.Takeover(); err != nil {
			return nil, err
		}
		if fsys.gpu != nil {
			fsys.claimDevices(t.Orphans)
			if err := failAfterClaim(); err != nil {
				return nil, err
			}
		}
	}
	if opts.Cluster != nil {
		if err := fsys.joinCluster(clusterConfig(*opts.Cluster, t, opts.Journal), opts.ClusterBounds); err != nil {
			return nil, fmt.Errorf("join the cluster: %w", err)
		}
	}

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
		// Node IDs are backing inodes, so that a successor knows the
		// kernel's (Takeover).
		ExternalNodeID: true,
		Logger:         log.New(log.Writer(), "go-fuse: ", 0),
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
		fopts.Logger = log.New(log.Writer(), "go-fuse: ", log.Lmicroseconds)
	} else {
		fopts.MountOptions.PanicHandler = (&panicLog{log: fsys.log}).handle
	}
	raw := fsys.handoverFS(fopts, opts.Journal)
	gate := &gateFS{RawFileSystem: raw}
	var srv *fuse.Server
	var unheld map[uint64]bool
	if t != nil {
		srv, unheld, err = takeOver(gate, raw, t, fsys, opts.Recovered, fopts.MountOptions)
		if err == nil && fsys.gpu != nil {
			fsys.gpu.settle()
			fsys.gpu.startCollecting()
		}
	} else {
		srv, err = mount(gate, opts.Mountpoint, fopts.MountOptions)
	}
	if err != nil {
		return nil, err
	}
	if !opts.NoPassthrough {
		if err := probePassthrough(srv, opts.Store.RootFd); err != nil {
			fsys.log.Warn("FUSE passthrough unavailable, the daemon serves read and write itself", "why", err)
		} else {
			fsys.passthrough.Store(true)
		}
	}
	if opts.Takeover != nil {
		// Only once the mode is known: an open answered without
		// passthrough while the kernel's inode has passthrough handles
		// open (inherited) is EIO.
		go srv.Serve()
		if len(unheld) > 0 {
			fsys.removeUnlinkedNames(unheld) // serving: it tells the kernel
		}
	}
	if srv.KernelSettings().Minor >= 40 { // FUSE_NOTIFY_RESEND: a successor has what was parked sent again
		fsys.gate.Store(gate)
	}
	widenReadahead(opts.Mountpoint, fsys.log)
	fsys.afterMount(opts.Mountpoint, opts.Recovered)
	s := &Server{Server: srv, fs: fsys, gate: gate, raw: raw}
	if opts.Socket != "" {
		s.ctl, err = ctl.Listen(ctl.Config{Path: opts.Socket, Backend: controlBackend{fsys}, Errno: toErrno, Log: opts.Log, Private: !opts.AllowOther, Owner: uint32(os.Geteuid()), Purge: opts.Purge, Ledger: fsys.ledger, Threads: fsys.threads})
		if err != nil {
			srv.Unmount()
			return nil, fmt.Errorf("control socket: %w", err)
		}
	}
	if fsys.cl != nil {
		fsys.cl.start()
	}
	return s, nil
}

// handoverFS returns fsys's node bridge (fopts), its requests counted,
// under a HandoverFS of generation 0 that, with fsys's orphans and
// imports, sends journal every change a successor takes over.
func (fsys *filesystem) handoverFS(fopts *fusefs.Options, journal func(Record)) *HandoverFS {
	raw := NewHandoverFS(&countingFS{RawFileSystem: fusefs.NewNodeFS(fsys.root, fopts), c: &fsys.requests}, 0)
	raw.journal, raw.forgotten = journal, fsys.orphans.forget
	fsys.orphans.journal, fsys.imports.journal = journal, journal
	return raw
}

// mount mounts raw at mountpoint and serves it.
func mount(raw fuse.RawFileSystem, mountpoint string, mopts fuse.MountOptions) (*fuse.Server, error) {
	srv, err := fuse.NewServer(raw, mountpoint, &mopts)
	if err != nil {
		return nil, fmt.Errorf("mount %s: %w", mountpoint, err)
	}
	if err := prefaultReads(srv); err != nil {
		srv.Unmount()
		return nil, err
	}
	go srv.Serve()
	if err := srv.WaitMount(); err != nil {
		srv.Unmount()
		return nil, err
	}
	return srv, nil
}

// takeOver returns a server of raw, which wraps h, on the connection
// of t: h takes the predecessor's state over (after a
// crash, every object of fsys's backing), its imports (whose markers
// recovery kept, rec) and orphans included, the
// predecessor stops, and the kernel resends what the predecessor left
// unanswered, for the server to serve once the caller has probed
// passthrough. It returns the UNLINK segments recovery kept that no
// handle holds, for the caller to remove once it serves.
func takeOver(raw fuse.RawFileSystem, h *HandoverFS, t *Takeover, fsys *filesystem, rec *Recovered, mopts fuse.MountOptions) (*fuse.Server, map[uint64]bool, error) {
	log := fsys.log
	if t.Gen == 0 || t.Gen >= 1<<32 {
		return nil, nil, fmt.Errorf("takeover: generation %d out of range", t.Gen)
	}
	if rec == nil {
		rec = &Recovered{}
	}
	dropped := fsys.receive(h, t, rec)
	log.Info("taking the mount over", "nodes", len(t.State.Nodes), "handles", len(t.State.Handles), "generation", t.Gen, "crashed", t.Crashed)
	srv, err := ServeConnection(raw, t.Fd, t.Init, mopts)
	if err != nil {
		return nil, nil, fmt.Errorf("takeover: %w", err)
	}
	lost, unheld := fsys.adopt(h, t.State, rec)
	if len(lost.Nodes) > 0 || len(lost.Handles) > 0 {
		log.Warn("takeover: what the kernel holds that the backing no longer has at its name, or that would not open again, fails", "nodes", len(lost.Nodes), "handles", len(lost.Handles))
	}
	if err := t.Handoff(); err != nil {
		return nil, nil, fmt.Errorf("takeover: %w", err)
	}
	fsys.imports.forget(dropped) // the keeper holds this daemon's state now
	if err := NotifyResend(); err != nil {
		log.Warn("takeover: the kernel cannot resend the requests the predecessor left unanswered; they wait for ever", "err", err)
	}
	return srv, unheld, nil
}

// receive takes what the takeover t hands over before its connection is
// served: the orphans' descriptors (for Adopt's lookups), the imports
// (whose markers recovery kept, rec), t's generation into h, and, after
// a crash, every object of the backing as t's nodes. It returns the
// imports it dropped, for the journal to forget once the keeper holds
// this daemon's state.
func (fsys *filesystem) receive(h *HandoverFS, t *Takeover, rec *Recovered) (dropped []Import) {
	fsys.orphans.handed = t.Orphans
	dropped = fsys.adoptImports(t.Imports, rec.imports, t.Crashed)
	if !t.Crashed {
		fsys.lateImports(rec)
	}
	h.gen = t.Gen
	if t.Crashed {
		t.State.Nodes = backingNodes(fsys.store.RootFd, fsys.log)
	}
	return dropped
}

// adopt has h take st over (HandoverFS.Adopt) and settles, by the handles
// it took over, what recovery kept (rec) and the orphans handed over. It
// returns what it could not take over, and the UNLINK segments recovery
// kept that no handle holds, for the caller to remove once it serves.
func (fsys *filesystem) adopt(h *HandoverFS, st State, rec *Recovered) (lost State, unheld map[uint64]bool) {
	lost = h.Adopt(st)
	held := heldNodes(st.Handles, lost.Handles)
	unheld = settleUnlinked(rec, held)
	fsys.keepUnlinkedImports(rec, held)
	fsys.settleOrphans()
	return lost, unheld
}

// clusterConfig is cfg for a daemon that takes the mount over with t
// (nil for none): it serves on t's socket and keeps t's lease alive; and
// that journals every lease it joins under.
func clusterConfig(cfg cluster.Config, t *Takeover, journal func(Record)) cluster.Config {
	if t != nil && t.Listener != nil {
		l, err := net.FileListener(t.Listener)
		if err == nil {
			cfg.Listener = l
		}
		t.Listener.Close()
	}
	if t != nil {
		cfg.Resume = t.Lease
	}
	if journal != nil {
		cfg.OnLease = func(id int64) { journal(Record{Lease: id}) }
	}
	return cfg
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
