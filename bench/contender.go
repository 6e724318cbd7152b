package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"tensorfs/procfs"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// Contender names, as the report shows them.
const (
	tmpfsName   = "tmpfs"
	ptName      = "passthrough"
	classicName = "classic"
	loopName    = "loopback"
	// loopStockName is loopbackfs with go-fuse's default options.
	loopStockName = "loopback (stock)"
	// simName is tensorfs with a simulated GPU (--gpu sim), its
	// contender directory one whose segments live on cuda:0.
	simName = "cuda:0 (sim)"
	// simCpName is cp into that same directory: the sim's copy speed.
	simCpName = "cp to cuda:0 (sim)"
	shmName   = "share_memory_()"
	copyName  = "own copy"
)

// contender is one thing a case runs against: a directory, and for
// tensorfs and loopbackfs the daemon serving it.
type contender struct {
	name string
	dir  string // where cases put their files
	mp   string // mountpoint; "" for plain tmpfs
	// backing is the loopback mount's underlying directory.
	backing  string
	cmd      *exec.Cmd
	pid      int
	tensorfs bool
	// log is the daemon's stderr, with the Go runtime's GC trace.
	log string
}

// start mounts the named contenders; on error it stops those it started.
func (b *bench) start(names ...string) ([]*contender, error) {
	var cs []*contender
	for _, n := range names {
		c, err := b.startOne(n)
		if err != nil {
			b.stop(cs)
			return nil, fmt.Errorf("start %s: %w", n, err)
		}
		cs = append(cs, c)
		b.mu.Lock()
		b.live[c] = true
		b.mu.Unlock()
	}
	return cs, nil
}

func (b *bench) startOne(name string) (*contender, error) {
	c := &contender{name: name}
	switch name {
	case tmpfsName:
		c.dir = filepath.Join(b.tmpfs, "plain")
		return c, os.Mkdir(c.dir, 0o755)
	case loopName, loopStockName:
		slug := strings.NewReplacer(" (", "-", ")", "").Replace(name)
		c.backing = filepath.Join(b.tmpfs, slug)
		if err := os.Mkdir(c.backing, 0o755); err != nil {
			return nil, err
		}
		c.mp = filepath.Join(b.work, "mnt-"+slug)
		args := []string{c.mp, c.backing}
		if name == loopStockName {
			args = append([]string{"-stock"}, args...)
		}
		c.cmd = exec.Command(b.lbBin, args...)
	default:
		c.tensorfs = true
		c.mp = filepath.Join(b.work, "mnt-"+name)
		args := []string{"mount", "-f", "--capacity", "12G"}
		switch name {
		case classicName:
			args = append(args, "--no-passthrough")
		case simName:
			args = append(args, "--gpu", "sim")
		}
		c.cmd = exec.Command(b.bin, append(args, c.mp)...)
	}
	c.dir = c.mp
	if err := os.MkdirAll(c.mp, 0o755); err != nil {
		return nil, err
	}
	c.log = filepath.Join(b.work, strings.ReplaceAll(name, " ", "")+".log")
	logf, err := os.Create(c.log)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	c.cmd.Stderr = logf
	c.cmd.Env = append(os.Environ(), "GODEBUG=gctrace=1")
	out, err := c.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := c.cmd.Start(); err != nil {
		return nil, err
	}
	line := make(chan string, 1)
	go func() {
		l, _ := bufio.NewReader(out).ReadString('\n')
		line <- l
	}()
	var ready string
	select {
	case ready = <-line:
	case <-time.After(30 * time.Second):
	}
	f := strings.Fields(ready)
	if len(f) < 2 || f[0] != "ready" {
		c.cmd.Process.Kill()
		c.cmd.Wait()
		return nil, fmt.Errorf("no ready line from %s (log in %s)", c.cmd.Path, logf.Name())
	}
	c.pid, _ = strconv.Atoi(strings.TrimPrefix(f[1], "pid="))
	if c.tensorfs {
		want := "mode=passthrough"
		if name == classicName {
			want = "mode=classic"
		}
		if !strings.Contains(ready, want) {
			b.stopOne(c)
			return nil, fmt.Errorf("tensorfs mounted with %q, want %s", strings.TrimSpace(ready), want)
		}
	}
	return c, nil
}

// named returns the contender called name.
func named(cs []*contender, name string) *contender {
	for _, c := range cs {
		if c.name == name {
			return c
		}
	}
	panic("bench: no contender " + name)
}

// stop unmounts the contenders and removes what they held.
func (b *bench) stop(cs []*contender) {
	for _, c := range cs {
		b.stopOne(c)
	}
}

func (b *bench) stopOne(c *contender) {
	b.mu.Lock()
	delete(b.live, c)
	b.mu.Unlock()
	switch {
	case c.tensorfs:
		if out, err := exec.Command(b.bin, "unmount", "--purge", c.mp).CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "bench: unmount %s: %v %s", c.mp, err, out)
		}
	case c.cmd != nil:
		if err := unix.Unmount(c.mp, 0); err != nil {
			unix.Unmount(c.mp, unix.MNT_DETACH)
		}
	}
	if c.cmd != nil {
		done := make(chan error, 1)
		go func() { done <- c.cmd.Wait() }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			c.cmd.Process.Kill()
			<-done
		}
		os.Remove(c.mp)
	}
	if c.mp == "" {
		os.RemoveAll(c.dir)
	}
	if c.backing != "" {
		os.RemoveAll(c.backing)
	}
}

// daemonStats is the part of tensorfs's user.tensorfs.stats that the
// report uses.
type daemonStats struct {
	Requests map[string]int64 `json:"requests"`
	Daemon   struct {
		CPUSeconds float64 `json:"cpu_seconds"`
	} `json:"daemon"`
}

// stats reads the daemon's counters from the mount root.
func (c *contender) stats() (daemonStats, error) {
	var st daemonStats
	buf := make([]byte, 64*kiB)
	n, err := unix.Getxattr(c.mp, "user.tensorfs.stats", buf)
	if err != nil {
		return st, fmt.Errorf("getxattr user.tensorfs.stats: %w", err)
	}
	return st, json.Unmarshal(buf[:n], &st)
}

// counters reads a daemon's request counters and CPU time: tensorfs's
// stats xattr, or for other daemons the CPU time in /proc/PID/stat (in
// clock ticks of 10 ms) alone.
func (c *contender) counters() (daemonStats, error) {
	if c.tensorfs {
		return c.stats()
	}
	var st daemonStats
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", c.pid))
	if err != nil {
		return st, err
	}
	// Fields after the command name, which ends in the last ')': state is
	// field 3, utime and stime are 14 and 15.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	if len(f) < 13 {
		return st, fmt.Errorf("short /proc/%d/stat", c.pid)
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return st, fmt.Errorf("unreadable /proc/%d/stat", c.pid)
	}
	st.Daemon.CPUSeconds = float64(utime+stime) / clockTicks
	return st, nil
}

// clockTicks is USER_HZ, the unit of /proc/PID/stat's times, on Linux.
const clockTicks = 100

// rss returns the daemon's resident set size now (VmRSS) and its peak
// (VmHWM). The peak in user.tensorfs.stats comes from getrusage, whose
// maxrss a process inherits across execve from the process that started
// it (here the bench, with its mappings), so it is not used.
func (c *contender) rss() (now, peak int64, err error) {
	st, err := procfs.ReadStatus(c.pid)
	return st.VmRSS, st.VmHWM, err
}

// liveHeap returns the daemon's live heap in MiB after its last garbage
// collection, from the GC trace in its log ("gc N ...: A->B->C MB").
func (c *contender) liveHeap() (float64, error) {
	b, err := os.ReadFile(c.log)
	if err != nil {
		return 0, err
	}
	lines := strings.Split(string(b), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if !strings.HasPrefix(lines[i], "gc ") {
			continue
		}
		for _, f := range strings.Split(lines[i], ",") {
			if heap, ok := strings.CutSuffix(strings.TrimSpace(f), " MB"); ok && strings.Count(heap, "->") == 2 {
				return strconv.ParseFloat(heap[strings.LastIndex(heap, "->")+2:], 64)
			}
		}
	}
	return 0, fmt.Errorf("no GC trace in %s", c.log)
}

func mountTmpfs(dir string) error {
	if err := os.Mkdir(dir, 0o755); err != nil {
		return err
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=16G,mode=0755"); err != nil {
		return fmt.Errorf("mount tmpfs at %s: %w", dir, err)
	}
	return nil
}

// mountOf describes the mount holding path, from /proc/self/mountinfo:
// its mount point, type, and the mount's and the superblock's options.
func mountOf(path string) (string, error) {
	mounts, err := mountinfo.GetMounts(nil)
	if err != nil {
		return "", err
	}
	var best *mountinfo.Info
	for _, m := range mounts {
		mp := m.Mountpoint
		if (path == mp || strings.HasPrefix(path, strings.TrimSuffix(mp, "/")+"/")) && (best == nil || len(mp) >= len(best.Mountpoint)) {
			best = m
		}
	}
	if best == nil {
		return "", fmt.Errorf("no mount holds %s", path)
	}
	return fmt.Sprintf("%s `%s,%s`", best.FSType, best.Options, best.VFSOptions), nil
}

func unmountTmpfs(dir string) {
	if err := unix.Unmount(dir, 0); err != nil {
		unix.Unmount(dir, unix.MNT_DETACH)
	}
}
