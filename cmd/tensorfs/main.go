// Command tensorfs mounts and manages tensorfs, a FUSE filesystem whose
// files are shared-memory tensor segments.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"tensorfs/gpu"
)

const usage = `usage:
  tensorfs mount [flags] MOUNTPOINT     mount; returns once ready (-f: stay in the foreground)
  tensorfs unmount [--purge] MOUNTPOINT unmount; --purge also releases the backing memory
  tensorfs restart [--binary PATH] MOUNTPOINT
                                        a new daemon (this binary or PATH) takes the live mount over
  tensorfs status [--json] [MOUNTPOINT...]
                                        each mount's mode, capacity and use, segments, limbo, requests, daemon
  tensorfs ls [-l] [-R] PATH...         segments: size, device, flags, refs, dtype, shape (-l: holders, -R: subdirectories)
  tensorfs import [--pack-below SIZE] FILE|INDEX|DIR DIR
                                        a .safetensors file or sharded checkpoint into DIR (new or empty), one segment per
                                        tensor (--pack-below: those under SIZE together in DIR/packed.safetensors)
  tensorfs export [--max-shard-size SIZE] [--tied NAME]... DIR FILE|DIR
                                        the tensors under DIR into a .safetensors file, or shards with an index
  tensorfs set DTYPE SHAPE PATH...      give segments a dtype and a (contiguous) shape
  tensorfs show PATH...                 a segment's dtype, shape, stride and offset (a directory: each segment under it)
  tensorfs publish DIR                  DIR becomes a new version of itself on every node of the cluster
  tensorfs pull DIR                     fetch what a published DIR holds from the cluster's nodes
  tensorfs unpublish DIR                withdraw a published DIR: every node removes it (its publisher's uid or root)
  tensorfs --version                    the version and commit of this binary
Run "tensorfs mount -h" for the mount flags. ls, show and set refuse a path outside a
tensorfs mount unless given --allow-outside.
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run executes one tensorfs command and returns its exit status.
func run(args []string, stdout, stderr io.Writer) int {
	if filepath.Base(os.Args[0]) == helperName {
		return runMountHelper(args, stdout, stderr)
	}
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	switch args[0] {
	case "mount":
		return runMount(args[1:], stdout, stderr)
	case "restart":
		return runRestart(args[1:], stdout, stderr)
	case "unmount", "umount":
		return runUnmount(args[1:], stdout, stderr)
	case "status":
		return runStatus(args[1:], stdout, stderr)
	case "ls":
		return runLs(args[1:], stdout, stderr)
	case "import":
		return runImport(args[1:], stdout, stderr)
	case "export":
		return runExport(args[1:], stdout, stderr)
	case "set":
		return runSet(args[1:], stdout, stderr)
	case "show":
		return runShow(args[1:], stdout, stderr)
	case "publish":
		return runPublish(args[1:], stdout, stderr)
	case "pull":
		return runPull(args[1:], stdout, stderr)
	case "unpublish":
		return runUnpublish(args[1:], stdout, stderr)
	case "gpu-helper":
		return gpu.HelperMain(args[1:], stderr, nil)
	case "--version", "version":
		return runVersion(stdout, stderr)
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	}
	fmt.Fprintf(stderr, "tensorfs: unknown command %q\n%s", args[0], usage)
	return 2
}

// parseFlags parses a command's flags. Errors are one line; -h prints the
// usage on stdout. ok is false when the command should exit with code.
func parseFlags(set *flag.FlagSet, args []string, synopsis string, stdout, stderr io.Writer) (code int, ok bool) {
	set.SetOutput(io.Discard)
	err := set.Parse(args)
	switch {
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprintf(stdout, "usage: %s %s\n", set.Name(), synopsis)
		set.SetOutput(stdout)
		set.PrintDefaults()
		return 0, false
	case err != nil:
		fmt.Fprintf(stderr, "%s: %v (see %s -h)\n", set.Name(), err, set.Name())
		return 2, false
	}
	return 0, true
}
