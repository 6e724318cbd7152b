// Command tensorfs-gpu is tensorfs's GPU helper process as a binary of its
// own: `tensorfs-gpu gpu-helper --backend sim|cuda --device N`, started by
// the daemon through gpu.Start with a socket as file descriptor 3.
//
// Build it with -tags cuda for the cuda backend (see scripts/cuda-sdk.sh),
// and keep the daemon built without: gorgonia.org/cu's init exits any
// process in which cuInit fails, which must only ever be this helper.
package main

import (
	"os"

	"tensorfs/gpu"
)

func main() {
	args := os.Args[1:]
	if len(args) > 0 && args[0] == "gpu-helper" {
		args = args[1:]
	}
	os.Exit(gpu.HelperMain(args, os.Stderr))
}
