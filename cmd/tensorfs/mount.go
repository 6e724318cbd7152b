package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	stdlog "log"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/fs"
	"tensorfs/lifecycle"
)

// mountFlags are the flags of "tensorfs mount".
type mountFlags struct {
	foreground    bool
	backing       string
	capacity      string
	inodes        int64
	hugePages     bool
	disk          string
	gpu           string
	allowOther    bool
	debug         bool
	noPassthrough bool
	// kept runs the daemon of a keeper; takeover takes the live mount
	// over from the keeper.
	kept, takeover bool
	// cluster: etcd endpoints (comma-separated), node name, the cluster
	// CA, this node's certificate and key, the piece server's address.
	cluster, node, clusterCA, clusterCert, clusterKey, clusterListen string
	// what one user's publications may take (fs.ClusterBounds): sizes,
	// counts, and the bounds they make.
	etcdQuota, userBytes, nodeBytes   string
	userEntries, userDirs, nodeInodes int64
	keep                              int
	bounds                            fs.ClusterBounds
	// holderWait: how long a pull waits for a holder (0: the default).
	holderWait time.Duration
}

func (m *mountFlags) register(set *flag.FlagSet) {
	set.BoolVar(&m.kept, "kept", false, "serve as the daemon of the keeper on descriptor 3 (the keeper, tensorfs mount -f, runs it so)")
	set.BoolVar(&m.takeover, "takeover", false, "with --kept: take the live mount over from the keeper (after a crash or for tensorfs restart)")
	set.BoolVar(&m.foreground, "f", false, "stay in the foreground")
	set.StringVar(&m.backing, "backing", "", "backing directory (default: a private tmpfs chosen from MOUNTPOINT)")
	set.StringVar(&m.capacity, "capacity", "", "size of the private tmpfs, e.g. 8G")
	set.Int64Var(&m.inodes, "inodes", 0, "inodes of the private tmpfs (default: the kernel's); one user may make a sixteenth")
	set.BoolVar(&m.hugePages, "huge-pages", false, "back segments with 2 MiB pages: mappings fault far less, new segments may write slower (see README)")
	set.StringVar(&m.disk, "disk", "", "directory where SHARED segments live")
	set.StringVar(&m.gpu, "gpu", "none", "GPU backend: none | sim | cuda")
	set.BoolVar(&m.allowOther, "allow-other", false, "let other users in (permissions are always checked by the kernel)")
	set.BoolVar(&m.debug, "debug", false, "log every FUSE request")
	set.BoolVar(&m.noPassthrough, "no-passthrough", false, "serve read/write from the daemon instead of FUSE passthrough")
	set.StringVar(&m.cluster, "cluster", "", "join the cluster whose etcd is at these endpoints (comma-separated URLs, https://HOST:2379)")
	set.StringVar(&m.node, "node", "", "this node's name in the cluster (its certificate carries it)")
	set.StringVar(&m.clusterCA, "cluster-ca", "", "the cluster's CA certificate (PEM)")
	set.StringVar(&m.clusterCert, "cluster-cert", "", "this node's certificate, issued by the cluster CA (PEM)")
	set.StringVar(&m.clusterKey, "cluster-key", "", "this node's private key (PEM)")
	set.StringVar(&m.clusterListen, "cluster-listen", "", "where the piece server listens, HOST:PORT (default: port 7070 on the address etcd is reached from)")
	set.StringVar(&m.etcdQuota, "etcd-quota", "", "etcd's space quota, which sizes the defaults of the --cluster-user-* bounds (default 2G)")
	set.StringVar(&m.userBytes, "cluster-user-bytes", "", "bytes of etcd keys one user's published directories may hold (default: a share of half the etcd quota)")
	set.Int64Var(&m.userEntries, "cluster-user-entries", 0, "entries (segments and directories) of the versions one user's published directories keep (default: a share of the etcd quota)")
	set.Int64Var(&m.userDirs, "cluster-user-dirs", 0, "directories one user may publish (default: a share of the etcd quota)")
	set.IntVar(&m.keep, "cluster-keep", 0, "versions of a published directory kept in etcd, the current one included (default 2)")
	set.DurationVar(&m.holderWait, "cluster-holder-wait", 0, "how long a pull waits, with nothing in flight, for a node holding a piece it lacks before it fails (default 30s)")
	set.Int64Var(&m.nodeInodes, "cluster-node-inodes", 0, "inodes one user's publications may make on this node (default: a share of the backing's inodes)")
	set.StringVar(&m.nodeBytes, "cluster-node-bytes", "", "bytes one user's publications may make on this node (default: a share of the backing's capacity)")
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
	capacity, err := checkMountFlags(&m)
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs mount: %v\n", err)
		return 2
	}
	if m.foreground {
		// The daemon runs without CAP_SYS_RESOURCE (an exec, from here).
		if err := lifecycle.DropCapability(unix.CAP_SYS_RESOURCE); err != nil {
			fmt.Fprintf(stderr, "tensorfs mount: warning: serving with CAP_SYS_RESOURCE, so writes to --disk may use ext4's reserve for root and pass quotas: %v\n", err)
		}
	}
	if m.kept {
		lifecycle.CloseBinaryFd()
	}
	if m.takeover && !m.kept {
		fmt.Fprintln(stderr, "tensorfs mount: --takeover needs --kept; see tensorfs restart")
		return 2
	}
	if m.takeover {
		// The mountpoint is live: nothing to prepare.
	} else if err := lifecycle.Prepare(mp); err != nil {
		fmt.Fprintf(stderr, "tensorfs mount: %v\n", err)
		return 1
	}
	if !m.foreground {
		ready, logPath, err := lifecycle.Start(mp, append([]string{"mount", "-f"}, args...))
		if err != nil {
			fmt.Fprintf(stderr, "tensorfs mount: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "tensorfs: mounted %s (%s; log %s)\n", mp, ready, logPath)
		return 0
	}
	level, out := slog.LevelInfo, lifecycle.BoundLog(stderr)
	if m.debug {
		level, out = slog.LevelDebug, stderr // every request, as asked
	}
	stdlog.SetOutput(out) // go-fuse's
	log := slog.New(slog.NewTextHandler(out, &slog.HandlerOptions{Level: level}))
	cfg := lifecycle.Config{
		Mountpoint:    mp,
		Backing:       m.backing,
		Capacity:      capacity,
		HugePages:     m.hugePages,
		Inodes:        m.inodes,
		Disk:          m.disk,
		GPU:           m.gpu,
		AllowOther:    m.allowOther,
		NoPassthrough: m.noPassthrough,
		Debug:         m.debug,
		Cluster:       clusterConfig(&m),
		Kept:          m.kept,
		Takeover:      m.takeover,
	}
	if m.kept {
		err = lifecycle.Serve(cfg, log, func(string) {}) // the keeper says ready
	} else {
		// The foreground process keeps the mount: it runs the daemon,
		// and a new one when the daemon dies.
		err = lifecycle.Keep(mp, args, log, func(mode string, pid int) {
			fmt.Fprintf(stdout, "ready pid=%d mode=%s mountpoint=%s\n", pid, mode, mp)
		})
	}
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs mount: %v\n", err)
		return 1
	}
	return 0
}

// checkMountFlags checks the flags' values and returns the capacity in
// bytes.
func checkMountFlags(m *mountFlags) (int64, error) {
	switch m.gpu {
	case "none", "sim", "cuda":
	default:
		return 0, fmt.Errorf("--gpu %s: want none, sim or cuda", m.gpu)
	}
	if m.capacity != "" && m.backing != "" {
		return 0, errors.New("--capacity sizes the private tmpfs and cannot be used with --backing")
	}
	if m.inodes < 0 || m.inodes > 0 && m.backing != "" {
		return 0, errors.New("--inodes: want a positive count of the private tmpfs's inodes (not with --backing)")
	}
	if m.hugePages && m.backing != "" {
		return 0, errors.New("--huge-pages sets up the private tmpfs and cannot be used with --backing: mount your tmpfs with -o huge=within_size instead")
	}
	if m.hugePages && os.Geteuid() != 0 {
		return 0, fmt.Errorf("--huge-pages needs root: it sets up a private tmpfs, which only root may mount; as uid %d segments live in /dev/shm", os.Geteuid())
	}
	if err := checkClusterFlags(m); err != nil {
		return 0, err
	}
	if m.capacity != "" && os.Geteuid() != 0 {
		// alloc.Open could only warn in the log: refuse on the terminal instead.
		return 0, fmt.Errorf("--capacity needs root: it sizes a private tmpfs, which only root may mount; "+
			"as uid %d segments live in /dev/shm and share its limit (df -h /dev/shm). Drop --capacity, or mount as root", os.Geteuid())
	}
	capacity, err := parseSize(m.capacity)
	if err != nil {
		return 0, fmt.Errorf("--capacity %w", err)
	}
	return capacity, nil
}

// checkClusterFlags checks the cluster flags: all of them or none.
func checkClusterFlags(m *mountFlags) error {
	if m.cluster == "" {
		if m.node != "" || m.clusterCA != "" || m.clusterCert != "" || m.clusterKey != "" || m.clusterListen != "" {
			return errors.New("--node, --cluster-ca, --cluster-cert, --cluster-key and --cluster-listen go with --cluster ENDPOINTS")
		}
		if m.etcdQuota != "" || m.userBytes != "" || m.nodeBytes != "" || m.userEntries != 0 || m.userDirs != 0 || m.nodeInodes != 0 || m.keep != 0 || m.holderWait != 0 {
			return errors.New("--etcd-quota, --cluster-user-*, --cluster-node-*, --cluster-keep and --cluster-holder-wait go with --cluster ENDPOINTS")
		}
		return nil
	}
	if m.node == "" || m.clusterCA == "" || m.clusterCert == "" || m.clusterKey == "" {
		return errors.New("--cluster needs --node NAME, --cluster-ca FILE, --cluster-cert FILE and --cluster-key FILE (the cluster runs on mutual TLS)")
	}
	if os.Geteuid() != 0 {
		return errors.New("--cluster needs root: segments pulled from a cluster take their published owners")
	}
	return m.parseBounds()
}

// parseBounds reads the cluster bounds' flags into m.bounds.
func (m *mountFlags) parseBounds() error {
	b := &m.bounds
	for _, f := range []struct {
		name, v string
		to      *int64
	}{{"--etcd-quota", m.etcdQuota, &b.EtcdQuota}, {"--cluster-user-bytes", m.userBytes, &b.Bytes}, {"--cluster-node-bytes", m.nodeBytes, &b.NodeBytes}} {
		n, err := parseSize(f.v)
		if err != nil {
			return fmt.Errorf("%s %w", f.name, err)
		}
		*f.to = n
	}
	if m.userEntries < 0 || m.userDirs < 0 || m.nodeInodes < 0 || m.keep < 0 || m.holderWait < 0 {
		return errors.New("--cluster-user-entries, --cluster-user-dirs, --cluster-node-inodes, --cluster-keep and --cluster-holder-wait take positive numbers")
	}
	b.Entries, b.Dirs, b.NodeInodes, b.Keep = m.userEntries, m.userDirs, m.nodeInodes, m.keep
	return nil
}

// clusterConfig returns the cluster the flags name, nil for none.
func clusterConfig(m *mountFlags) *lifecycle.ClusterConfig {
	if m.cluster == "" {
		return nil
	}
	return &lifecycle.ClusterConfig{Endpoints: strings.Split(m.cluster, ","), Node: m.node,
		CA: m.clusterCA, Cert: m.clusterCert, Key: m.clusterKey, Listen: m.clusterListen, Bounds: m.bounds, HolderWait: m.holderWait}
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
		return 0, fmt.Errorf("%q: want a positive size such as 512M or 8G", s)
	}
	return v * mult, nil
}
