// Command tensorfs-gpu is tensorfs's GPU helper process as a binary of its
// own: `tensorfs-gpu gpu-helper --backend sim|cuda --device N`, started by
// the daemon through gpu.Start with its door (a socket) as file descriptor 3.
//
// It is the only command that imports the cuda backend (gpu/cuda). Build it
// with -tags cuda for that backend (see scripts/cuda-sdk.sh); without the
// tag it serves sim only. gorgonia.org/cu's init exits any process in which
// cuInit fails, which must only ever be this helper.
package main

import (
	"os"

	"tensorfs/gpu"
	"tensorfs/gpu/cuda"
)

func main() {
	args := os.Args[1:]
	if len(args) > 0 && args[0] == "gpu-helper" {
		args = args[1:]
	}
	os.Exit(gpu.HelperMain(args, os.Stderr, cuda.Open))
}
