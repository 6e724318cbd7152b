// Command tensorfs mounts and manages tensorfs, a FUSE filesystem whose
// files are shared-memory tensor segments.
package main

import (
	"fmt"
	"io"
	"os"
)

const usage = `usage:
  tensorfs mount [flags] MOUNTPOINT     mount; returns once ready (-f: stay in the foreground)
  tensorfs unmount [--purge] MOUNTPOINT unmount; --purge also releases the backing memory
  tensorfs ls [-l] PATH...              segments: size, device, flags, refs, dtype, shape (-l: holders)
  tensorfs import FILE DIR              a .safetensors file into DIR (new or empty), one segment per tensor
  tensorfs export DIR FILE              the tensors under DIR into a .safetensors file
Run "tensorfs mount -h" for the mount flags.
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run executes one tensorfs command and returns its exit status.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	switch args[0] {
	case "mount":
		return runMount(args[1:], stdout, stderr)
	case "unmount", "umount":
		return runUnmount(args[1:], stdout, stderr)
	case "ls":
		return runLs(args[1:], stdout, stderr)
	case "import":
		return runImport(args[1:], stdout, stderr)
	case "export":
		return runExport(args[1:], stdout, stderr)
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	}
	fmt.Fprintf(stderr, "tensorfs: unknown command %q\n%s", args[0], usage)
	return 2
}
