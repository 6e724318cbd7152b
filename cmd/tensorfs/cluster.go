package main

// tensorfs publish DIR and tensorfs pull DIR: a directory of a mount
// published to the cluster the daemon joined, and pulled from its peers,
// through the mount's control socket (the daemon is the one in the
// cluster), with a progress line on a terminal.

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"tensorfs/alloc"
	"tensorfs/ctl"
)

func runPublish(args []string, stdout, stderr io.Writer) int {
	set := flag.NewFlagSet("tensorfs publish", flag.ContinueOnError)
	if code, ok := parseFlags(set, args, "DIR   (a directory inside a tensorfs mount that joined a cluster)", stdout, stderr); !ok {
		return code
	}
	if set.NArg() != 1 {
		fmt.Fprintln(stderr, "tensorfs publish: want exactly one DIR")
		return 2
	}
	c, rel, err := dialFor(set.Arg(0))
	if err == nil {
		defer c.Close()
		var v string
		if v, err = c.Publish(rel); err == nil {
			fmt.Fprintf(stdout, "published %s: version %s\n", set.Arg(0), v)
			return 0
		}
	}
	fmt.Fprintf(stderr, "tensorfs publish: %s\n", alloc.EscapeText(err.Error()))
	return 1
}

func runPull(args []string, stdout, stderr io.Writer) int {
	set := flag.NewFlagSet("tensorfs pull", flag.ContinueOnError)
	if code, ok := parseFlags(set, args, "DIR   (a published directory inside a tensorfs mount that joined a cluster)", stdout, stderr); !ok {
		return code
	}
	if set.NArg() != 1 {
		fmt.Fprintln(stderr, "tensorfs pull: want exactly one DIR")
		return 2
	}
	dir := set.Arg(0)
	c, rel, err := dialFor(dir)
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs pull: %s\n", alloc.EscapeText(err.Error()))
		return 1
	}
	defer c.Close()
	start := time.Now()
	stop := make(chan struct{})
	drawn := make(chan struct{})
	go func() {
		defer close(drawn)
		if isTerminal(stderr) {
			drawPullProgress(stderr, dir, stop)
		}
	}()
	n, err := c.Pull(rel)
	close(stop)
	<-drawn
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs pull: %s\n", alloc.EscapeText(err.Error()))
		return 1
	}
	secs := time.Since(start).Seconds()
	if n == 0 {
		fmt.Fprintf(stdout, "%s is complete here\n", dir)
		return 0
	}
	fmt.Fprintf(stdout, "pulled %s into %s in %.1fs (%s/s)\n", byteCount(n), dir, secs, humanSize(int64(float64(n)/secs)))
	return 0
}

// dialFor connects to the control socket of the mount that holds dir and
// returns dir's path relative to that mount's root.
func dialFor(dir string) (*ctl.Client, string, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, "", err
	}
	fi, err := os.Stat(abs)
	if err != nil {
		return nil, "", err
	}
	if !fi.IsDir() {
		return nil, "", fmt.Errorf("%s is not a directory", dir)
	}
	for root := abs; ; root = filepath.Dir(root) {
		sock, ok, _ := alloc.GetXattr(root, alloc.AttrSocket)
		if ok {
			rel, err := filepath.Rel(root, abs)
			if err != nil || rel == "." {
				return nil, "", fmt.Errorf("%s is a mount's root; name a directory inside it", dir)
			}
			c, err := ctl.Dial(string(sock))
			return c, rel, err
		}
		if root == "/" {
			return nil, "", errors.New(dir + " is not inside a tensorfs mount")
		}
	}
}

// drawPullProgress draws, until stop closes, the progress of the pull of
// dir that user.tensorfs.cluster shows: "\rpulling DIR  412.0M/1.0G  40%
// 110.0M/s  ETA 5s  3 peers".
func drawPullProgress(w io.Writer, dir string, stop <-chan struct{}) {
	var drew bool
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			if drew {
				fmt.Fprintln(w)
			}
			return
		case <-tick.C:
		}
		v, ok, err := alloc.GetXattr(dir, alloc.AttrCluster)
		var attr struct {
			Pull *struct {
				Bytes, Total int64
				Rate         float64
				ETA          time.Duration
				Peers        int
			} `json:"pull"`
		}
		if err != nil || !ok || json.Unmarshal(v, &attr) != nil || attr.Pull == nil || attr.Pull.Total == 0 {
			continue
		}
		p := attr.Pull
		fmt.Fprintf(w, "\rpulling %s  %s/%s  %3d%%  %s/s  ETA %s  %d peers\x1b[K", dir, humanSize(p.Bytes), humanSize(p.Total),
			p.Bytes*100/p.Total, humanSize(int64(p.Rate)), p.ETA.Round(time.Second), p.Peers)
		drew = true
	}
}
