//go:build !cuda

package cuda

import (
	"fmt"

	"tensorfs/gpu"
)

// Open reports that this binary was built without -tags cuda.
func Open(int) (gpu.Device, error) {
	return nil, fmt.Errorf("%w: the cuda backend is not built in (build tensorfs-gpu with -tags cuda)", gpu.ErrUnavailable)
}
