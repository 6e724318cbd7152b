// Command loopbackfs is a benchmark contender, not part of tensorfs: it
// mounts go-fuse's plain LoopbackNode (fusefs.NewLoopbackRoot) over a
// directory so that bench can compare tensorfs's metadata handlers with
// the library's stock ones over the same tmpfs.
//
// It is mounted the way tensorfs mounts itself: 1 s entry and attribute
// timeouts (go-fuse's defaults too), default_permissions, mount(2)
// directly as root. As root the kernel's FUSE passthrough serves its
// reads and writes too (LoopbackFile implements PassthroughFd).
//
//	loopbackfs MOUNTPOINT DIR
//
// prints "ready pid=N mountpoint=MOUNTPOINT" once the mount is usable and
// serves until it is unmounted or gets SIGINT or SIGTERM.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: loopbackfs MOUNTPOINT DIR")
		os.Exit(2)
	}
	mp, dir := os.Args[1], os.Args[2]
	root, err := fusefs.NewLoopbackRoot(dir)
	if err != nil {
		fmt.Fprintf(os.Stderr, "loopbackfs: %v\n", err)
		os.Exit(1)
	}
	timeout := time.Second
	srv, err := fusefs.Mount(mp, root, &fusefs.Options{
		EntryTimeout: &timeout,
		AttrTimeout:  &timeout,
		MountOptions: fuse.MountOptions{
			FsName:      "loopbackfs",
			Name:        "loopbackfs",
			Options:     []string{"default_permissions"},
			DirectMount: os.Geteuid() == 0,
			MaxWrite:    1 << 20,
		},
	})
	if err != nil {
		fmt.Fprintf(os.Stderr, "loopbackfs: mount %s: %v\n", mp, err)
		os.Exit(1)
	}
	fmt.Printf("ready pid=%d mountpoint=%s\n", os.Getpid(), mp)

	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		<-sigs
		srv.Unmount()
	}()
	srv.Wait()
}
