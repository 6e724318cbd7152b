package sim

import (
	"os"
	"strconv"
	"testing"
)

func TestRunN(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("SIMN"))
	if n == 0 {
		t.Skip()
	}
	c := Defaults(n)
	if os.Getenv("CHURN") != "" {
		c.Late, c.Die = 0.1, 0.05
	}
	t.Log(Run(c))
}
