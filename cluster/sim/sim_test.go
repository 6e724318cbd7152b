package sim

import (
	"testing"
)

func TestRunPrint(t *testing.T) {
	for _, n := range []int{1, 8, 64} {
		r := Run(Defaults(n))
		t.Log(r)
	}
}
