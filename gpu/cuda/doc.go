// Package cuda is the cuda backend of package gpu: a gpu.Device on a real
// GPU through gorgonia.org/cu, plus small cgo shims for what cu lacks (IPC
// handles, interprocess events, pinned host memory, virtual memory
// management). It shares its block table and staging lanes with the sim
// backend (gpu/internal/devmem).
//
// gorgonia.org/cu links libcuda, and its init calls cuInit and exits the
// process when that fails. So this package is built for real only with
// -tags cuda, and only the helper binary gpu/cmd/tensorfs-gpu imports it:
// no build of the tensorfs daemon links CUDA, tag or no tag. Without the
// tag, Open reports that the backend is not built in.
// scripts/cuda-sdk.sh provides the headers and the link stub to vet and
// build it on a machine without CUDA.
package cuda
