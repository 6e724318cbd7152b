package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/fs"
	"tensorfs/gpu"
)

// mountFlags are the flags of "tensorfs mount".
type mountFlags struct {
	foreground    bool
	backing       string
	capacity      string
	disk          string
	gpu           string
	allowOther    bool
	debug         bool
	noPassthrough bool
}

func (m *mountFlags) register(set *flag.FlagSet) {
	set.BoolVar(&m.foreground, "f", false, "stay in the foreground")
	set.StringVar(&m.backing, "backing", "", "backing directory (default: a private tmpfs chosen from MOUNTPOINT)")
	set.StringVar(&m.capacity, "capacity", "", "size of the private tmpfs, e.g. 8G")
	set.StringVar(&m.disk, "disk", "", "directory where SHARED segments live")
	set.StringVar(&m.gpu, "gpu", "none", "GPU backend: none | sim | cuda")
	set.BoolVar(&m.allowOther, "allow-other", false, "let other users in (permissions are always checked by the kernel)")
	set.BoolVar(&m.debug, "debug", false, "log every FUSE request")
	set.BoolVar(&m.noPassthrough, "no-passthrough", false, "serve read/write from the daemon instead of FUSE passthrough")
}

func runMount(args []string, stdout, stderr io.Writer) int {
	var m mountFlags
	set := flag.NewFlagSet("tensorfs mount", flag.ContinueOnError)
	m.register(set)
	if code, ok := parseFlags(set, args, "[flags] MOUNTPOINT", stdout, stderr); !ok {
		return code
	}
	if set.NArg() != 1 {
		fmt.Fprintln(stderr, "tensorfs mount: want exactly one MOUNTPOINT; see tensorfs mount -h")
		return 2
	}
	mp, err := filepath.Abs(set.Arg(0))
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs mount: %v\n", err)
		return 1
	}
	if err := checkMountFlags(&m); err != nil {
		fmt.Fprintf(stderr, "tensorfs mount: %v\n", err)
		return 2
	}
	if err := prepareMountpoint(mp); err != nil {
		fmt.Fprintf(stderr, "tensorfs mount: %v\n", err)
		return 1
	}
	// A daemon still serving a detached mount owns the backing: recovery
	// would take its live segments for leftovers.
	if pid := servingDaemon(mp); pid > 0 {
		fmt.Fprintf(stderr, "tensorfs mount: %s is still served by tensorfs daemon pid %d (its mount is detached but files are in use); "+
			"run tensorfs unmount %s and wait for their users to exit, or kill %d, then mount again\n", mp, pid, mp, pid)
		return 1
	}
	if !m.foreground {
		return daemonize(args, mp, stdout, stderr)
	}
	if err := serve(&m, mp, stdout, stderr); err != nil {
		fmt.Fprintf(stderr, "tensorfs mount: %v\n", err)
		return 1
	}
	return 0
}

func checkMountFlags(m *mountFlags) error {
	switch m.gpu {
	case "none", "sim", "cuda":
	default:
		return fmt.Errorf("--gpu %s: want none, sim or cuda", m.gpu)
	}
	if m.capacity != "" && m.backing != "" {
		return errors.New("--capacity sizes the private tmpfs and cannot be used with --backing")
	}
	if m.capacity != "" && os.Geteuid() != 0 {
		// alloc.Open could only warn in the log: refuse on the terminal instead.
		return fmt.Errorf("--capacity needs root: it sizes a private tmpfs, which only root may mount; "+
			"as uid %d segments live in /dev/shm and share its limit (df -h /dev/shm). Drop --capacity, or mount as root", os.Geteuid())
	}
	_, err := parseSize(m.capacity)
	return err
}

// parseSize reads sizes such as 512M, 8G, 1T or plain bytes; "" is 0.
func parseSize(s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	mult := int64(1)
	num := strings.TrimSuffix(strings.ToUpper(s), "B")
	if i := strings.IndexAny(num, "KMGT"); i >= 0 && i == len(num)-1 {
		mult = int64(1) << (10 * (1 + strings.IndexByte("KMGT", num[i])))
		num = num[:i]
	}
	v, err := strconv.ParseInt(num, 10, 64)
	if err != nil || v <= 0 || v > (1<<62)/mult {
		return 0, fmt.Errorf("--capacity %q: want a positive size such as 512M or 8G", s)
	}
	return v * mult, nil
}

// prepareMountpoint checks the mountpoint and cleans up a stale mount
// left by a daemon that died (ENOTCONN). statfs asks the daemon every
// time, where stat may be answered from the kernel's attribute cache.
func prepareMountpoint(mp string) error {
	var sfs unix.Statfs_t
	err := unix.Statfs(mp, &sfs)
	if errors.Is(err, unix.ENOTCONN) {
		if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil {
			if out, ferr := exec.Command("fusermount3", "-u", "-z", mp).CombinedOutput(); ferr != nil {
				return fmt.Errorf("clean stale mount at %s: %v (%s)", mp, err, strings.TrimSpace(string(out)))
			}
		}
	}
	var st unix.Stat_t
	if err := unix.Stat(mp, &st); err != nil {
		return fmt.Errorf("mountpoint %s: %w (create it with mkdir -p)", mp, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("mountpoint %s is not a directory", mp)
	}
	if mountedAt(mp) {
		return fmt.Errorf("%s is already mounted; run tensorfs unmount %s first", mp, mp)
	}
	return nil
}

// mountedAt reports whether mp is a live mount root.
func mountedAt(mp string) bool {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && unescapeMountinfo(f[4]) == mp {
			return true
		}
	}
	return false
}

// unescapeMountinfo undoes the octal escapes of /proc/self/mountinfo.
func unescapeMountinfo(s string) string {
	for _, e := range []struct{ from, to string }{{`\040`, " "}, {`\011`, "\t"}, {`\012`, "\n"}, {`\134`, `\`}} {
		s = strings.ReplaceAll(s, e.from, e.to)
	}
	return s
}

// statePath is where the daemon of mp keeps its pid and log.
func statePath(mp, ext string) string {
	return alloc.StatePath(mp, ext)
}

// daemonize starts "tensorfs mount -f" in a new session and returns once
// it says the mount is ready.
func daemonize(args []string, mp string, stdout, stderr io.Writer) int {
	logPath := statePath(mp, ".log")
	if err := alloc.MakeStateDir(); err != nil {
		fmt.Fprintf(stderr, "tensorfs mount: %v\n", err)
		return 1
	}
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err == nil {
		err = logf.Chmod(0o600) // a log from an earlier version may be 0644
	}
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs mount: %v\n", err)
		return 1
	}
	defer logf.Close()
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs mount: %v\n", err)
		return 1
	}
	cmd := exec.Command(self, append([]string{"mount", "-f"}, args...)...)
	cmd.Stderr = logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	out, err := cmd.StdoutPipe()
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs mount: %v\n", err)
		return 1
	}
	if err := cmd.Start(); err != nil {
		fmt.Fprintf(stderr, "tensorfs mount: start daemon: %v\n", err)
		return 1
	}
	line, _ := bufio.NewReader(out).ReadString('\n')
	if !strings.HasPrefix(line, "ready ") {
		cmd.Wait()
		fmt.Fprintf(stderr, "tensorfs mount: the daemon failed; its log %s says:\n%s", logPath, tail(logPath, 5))
		return 1
	}
	fmt.Fprintf(stdout, "tensorfs: mounted %s (%s; log %s)\n", mp, strings.TrimSpace(line), logPath)
	return 0
}

// tail returns the last n lines of a file.
func tail(path string, n int) string {
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n") + "\n"
}

// serve mounts and serves until unmounted or signalled.
func serve(m *mountFlags, mp string, stdout, stderr io.Writer) error {
	level := slog.LevelInfo
	if m.debug {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	// Registered first, so that it runs last, once the mount and the
	// store are closed.
	defer purgeIfAsked(mp, log)
	// Modes are exactly what clients ask for: the kernel applied their
	// umask already.
	unix.Umask(0)
	raiseFileLimit()
	// The heap is metadata (one node per segment the kernel knows); a
	// tighter GC target keeps the daemon small at 100,000 segments for a
	// little CPU.
	debug.SetGCPercent(50)

	// The pid file says that this daemon serves mp, before it touches the
	// backing, until it exits (see servingDaemon).
	pidPath := statePath(mp, ".pid")
	if err := alloc.MakeStateDir(); err != nil {
		return err
	}
	os.WriteFile(pidPath, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644)
	defer os.Remove(pidPath)

	// The GPU helper starts before the mount, so it inherits nothing of it.
	// fs.Mount owns it from the call on; failures before close it here.
	dev := startGPU(m.gpu, log)
	capacity, _ := parseSize(m.capacity)
	store, err := alloc.Open(alloc.Config{Mountpoint: mp, Backing: m.backing, Capacity: capacity, Disk: m.disk}, log)
	if err != nil {
		closeGPU(dev)
		return err
	}
	defer store.Close()
	segs, bytes, recovered, err := fs.Recover(store)
	if err != nil {
		closeGPU(dev)
		return fmt.Errorf("recover backing %s: %w", store.Dir, err)
	}
	srv, err := fs.Mount(fs.Options{
		Mountpoint:    mp,
		Store:         store,
		NoPassthrough: m.noPassthrough,
		AllowOther:    m.allowOther,
		Debug:         m.debug,
		Log:           log,
		Socket:        statePath(mp, ".sock"),
		GPU:           dev,
		Recovered:     recovered,
	})
	if err != nil {
		return err
	}
	defer srv.Close()
	log.Info("mounted", "mountpoint", mp, "backing", store.Dir, "mode", srv.Mode(), "segments", segs, "bytes", bytes)
	fmt.Fprintf(stdout, "ready pid=%d mode=%s mountpoint=%s\n", os.Getpid(), srv.Mode(), mp)

	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
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
	if err := unmount(mp); err != nil {
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

// purgeIfAsked purges the backing if "tensorfs unmount --purge" asked
// this daemon to (the request names its pid): the mount was busy then,
// and the daemon exits now that its last user has gone.
func purgeIfAsked(mp string, log *slog.Logger) {
	req := statePath(mp, ".purge")
	b, err := os.ReadFile(req)
	if err != nil || strings.TrimSpace(string(b)) != strconv.Itoa(os.Getpid()) {
		return
	}
	os.Remove(req)
	if err := alloc.Purge(mp); err != nil {
		log.Error("purge asked by tensorfs unmount --purge", "err", err)
		return
	}
	log.Info("purged the backing, as tensorfs unmount --purge asked", "backing", alloc.PrivateBacking(mp))
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

// startGPU starts the device process for --gpu sim or cuda. When it cannot
// start, the mount serves host segments and the log says why, in one line.
func startGPU(backend string, log *slog.Logger) gpu.Device {
	if backend == "none" {
		return nil
	}
	exe, err := os.Executable()
	if err == nil && backend == "cuda" {
		// CUDA lives in a helper binary of its own (built with -tags cuda),
		// so that this one never links libcuda.
		exe, err = findCUDAHelper(exe)
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

// closeGPU stops the device process, if one was started.
func closeGPU(dev gpu.Device) {
	if dev != nil {
		dev.Close()
	}
}

// findCUDAHelper looks for tensorfs-gpu beside the tensorfs binary, then
// on PATH.
func findCUDAHelper(self string) (string, error) {
	p := filepath.Join(filepath.Dir(self), "tensorfs-gpu")
	if _, err := os.Stat(p); err == nil {
		return p, nil
	}
	if p, err := exec.LookPath("tensorfs-gpu"); err == nil {
		return p, nil
	}
	return "", errors.New("no tensorfs-gpu helper beside tensorfs or on PATH; build it with scripts/cuda-sdk.sh and go build -tags cuda ./gpu/cmd/tensorfs-gpu")
}
