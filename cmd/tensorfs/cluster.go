package main

// tensorfs publish DIR, tensorfs pull DIR and tensorfs unpublish DIR: a
// directory of a mount published to the cluster the daemon joined, pulled
// from its peers and withdrawn,
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
	"syscall"
	"time"

	"tensorfs/alloc"
	"tensorfs/ctl"
)

func runPublish(args []string, stdout, stderr io.Writer) int {
	return runDirOp("publish", "DIR   (a directory inside a tensorfs mount that joined a cluster)", args, stdout, stderr,
		func(c *ctl.Client, dir, rel string) (string, error) {
			v, err := c.Publish(rel)
			return fmt.Sprintf("published %s: version %s", dir, v), err
		})
}

func runUnpublish(args []string, stdout, stderr io.Writer) int {
	return runDirOp("unpublish", "DIR   (a published directory inside a tensorfs mount that joined a cluster)", args, stdout, stderr,
		func(c *ctl.Client, dir, rel string) (string, error) {
			return fmt.Sprintf("unpublished %s: every node removes it", dir), c.Unpublish(rel)
		})
}

// runDirOp runs "tensorfs NAME DIR": op on DIR through its mount's control
// socket, printing what op returns on success.
func runDirOp(name, argsHelp string, args []string, stdout, stderr io.Writer, op func(c *ctl.Client, dir, rel string) (string, error)) int {
	set := flag.NewFlagSet("tensorfs "+name, flag.ContinueOnError)
	if code, ok := parseFlags(set, args, argsHelp, stdout, stderr); !ok {
		return code
	}
	if set.NArg() != 1 {
		fmt.Fprintf(stderr, "tensorfs %s: want exactly one DIR\n", name)
		return 2
	}
	var out string
	mount, err := onDaemon(set.Arg(0), func(string, int, error) {}, func(c *ctl.Client, rel string) (err error) {
		out, err = op(c, set.Arg(0), rel)
		return err
	})
	if err == nil {
		fmt.Fprintln(stdout, out)
		return 0
	}
	fmt.Fprintf(stderr, "tensorfs %s: %s\n", name, alloc.EscapeText(daemonGone(name, mount, set.Arg(0), err).Error()))
	return 1
}

// daemonGone says what to do when err shows that the daemon of the mount
// (at mount, "" if unknown) holding dir went away during `tensorfs name
// dir`: run it again where a daemon serves the mount now (a restart's, or
// one its keeper started after a crash), else mount it again first. Other
// errors are returned as they are.
func daemonGone(name, mount, dir string, err error) error {
	if !wentAway(err) {
		return err
	}
	again := fmt.Sprintf("`tensorfs %s %s`", name, dir)
	if mount == "" {
		return fmt.Errorf("the daemon of the mount holding %s is gone (%w): mount it again with the flags it had (`tensorfs mount --cluster ... MOUNTPOINT`, which cleans up the dead mount), then run %s again", dir, err, again)
	}
	if pid := servingPid(mount); pid != 0 {
		return fmt.Errorf("the daemon of %s went away (%w); daemon %d serves it now (a restart, or its keeper's after a crash): run %s again", mount, err, pid, again)
	}
	return fmt.Errorf("the daemon of %s is gone (%w) and nothing serves the mount: mount it again with the flags it had (`tensorfs mount --cluster ... %s`, which cleans up the dead mount), then run %s again", mount, err, mount, again)
}

// onDaemon runs op with a connection to the daemon of the mount that
// holds dir, and returns that mount's root. If the daemon went away
// meanwhile (tensorfs restart, or its keeper's after a crash), op runs
// once more with the one that serves the mount now, told to retrying
// first: the ops run so do again what they would have done.
func onDaemon(dir string, retrying func(mount string, pid int, err error), op func(c *ctl.Client, rel string) error) (string, error) {
	c, mount, rel, err := dialFor(dir)
	if err != nil {
		return mount, err
	}
	err = op(c, rel)
	c.Close()
	if !wentAway(err) || mount == "" {
		return mount, err
	}
	pid := servingPid(mount)
	if pid == 0 {
		return mount, err
	}
	retrying(mount, pid, err)
	if c, _, rel, err = dialFor(dir); err != nil {
		return mount, err
	}
	defer c.Close()
	return mount, op(c, rel)
}

// wentAway reports whether err shows the daemon's control connection
// ended or refused.
func wentAway(err error) bool {
	return errors.Is(err, ctl.ErrDaemonGone) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOTCONN) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// servingPid returns the pid of the daemon that answers on the control
// socket of the mount at mount, 0 if none does. A mount that answers
// while its socket does not yet is being taken over (a successor serves
// the mount a moment before it listens): its socket gets successorWait.
func servingPid(mount string) int {
	sock, ok, _ := alloc.GetXattr(mount, alloc.AttrSocket)
	if !ok {
		return 0
	}
	return ctl.ServingPid(string(sock), successorWait)
}

// successorWait is how long servingPid waits for the control socket of a
// mount that answers.
const successorWait = 5 * time.Second

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
	start := time.Now()
	stop := make(chan struct{})
	drawn := make(chan struct{})
	go func() {
		defer close(drawn)
		if isTerminal(stderr) {
			drawPullProgress(stderr, dir, stop)
		}
	}()
	// What a daemon that went away pulled is in the backing: the one that
	// serves the mount now pulls the rest.
	var n int64
	mount, err := onDaemon(dir, func(mount string, pid int, err error) {
		fmt.Fprintf(stderr, "tensorfs pull: the daemon of %s went away (%v); daemon %d serves it now: pulling the rest\n", mount, err, pid)
	}, func(c *ctl.Client, rel string) (err error) {
		n, err = c.Pull(rel)
		return err
	})
	close(stop)
	<-drawn
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs pull: %s\n", alloc.EscapeText(daemonGone("pull", mount, dir, err).Error()))
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
// returns that mount's root (once found) and dir's path relative to it.
// A dir that does not exist (yet) is looked for from its parent: the
// daemon says whether it is published (a pull right after a publish
// elsewhere may come before this node made it).
func dialFor(dir string) (c *ctl.Client, mount, rel string, err error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, "", "", err
	}
	fi, err := os.Stat(abs)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, "", "", err
	}
	if err == nil && !fi.IsDir() {
		return nil, "", "", fmt.Errorf("%s is not a directory", dir)
	}
	for root := abs; ; root = filepath.Dir(root) {
		sock, ok, _ := alloc.GetXattr(root, alloc.AttrSocket)
		if ok {
			rel, err := filepath.Rel(root, abs)
			if err != nil || rel == "." {
				return nil, root, "", fmt.Errorf("%s is a mount's root; name a directory inside it", dir)
			}
			c, err := ctl.Dial(string(sock))
			return c, root, rel, err
		}
		if root == "/" {
			return nil, "", "", errors.New(dir + " is not inside a tensorfs mount")
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
