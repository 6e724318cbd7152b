package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

var (
	mRefcountScan   = metricDef{"getxattr refcount, a fresh scan of /proc", "ms", false}
	mHoldersScan    = metricDef{"getxattr holders, a fresh scan of /proc", "ms", false}
	mRefcountCached = metricDef{"getxattr refcount within the scan's 100 ms", "µs", false}
)

const (
	holderProcs    = 500 // processes mapping the segments
	holderMappings = 100 // segments each of them maps
	// holderSamples is how many timings of each kind a round takes.
	holderSamples = 5
	// scanTTL outlasts the daemon's scan cache (fs.mapsTTL), so that the
	// next getxattr scans again.
	scanTTL = 150 * time.Millisecond
)

// holdersScript maps every segment named in argv[2:] with libc and closes
// its descriptor, as torch.from_file does, then forks until argv[1]
// processes hold the mappings, says "ready" and waits for EOF on stdin.
const holdersScript = `
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
for p in sys.argv[2:]:
    fd = os.open(p, os.O_RDWR)
    if libc.mmap(None, 4096, 3, 1, fd, 0) == ctypes.c_void_p(-1).value:
        sys.exit("mmap %s: errno %d" % (p, ctypes.get_errno()))
    os.close(fd)
r, w = os.pipe()
kids = []
for _ in range(int(sys.argv[1]) - 1):
    pid = os.fork()
    if pid == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    kids.append(pid)
print("ready", flush=True)
sys.stdin.read()
os.close(w)
for pid in kids:
    os.waitpid(pid, 0)
`

// groupHolders measures what user.tensorfs.refcount and holders cost on
// a machine where holderProcs processes map holderMappings segments each,
// their descriptors closed: each answer scans every process's
// /proc/PID/maps, once per 100 ms at most. One contender at a time, so
// that the machine has only its processes.
func (b *bench) groupHolders() error {
	for _, name := range []string{ptName, classicName} {
		cs, err := b.start(name)
		if err != nil {
			return err
		}
		err = b.holdersOne(cs[0])
		b.stop(cs)
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	}
	return nil
}

func (b *bench) holdersOne(c *contender) error {
	dir := filepath.Join(c.dir, "mapped")
	if err := os.Mkdir(dir, 0o755); err != nil {
		return err
	}
	args := []string{"-c", holdersScript, strconv.Itoa(holderProcs)}
	for i := range holderMappings {
		p := filepath.Join(dir, "s"+strconv.Itoa(i))
		if err := writeFile(p, 4*kiB); err != nil {
			return err
		}
		args = append(args, p)
	}
	cmd := exec.Command(pythonBin, args...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	defer func() {
		stdin.Close()
		cmd.Wait()
	}()
	if line, _ := bufio.NewReader(out).ReadString('\n'); line != "ready\n" {
		return fmt.Errorf("mapping processes did not start: %q", line)
	}
	seg := filepath.Join(dir, "s0")
	get := func(name string) (string, time.Duration, error) {
		buf := make([]byte, 64*kiB)
		t := time.Now()
		n, err := unix.Getxattr(seg, name, buf)
		d := time.Since(t)
		if err != nil {
			return "", 0, fmt.Errorf("getxattr %s: %w", name, err)
		}
		return string(buf[:n]), d, nil
	}
	refs, _, err := get("user.tensorfs.refcount")
	if err == nil && refs != strconv.Itoa(holderProcs) {
		err = fmt.Errorf("refcount %s with %d processes mapping the segment", refs, holderProcs)
	}
	if err != nil {
		return err
	}
	procs, lines := machineMappings()
	b.res.facts = append(b.res.facts, fmt.Sprintf("%s: refcount and holders with %d processes on the machine "+
		"(%d of them mapping %d segments each, descriptors closed), %d lines in all their /proc/PID/maps",
		c.name, procs, holderProcs, holderMappings, lines))
	cases := []struct {
		m      metricDef
		attr   string
		cached bool
	}{
		{mRefcountScan, "user.tensorfs.refcount", false},
		{mHoldersScan, "user.tensorfs.holders", false},
		{mRefcountCached, "user.tensorfs.refcount", true},
	}
	for range b.cfg.rounds {
		for _, k := range cases {
			b.res.opsPerRun[k.m.name] = holderSamples
			err := b.observe(c, k.m.name, func() (int64, error) {
				for range holderSamples {
					time.Sleep(scanTTL)
					if k.cached {
						if _, _, err := get(k.attr); err != nil {
							return 0, err
						}
					}
					v, d, err := get(k.attr)
					if err != nil {
						return 0, err
					}
					if k.attr == "user.tensorfs.holders" && strings.Count(v, "\n") != holderProcs {
						return 0, fmt.Errorf("holders has %d lines, want %d", strings.Count(v, "\n"), holderProcs)
					}
					if k.cached {
						b.res.add(k.m, c.name, float64(d.Nanoseconds())/1e3)
					} else {
						b.res.add(k.m, c.name, float64(d.Nanoseconds())/1e6)
					}
				}
				return 0, nil
			})
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// machineMappings counts the processes on the machine and the lines of
// their /proc/PID/maps.
func machineMappings() (procs, lines int) {
	names, _ := filepath.Glob("/proc/[0-9]*/maps")
	for _, p := range names {
		if b, err := os.ReadFile(p); err == nil {
			procs++
			lines += bytes.Count(b, []byte{'\n'})
		}
	}
	return procs, lines
}
