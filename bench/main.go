// Command bench measures tensorfs and writes BENCHMARKS.md.
//
// Each case runs against a plain tmpfs directory, tensorfs in passthrough
// mode and tensorfs with --no-passthrough (classic); metadata cases also
// against go-fuse's stock LoopbackNode over the same tmpfs
// (bench/loopbackfs, mounted with tensorfs's options, and for readdir
// also with go-fuse's), tensorfs import and export against cp, the
// PyTorch case against share_memory_() and a private copy per worker, and
// pulls over a cluster test bed (scripts/cluster.sh) against iperf3
// between the same namespaces; the sim group runs the pull scheduler on
// simulated clusters of up to a thousand nodes.
// Contenders are interleaved round by round (the order rotating each
// round, backwards every other round) so that the noise of a shared
// machine falls on all of them alike; the report gives medians and
// min–max, and computes its notes from them and from the daemon's
// counters: around every tensorfs run it reads the daemon's
// user.tensorfs.stats, so the report shows the FUSE requests and daemon
// CPU behind each number.
//
// It runs as root from the repository root (make bench): it mounts a
// tmpfs, builds and mounts tensorfs and loopbackfs, and runs fio and
// /usr/bin/python3. -quick shrinks sizes and rounds for a smoke run.
package main

import (
	"errors"
	"flag"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

const (
	kiB = 1 << 10
	miB = 1 << 20
	giB = 1 << 30
)

// config holds the sizes and counts of a run.
type config struct {
	rounds    int
	out       string
	tensorfs  string // prebuilt binary; "" builds ./cmd/tensorfs
	groups    []string
	ioSize    int64         // fio sequential file
	randTime  time.Duration // fio random-read run time
	mmapSize  int64         // mmap and open() segment
	metaN     int           // iterations of each metadata loop
	dirN      int           // segments in the readdir directory
	scaleSize int64         // bytes written for the RSS scale case
	torchSize int64         // the PyTorch weight tensor
	// importSize is the tensor data of the imported safetensors file.
	importSize int64
	// clusterSize is the tensor data of the model the cluster group pulls.
	clusterSize int64
	// simNodes are the cluster sizes the sim group simulates.
	simNodes []int
}

// allGroups are the case groups in the order they run.
var allGroups = []string{"io", "mmap", "meta", "readdir", "import", "scale", "torch", "model", "holders", "cluster", "sim"}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run() error {
	var cfg config
	quick := flag.Bool("quick", false, "small sizes and 3 rounds: a smoke run of a minute or two")
	flag.IntVar(&cfg.rounds, "rounds", 0, "rounds per case (default 5, 3 with -quick)")
	flag.StringVar(&cfg.out, "out", "BENCHMARKS.md", "report to write")
	flag.StringVar(&cfg.tensorfs, "tensorfs", "", "tensorfs binary to measure (default: build ./cmd/tensorfs)")
	groups := flag.String("groups", strings.Join(allGroups, ","), "case groups to run")
	flag.Parse()

	cfg.ioSize, cfg.randTime, cfg.mmapSize = 2*giB, 4*time.Second, 1*giB
	cfg.metaN, cfg.dirN, cfg.scaleSize, cfg.torchSize, cfg.importSize = 10000, 100000, 8*giB, 1*giB, 1*giB
	cfg.clusterSize = 1 * giB
	cfg.simNodes = []int{8, 64, 256, 1000}
	if *quick {
		cfg.simNodes = []int{8, 64}
		cfg.ioSize, cfg.randTime, cfg.mmapSize = 256*miB, time.Second, 256*miB
		cfg.metaN, cfg.dirN, cfg.scaleSize, cfg.torchSize, cfg.importSize = 2000, 10000, 1*giB, 256*miB, 128*miB
		cfg.clusterSize = 256 * miB
	}
	if cfg.rounds == 0 {
		cfg.rounds = 5
		if *quick {
			cfg.rounds = 3
		}
	}
	for _, g := range strings.Split(*groups, ",") {
		if !slices.Contains(allGroups, g) {
			return fmt.Errorf("-groups: unknown group %q (have %s)", g, strings.Join(allGroups, ","))
		}
		cfg.groups = append(cfg.groups, g)
	}
	if os.Geteuid() != 0 {
		return errors.New("run as root (FUSE passthrough and the tmpfs mount need it): sudo make bench")
	}
	for _, tool := range []string{"fio", pythonBin} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s is missing: apt-get install fio python3-torch", tool)
		}
	}

	b, err := newBench(cfg)
	if err != nil {
		return err
	}
	defer b.close()
	go b.cleanUpOnSignal()
	start := time.Now()
	for _, g := range cfg.groups {
		fmt.Fprintf(os.Stderr, "bench: %s\n", g)
		if err := b.group(g); err != nil {
			return fmt.Errorf("%s: %w", g, err)
		}
	}
	b.elapsed = time.Since(start)
	if err := os.WriteFile(cfg.out, []byte(b.report()), 0o644); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "bench: wrote %s in %s\n", cfg.out, b.elapsed.Round(time.Second))
	return nil
}

// bench is one run: its work directory, binaries and results.
type bench struct {
	cfg     config
	work    string // temporary directory holding mounts and binaries
	tmpfs   string // the tmpfs mounted for the tmpfs and loopback contenders
	bin     string // tensorfs binary
	lbBin   string // loopbackfs binary
	res     results
	elapsed time.Duration
	// mu protects live, the contenders started and not yet stopped.
	mu   sync.Mutex
	live map[*contender]bool
	// torchVersion is what the PyTorch case reported.
	torchVersion string
	// version says which tensorfs was measured.
	version string
	// simTable is the sim group's table ("" if it did not run).
	simTable string
	// loopOptions are the mount options of each loopbackfs contender,
	// as loopbackfs -options lists them, by contender name.
	loopOptions map[string]string
}

func newBench(cfg config) (*bench, error) {
	work, err := os.MkdirTemp("", "tensorfs-bench-")
	if err != nil {
		return nil, err
	}
	b := &bench{cfg: cfg, work: work, tmpfs: filepath.Join(work, "tmpfs"), live: map[*contender]bool{}, loopOptions: map[string]string{}}
	b.res.init()
	b.bin, b.lbBin = cfg.tensorfs, filepath.Join(work, "loopbackfs")
	builds := map[string]string{"./bench/loopbackfs": b.lbBin}
	b.version = "prebuilt " + b.bin
	if b.bin == "" {
		b.bin = filepath.Join(work, "tensorfs")
		builds["./cmd/tensorfs"] = b.bin
		b.version = "built from " + firstLine("git", "describe", "--always", "--dirty")
	}
	for pkg, out := range builds {
		if out, err := exec.Command("go", "build", "-o", out, pkg).CombinedOutput(); err != nil {
			os.RemoveAll(work)
			return nil, fmt.Errorf("go build %s (run from the repository root): %v\n%s", pkg, err, out)
		}
	}
	for name, args := range map[string][]string{loopName: {"-options"}, loopStockName: {"-stock", "-options"}} {
		out, err := exec.Command(b.lbBin, args...).Output()
		if err != nil {
			os.RemoveAll(work)
			return nil, fmt.Errorf("loopbackfs %v: %v", args, err)
		}
		b.loopOptions[name] = strings.TrimSpace(string(out))
	}
	if err := mountTmpfs(b.tmpfs); err != nil {
		os.RemoveAll(work)
		return nil, err
	}
	return b, nil
}

// close unmounts the tmpfs and removes the work directory.
func (b *bench) close() {
	unmountTmpfs(b.tmpfs)
	os.RemoveAll(b.work)
}

// cleanUpOnSignal stops what is mounted and exits on SIGINT or SIGTERM,
// so that an interrupted run leaves no mount behind.
func (b *bench) cleanUpOnSignal() {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	<-sigs
	fmt.Fprintln(os.Stderr, "bench: interrupted, unmounting")
	b.mu.Lock()
	cs := slices.Collect(maps.Keys(b.live))
	b.mu.Unlock()
	b.stop(cs)
	b.close()
	os.Exit(130)
}

func (b *bench) group(name string) error {
	switch name {
	case "io":
		return b.groupIO()
	case "mmap":
		return b.groupMmap()
	case "meta":
		return b.groupMeta()
	case "readdir":
		return b.groupReaddir()
	case "import":
		return b.groupImport()
	case "scale":
		return b.groupScale()
	case "holders":
		return b.groupHolders()
	case "model":
		return b.groupModel()
	case "cluster":
		return b.groupCluster()
	case "sim":
		return b.groupSim()
	default:
		return b.groupTorch()
	}
}

// rounds runs fn for every round and contender. The contenders' order
// rotates by one from round to round and runs backwards in every other
// round, so that each contender comes first once per len(cs) rounds and
// does not always follow the same one.
func (b *bench) rounds(cs []*contender, fn func(c *contender) error) error {
	for r := 0; r < b.cfg.rounds; r++ {
		for i := range cs {
			j := (r + i) % len(cs)
			if r%2 == 1 {
				j = (r + len(cs) - 1 - i) % len(cs)
			}
			if err := fn(cs[j]); err != nil {
				return fmt.Errorf("%s: %w", cs[j].name, err)
			}
		}
	}
	return nil
}

// warmRounds is rounds after one round whose samples are kept apart as
// the warm-up (results.warm) and not counted, so that what a group's setup
// leaves behind (files just written, caches not yet filled) falls on no
// counted round.
func (b *bench) warmRounds(cs []*contender, fn func(c *contender) error) error {
	b.res.warming = true
	for _, c := range cs {
		if err := fn(c); err != nil {
			b.res.warming = false
			return fmt.Errorf("%s, warm-up: %w", c.name, err)
		}
	}
	b.res.warming = false
	return b.rounds(cs, fn)
}
