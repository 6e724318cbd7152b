//go:build !cuda

package gpu

import "fmt"

// newCUDA reports that this binary has no cuda backend.
func newCUDA(int) (Device, error) {
	return nil, fmt.Errorf("%w: the cuda backend is not built in (build the helper with -tags cuda)", ErrUnavailable)
}
