package lifecycle

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/cluster"
	"tensorfs/cluster/transport"
	"tensorfs/fs"
	"tensorfs/gpu"
)

// Config is what a daemon serves.
type Config struct {
	// Mountpoint is the absolute path to mount at.
	Mountpoint string
	// Backing is the backing directory; "" for a private one.
	Backing string
	// Capacity sizes the private tmpfs in bytes; 0 for the default.
	Capacity int64
	// HugePages backs segments with 2 MiB pages (alloc.Config.HugePages).
	HugePages bool
	// Inodes is the private tmpfs's inodes; 0 for the default.
	Inodes int64
	// Disk is where SHARED segments live; "" for none.
	Disk string
	// GPU is the device backend: "none", "sim" or "cuda".
	GPU string
	// AllowOther lets other users in; NoPassthrough makes the daemon serve
	// read and write itself; Debug logs every FUSE request.
	AllowOther, NoPassthrough, Debug bool
	// Cluster, if set, makes the daemon a node of a cluster.
	Cluster *ClusterConfig
	// Kept says a keeper runs this daemon (KeeperFd); Takeover, that
	// the daemon takes the live mount over from the keeper (after a
	// crash, or from the daemon that serves it: tensorfs restart)
	// instead of mounting.
	Kept, Takeover bool
}

// ClusterConfig says how a daemon joins a cluster (DESIGN.md §10).
type ClusterConfig struct {
	// Endpoints are etcd's client URLs.
	Endpoints []string
	// Node is this node's name, which its certificate carries.
	Node string
	// CA, Cert and Key are PEM files: the cluster's CA, and this node's
	// certificate and key, issued by it.
	CA, Cert, Key string
	// Listen is where the piece server listens (host:port); "" for port
	// 7070 on the address etcd is reached from.
	Listen string
	// Bounds bound what one user's publications take.
	Bounds fs.ClusterBounds
	// HolderWait is how long a pull waits, with nothing in flight, for a
	// holder of a piece it lacks before it fails (0: cluster's default).
	HolderWait time.Duration
}

// Serve mounts cfg.Mountpoint, calls ready with the mode data is served
// in ("passthrough" or "classic") once the mount serves, and serves until
// it is unmounted or the process is signalled. SIGINT or SIGTERM detaches
// a busy mount and serves on until its last user closes; a second signal
// stops at once. A purge asked over the control socket runs as it
// returns. Call Prepare first.
func Serve(cfg Config, log *slog.Logger, ready func(mode string)) error {
	mp := cfg.Mountpoint
	// A kept daemon reaches its keeper on KeeperFd: a successor takes the
	// mount over from it once ready to serve (the predecessor holds
	// requests off from the handover on).
	var keeper *net.UnixConn
	var live uint64
	if cfg.Kept {
		c, err := net.FileConn(os.NewFile(KeeperFd, "keeper"))
		if err != nil {
			return fmt.Errorf("the keeper's socket: %w", err)
		}
		keeper = c.(*net.UnixConn)
	}
	if cfg.Takeover {
		if keeper == nil {
			return errors.New("a takeover needs a keeper")
		}
		if live = mountDev(mp); live == 0 {
			return fmt.Errorf("%s is not mounted", mp)
		}
	}
	// The pid file says that this daemon serves mp, from before it
	// touches the backing until it exits (see serving).
	removePid, err := writePidFile(mp)
	if err != nil {
		return err
	}
	served := false
	defer func() { removePid(served) }()
	// Registered after the pid file, so that it runs once the mount and
	// the store are closed, while the pid file still names this daemon.
	var purge atomic.Bool
	defer func() {
		if purge.Load() {
			purgeAtExit(mp, log)
		}
	}()
	// Modes are exactly what clients ask for: the kernel applied their
	// umask already.
	unix.Umask(0)
	raiseFileLimit()
	// The heap is metadata (one node per segment the kernel knows); a
	// tighter GC target keeps the daemon small at 100,000 segments for a
	// little CPU. GOGC, where set, is the operator's (the integration
	// tests' race-built daemons spent half their CPU collecting at 50).
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(50)
	}

	var clusterCfg *cluster.Config
	var bounds fs.ClusterBounds
	if c := cfg.Cluster; c != nil {
		bounds = c.Bounds
		creds, err := transport.LoadCredentials(c.CA, c.Cert, c.Key)
		if err != nil {
			return err
		}
		clusterCfg = &cluster.Config{Endpoints: c.Endpoints, Node: c.Node, Listen: c.Listen, NoHolderWait: c.HolderWait, Credentials: creds, Log: log}
	}
	// The GPU helper starts before the mount, so it inherits nothing of it.
	// fs.Mount owns it from the call on; failures before close it here.
	dev := startGPU(cfg.GPU, cfg.Takeover, log)
	store, err := alloc.Open(alloc.Config{Mountpoint: mp, Backing: cfg.Backing, Capacity: cfg.Capacity, Inodes: cfg.Inodes, HugePages: cfg.HugePages, Disk: cfg.Disk}, log)
	if err != nil {
		closeGPU(dev)
		return err
	}
	defer store.Close()
	segs, bytes, recovered, err := fs.Recover(store, live)
	if err != nil {
		closeGPU(dev)
		return fmt.Errorf("recover backing %s: %w", store.Dir, err)
	}
	var takeover func() (*fs.Takeover, error)
	if cfg.Takeover {
		takeover = func() (*fs.Takeover, error) { return receiveFromKeeper(keeper) }
	}
	var journal func(fs.Record)
	if keeper != nil {
		journal = journalTo(keeper)
	}
	srv, err := fs.Mount(fs.Options{
		Mountpoint:    mp,
		Store:         store,
		NoPassthrough: cfg.NoPassthrough,
		AllowOther:    cfg.AllowOther,
		Debug:         cfg.Debug,
		Log:           log,
		Socket:        alloc.StatePath(mp, ".sock"),
		GPU:           dev,
		Recovered:     recovered,
		Purge:         func() error { purge.Store(true); return nil },
		Cluster:       clusterCfg,
		ClusterBounds: bounds,
		Takeover:      takeover,
		Journal:       journal,
	})
	if err != nil {
		return err
	}
	served = true
	defer srv.Close()
	stop, err := listenHandover(mp, srv, log)
	if err != nil {
		return fmt.Errorf("handover socket: %w", err)
	}
	defer stop()
	log.Info("mounted", "mountpoint", mp, "backing", store.Dir, "mode", srv.Mode(), "huge_pages", store.HugePages, "segments", segs, "bytes", bytes)
	if keeper != nil {
		door, pidfd, err := gpu.Door(dev)
		if err == nil {
			err = hello(keeper, srv, door, pidfd)
		}
		for _, f := range []*os.File{door, pidfd} {
			if f != nil {
				f.Close()
			}
		}
		if err != nil {
			return fmt.Errorf("the keeper: %w", err)
		}
	}
	ready(srv.Mode())

	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	done := make(chan struct{})
	go func() { srv.Wait(); close(done) }()
	select {
	case <-done:
		log.Info("unmounted", "mountpoint", mp)
		return nil
	case s := <-sigs:
		log.Info("signal, unmounting", "signal", s.String())
	}
	// A busy mount is detached: it leaves the namespace now and the
	// daemon serves the open files until their last user closes them.
	// A second signal stops serving at once.
	if err := detach(mp); err != nil {
		return err
	}
	select {
	case <-done:
		log.Info("unmounted", "mountpoint", mp)
	case s := <-sigs:
		log.Warn("second signal: exiting while files are still open; their users get ENOTCONN", "signal", s.String())
	}
	return nil
}

// purgeAtExit purges the private backing of mp, as asked over the
// control socket ("tensorfs unmount --purge" of a mount that was busy).
func purgeAtExit(mp string, log *slog.Logger) {
	if err := alloc.Purge(mp); err != nil {
		log.Error("purge asked over the control socket", "err", err)
		return
	}
	log.Info("purged the backing, as asked over the control socket", "backing", alloc.PrivateBacking(mp))
}

// raiseFileLimit lifts the soft limit on open files to the hard one:
// every directory the kernel knows and every open segment holds one. It
// runs before the mount: the control socket sizes its limits to half of
// the soft limit then (ctl.Config.Total), leaving the rest to FUSE.
func raiseFileLimit() {
	var r unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &r) == nil && r.Cur < r.Max {
		r.Cur = r.Max
		unix.Setrlimit(unix.RLIMIT_NOFILE, &r)
	}
}

// startGPU starts the device process for backend sim or cuda. When it
// cannot start, the mount serves host segments and the log says why, in
// one line. A successor (takeover) whose keeper holds the helper's door
// (GPUDoorFd) attaches to that helper instead, whose blocks hold its
// predecessor's segments; if that helper is gone (it died) or hangs (no
// answer within a control call's deadline: it is killed through its pidfd,
// GPUPidfdFd, first), it starts a new one, as a fresh mount does, whose
// door its hello gives the keeper: the device bytes are lost, as after a
// crash, and the log says so.
func startGPU(backend string, takeover bool, log *slog.Logger) gpu.Device {
	if backend == "none" {
		return nil
	}
	if takeover {
		if dev, err := attachGPU(log); err != nil {
			log.Error("the GPU helper was lost; a new one starts, and GPU segments lose their device bytes", "err", err)
		} else if dev != nil {
			log.Info("GPU segments on, from the predecessor's helper", "backend", dev.Backend(), "device", dev.Name())
			return dev
		}
	}
	exe, err := selfExe, error(nil)
	if backend == "cuda" {
		// CUDA lives in a helper binary of its own (built with -tags cuda),
		// so that this one never links libcuda.
		exe, err = findCUDAHelper()
	}
	var dev gpu.Device
	if err == nil {
		dev, err = gpu.Start(exe, backend, 0, log)
	}
	if err != nil {
		log.Warn("GPU segments off", "why", err.Error())
		return nil
	}
	log.Info("GPU segments on", "backend", dev.Backend(), "device", dev.Name())
	return dev
}

// attachGPU attaches to the GPU helper whose door the keeper gave on
// GPUDoorFd, with its pidfd on GPUPidfdFd if given; nil and no error if
// it gave no door.
func attachGPU(log *slog.Logger) (gpu.Device, error) {
	door := inherited(GPUDoorFd, "socket:", "gpu door")
	if door == nil {
		return nil, nil
	}
	defer door.Close()
	pidfd := inherited(GPUPidfdFd, "anon_inode:[pidfd]", "gpu helper pidfd")
	if pidfd != nil {
		defer pidfd.Close()
	}
	return gpu.Attach(door, pidfd, log)
}

// inherited returns descriptor fd, as a keeper passes it, if it is of the
// kind its /proc/self/fd link starts with; else nil, and fd is left alone:
// a keeper that passed nothing there leaves the number to whatever this
// process opened since (the Go runtime's poller, say).
func inherited(fd int, kind, name string) *os.File {
	link, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
	if err != nil || !strings.HasPrefix(link, kind) {
		return nil
	}
	return os.NewFile(uintptr(fd), name)
}

// closeGPU stops the device process, if one was started.
func closeGPU(dev gpu.Device) {
	if dev != nil {
		dev.Close()
	}
}

// findCUDAHelper returns the path of tensorfs-gpu beside the tensorfs
// binary, else on PATH. It runs as root, so it is checked as a restart's
// binary is (openBinary); since that leaves no one but root able to
// change what its path names, it runs by that path.
func findCUDAHelper() (string, error) {
	p, err := exec.LookPath("tensorfs-gpu")
	if self, e := os.Executable(); e == nil {
		if beside := filepath.Join(filepath.Dir(self), "tensorfs-gpu"); unix.Access(beside, unix.X_OK) == nil {
			p, err = beside, nil
		}
	}
	if err == nil {
		p, err = filepath.EvalSymlinks(p)
	}
	if err != nil {
		return "", errors.New("no tensorfs-gpu helper beside tensorfs or on PATH; build it with scripts/cuda-sdk.sh and go build -tags cuda ./gpu/cmd/tensorfs-gpu")
	}
	b, err := openBinary(p)
	if err != nil {
		return "", err
	}
	b.f.Close()
	return p, nil
}
