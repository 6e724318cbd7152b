// Command loopbackfs is a benchmark contender, not part of tensorfs: it
// mounts go-fuse's plain LoopbackNode (fusefs.NewLoopbackRoot) over a
// directory so that bench can compare tensorfs's metadata handlers with
// the library's stock ones over the same tmpfs.
//
// By default it is mounted with tensorfs's options (fs/mount.go), so that
// a comparison measures handlers rather than options: 1 s entry,
// attribute and negative timeouts, default_permissions, requests of
// 1 MiB less two pages, symbolic link caching, and the capabilities
// ATOMIC_O_TRUNC, HANDLE_KILLPRIV_V2 and READDIRPLUS_AUTO. With -stock it
// keeps go-fuse's defaults but for the 1 s entry and attribute timeouts,
// default_permissions and 1 MiB writes. Either way it mounts with mount(2)
// as root, and the kernel's FUSE passthrough serves its reads and writes
// (LoopbackFile implements PassthroughFd).
//
//	loopbackfs [-stock] MOUNTPOINT DIR
//	loopbackfs [-stock] -options
//
// prints "ready pid=N mountpoint=MOUNTPOINT" once the mount is usable and
// serves until it is unmounted or gets SIGINT or SIGTERM. With -options
// it prints the mount options, comma-separated, and exits.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// maxRequest is tensorfs's largest read or write request (fs.maxRequest).
const maxRequest = 1<<20 - 8192

func main() {
	stock := flag.Bool("stock", false, "go-fuse's default options rather than tensorfs's")
	list := flag.Bool("options", false, "print the mount options and exit")
	flag.Parse()
	opts, desc := options(*stock)
	if *list {
		fmt.Println(desc)
		return
	}
	if flag.NArg() != 2 {
		fmt.Fprintln(os.Stderr, "usage: loopbackfs [-stock] MOUNTPOINT DIR | loopbackfs [-stock] -options")
		os.Exit(2)
	}
	mp, dir := flag.Arg(0), flag.Arg(1)
	root, err := fusefs.NewLoopbackRoot(dir)
	if err != nil {
		fmt.Fprintf(os.Stderr, "loopbackfs: %v\n", err)
		os.Exit(1)
	}
	srv, err := fusefs.Mount(mp, root, opts)
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

// options returns the mount options, tensorfs's or the stock ones, and a
// list of them for -options.
func options(stock bool) (*fusefs.Options, string) {
	timeout := time.Second
	opts := &fusefs.Options{
		EntryTimeout: &timeout,
		AttrTimeout:  &timeout,
		MountOptions: fuse.MountOptions{
			FsName:      "loopbackfs",
			Name:        "loopbackfs",
			Options:     []string{"default_permissions"},
			DirectMount: os.Geteuid() == 0,
			MaxWrite:    1 << 20,
		},
	}
	desc := []string{"entry_timeout=1s", "attr_timeout=1s", "default_permissions", "max_write=1048576"}
	if stock {
		return opts, strings.Join(desc, ",")
	}
	opts.NegativeTimeout = &timeout
	opts.MaxWrite = maxRequest
	opts.MaxReadAhead = maxRequest
	opts.ExtraCapabilities = fuse.CAP_ATOMIC_O_TRUNC | fuse.CAP_HANDLE_KILLPRIV_V2 | fuse.CAP_READDIRPLUS_AUTO
	opts.EnableSymlinkCaching = true
	desc = []string{"entry_timeout=1s", "attr_timeout=1s", "negative_timeout=1s", "default_permissions",
		fmt.Sprintf("max_write=%d", maxRequest), fmt.Sprintf("max_readahead=%d", maxRequest), "symlink_caching",
		"ATOMIC_O_TRUNC", "HANDLE_KILLPRIV_V2", "READDIRPLUS_AUTO"}
	return opts, strings.Join(desc, ",")
}
