// Command tensorfs-testbed runs the parts of a cluster test bed
// (scripts/cluster.sh) that are not the tensorfs daemon: etcd, and a node
// that publishes or pulls plain files through package cluster, for the
// test bed's tests and measurements before the daemon joins clusters.
//
//	tensorfs-testbed etcd -dir DIR -listen HOST:PORT -ca F -cert F -key F
//	tensorfs-testbed node [flags] publish NAME SRCDIR
//	tensorfs-testbed node [flags] pull NAME OUTDIR
//
// A node prints one JSON line on stdout when its publish or pull is done,
// and another when it stops (SIGTERM/SIGINT) with what it served. It keeps
// serving until then (a puller with -exit leaves at once).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/cluster"
	"tensorfs/cluster/internal/etcdtest"
	"tensorfs/cluster/transport"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: tensorfs-testbed etcd|node ...")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "etcd":
		err = runEtcd(os.Args[2:])
	case "node":
		err = runNode(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q: want etcd or node", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "tensorfs-testbed:", err)
		os.Exit(1)
	}
}

// runEtcd runs a single-member etcd until SIGTERM.
func runEtcd(args []string) error {
	fl := flag.NewFlagSet("etcd", flag.ExitOnError)
	dir := fl.String("dir", "", "data directory")
	listen := fl.String("listen", "", "client address, host:port")
	ca := fl.String("ca", "", "cluster CA (PEM)")
	cert := fl.String("cert", "", "etcd's certificate (PEM)")
	key := fl.String("key", "", "etcd's key (PEM)")
	fl.Parse(args)
	host, _, err := net.SplitHostPort(*listen)
	if err != nil {
		return err
	}
	log, err := zap.NewProduction(zap.IncreaseLevel(zap.WarnLevel))
	if err != nil {
		return err
	}
	s, err := etcdtest.Start(*dir, *listen, net.JoinHostPort(host, "2380"), etcdtest.TLS{CA: *ca, Cert: *cert, Key: *key}, log)
	if err != nil {
		return err
	}
	fmt.Fprintln(os.Stderr, "etcd ready at", s.ClientURL)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	select {
	case <-sig:
	case err = <-s.Err():
	}
	s.Stop()
	return err
}

// runNode joins the cluster and publishes or pulls.
func runNode(args []string) error {
	fl := flag.NewFlagSet("node", flag.ExitOnError)
	endpoint := fl.String("etcd", "", "etcd client URL")
	name := fl.String("node", "", "node name")
	listen := fl.String("listen", "", "piece server address, host:port")
	ca := fl.String("ca", "", "cluster CA (PEM)")
	cert := fl.String("cert", "", "this node's certificate (PEM)")
	key := fl.String("key", "", "this node's key (PEM)")
	pieceSize := fl.Int64("piece-size", cluster.DefaultPieceSize, "piece size of what this node publishes")
	parallel := fl.Int("parallel", cluster.DefaultParallel, "pieces in flight in a pull")
	perPeer := fl.Int("per-peer", cluster.DefaultPerPeer, "pieces in flight from one peer")
	exit := fl.Bool("exit", false, "leave once the pull is done instead of serving")
	verbose := fl.Bool("v", false, "log debug messages")
	fl.Parse(args)
	if fl.NArg() != 3 || fl.Arg(0) != "publish" && fl.Arg(0) != "pull" {
		return fmt.Errorf("node: want publish NAME SRCDIR or pull NAME OUTDIR")
	}
	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})).With("node", *name)
	creds, err := transport.LoadCredentials(*ca, *cert, *key)
	if err != nil {
		return err
	}
	n, err := cluster.Join(cluster.Config{
		Endpoints: []string{*endpoint}, Node: *name, Listen: *listen, Credentials: creds,
		PieceSize: *pieceSize, Parallel: *parallel, PerPeer: *perPeer, Log: log,
	})
	if err != nil {
		return err
	}
	defer n.Close()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	out := json.NewEncoder(os.Stdout)
	switch fl.Arg(0) {
	case "publish":
		info, err := publish(ctx, n, fl.Arg(1), fl.Arg(2))
		if err != nil {
			return err
		}
		out.Encode(map[string]any{"published": info.Dir, "version": info.Version})
	case "pull":
		res, err := pull(ctx, n, fl.Arg(1), fl.Arg(2), log)
		if err != nil {
			return err
		}
		out.Encode(res)
		if *exit {
			return nil
		}
	}
	<-ctx.Done()
	st := n.Stats()
	return out.Encode(map[string]any{"node": *name, "served_bytes": st.BytesServed, "served_pieces": st.PiecesServed,
		"fetched_bytes": st.BytesFetched, "bad_pieces": st.BadPieces, "failed_fetches": st.FailedFetches})
}

// publish publishes the files and directories under src as name.
func publish(ctx context.Context, n *cluster.Node, name, src string) (cluster.DirInfo, error) {
	var entries []cluster.LocalEntry
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		e, err := localEntry(p, filepath.ToSlash(rel), d.IsDir())
		if err != nil {
			return err
		}
		entries = append(entries, e)
		return nil
	})
	if err != nil {
		return cluster.DirInfo{}, err
	}
	return n.Publish(ctx, name, entries)
}

// localEntry describes one file or directory from its stat and xattrs.
func localEntry(path, rel string, dir bool) (cluster.LocalEntry, error) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return cluster.LocalEntry{}, err
	}
	e := cluster.LocalEntry{Entry: cluster.Entry{Path: rel, Mode: st.Mode, UID: st.Uid, GID: st.Gid, Mtime: st.Mtim.Nano()}}
	layout, err := alloc.ReadLayout(path)
	if err != nil {
		return e, err
	}
	e.Dtype, e.Shape, e.Stride, e.StorageOffset = layout.Dtype, layout.Shape, layout.Stride, layout.Offset
	names, err := alloc.Listxattr(path)
	if err != nil {
		return e, err
	}
	for _, attr := range names {
		if !strings.HasPrefix(attr, "user.") || alloc.TensorAttr(attr) || strings.HasPrefix(attr, "user.tensorfs.") {
			continue
		}
		v := make([]byte, 64<<10)
		k, err := unix.Getxattr(path, attr, v)
		if err != nil {
			return e, err
		}
		if e.Xattrs == nil {
			e.Xattrs = map[string][]byte{}
		}
		e.Xattrs[attr] = v[:k]
	}
	if !dir {
		f, err := os.Open(path)
		if err != nil {
			return e, err
		}
		e.Size, e.Data = st.Size, f // open until the process ends: it is served
	}
	return e, nil
}

// pullResult is what a pull prints when done.
type pullResult struct {
	Node    string           `json:"node"`
	Bytes   int64            `json:"bytes"`
	Seconds float64          `json:"seconds"`
	MBps    float64          `json:"mbytes_per_s"`
	ByPeer  map[string]int64 `json:"by_peer"`
}

// pull pulls the current version of name into out, logging progress
// every second.
func pull(ctx context.Context, n *cluster.Node, name, out string, log *slog.Logger) (pullResult, error) {
	info, err := n.Lookup(ctx, name)
	if err != nil {
		return pullResult{}, err
	}
	v, err := n.Version(ctx, info.Version)
	if err != nil {
		return pullResult{}, err
	}
	var jobs []cluster.Job
	for _, e := range v.Entries {
		p := filepath.Join(out, filepath.FromSlash(e.Path))
		if e.IsDir() {
			if err := os.MkdirAll(p, 0o755); err != nil {
				return pullResult{}, err
			}
			continue
		}
		f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
		if err != nil {
			return pullResult{}, err
		}
		if err := f.Truncate(e.Size); err != nil {
			return pullResult{}, err
		}
		jobs = append(jobs, cluster.Job{Content: v.Contents[e.Content], Dst: f})
	}
	p, err := n.Pull(ctx, jobs)
	if err != nil {
		return pullResult{}, err
	}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	done := make(chan error, 1)
	go func() { done <- p.Wait() }()
	for {
		select {
		case <-tick.C:
			pr := p.Progress()
			log.Info("pull", "progress", pr.String(), "from", pr.ByPeer)
		case err := <-done:
			if err != nil {
				return pullResult{}, err
			}
			if err := applyMeta(out, v); err != nil {
				return pullResult{}, err
			}
			pr := p.Progress()
			return pullResult{Node: n.Name(), Bytes: pr.Total, Seconds: pr.Elapsed.Seconds(),
				MBps: float64(pr.Total) / pr.Elapsed.Seconds() / 1e6, ByPeer: pr.ByPeer}, nil
		}
	}
}

// applyMeta gives the pulled files and directories their published mode,
// owner, attributes and times (deepest first, so that a directory's mode
// does not stop the writes below it).
func applyMeta(out string, v *cluster.Version) error {
	for i := len(v.Entries) - 1; i >= 0; i-- {
		e := &v.Entries[i]
		p := filepath.Join(out, filepath.FromSlash(e.Path))
		attrs := map[string][]byte{}
		for name, val := range e.Xattrs {
			attrs[name] = val
		}
		for name, val := range map[string]string{alloc.AttrDtype: e.Dtype, alloc.AttrShape: e.Shape, alloc.AttrStride: e.Stride, alloc.AttrOffset: e.StorageOffset} {
			if val != "" {
				attrs[name] = []byte(val)
			}
		}
		for name, val := range attrs {
			if err := unix.Setxattr(p, name, val, 0); err != nil {
				return fmt.Errorf("%s: %s: %w", p, name, err)
			}
		}
		if err := os.Lchown(p, int(e.UID), int(e.GID)); err != nil {
			return err
		}
		if err := os.Chmod(p, os.FileMode(e.Mode&0o777)); err != nil {
			return err
		}
		if err := os.Chtimes(p, e.MtimeTime(), e.MtimeTime()); err != nil {
			return err
		}
	}
	return nil
}
