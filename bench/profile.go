package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// profileSkip are frames that only wrap others: the request counter,
// closures, and the helpers that run every handler.
var profileSkip = []string{"countingFS", ".func", "(*node).at", "(*node).withDir", "(*node).path"}

// profile runs fn once more, untimed, with perf recording the tensorfs
// daemon, and keeps the tensorfs functions that took the most of the
// daemon's samples, callees included. Without perf it only runs fn.
func (b *bench) profile(c *contender, caseName string, fn func() error) error {
	perf, err := exec.LookPath("perf")
	if err != nil || !c.tensorfs {
		return fn()
	}
	data := filepath.Join(b.work, "perf.data")
	defer os.Remove(data)
	rec := exec.Command(perf, "record", "-q", "-g", "-p", strconv.Itoa(c.pid), "-o", data)
	if err := rec.Start(); err != nil {
		return fn()
	}
	time.Sleep(300 * time.Millisecond) // perf attaches
	err = fn()
	rec.Process.Signal(syscall.SIGINT)
	rec.Wait() // perf ends by the signal
	if err != nil {
		return err
	}
	out, err := exec.Command(perf, "report", "-i", data, "--stdio", "--children", "--sort", "symbol",
		"-g", "none", "--percent-limit", "2").Output()
	if err != nil {
		return nil // a report perf cannot make is not the case's failure
	}
	var top []string
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 4 || !strings.HasPrefix(f[3], "tensorfs/") || skipFrame(f[3]) {
			continue
		}
		name := strings.NewReplacer("tensorfs/", "", "(*", "", ")", "").Replace(f[3])
		top = append(top, name+" "+f[0])
		if len(top) == 6 {
			break
		}
	}
	if len(top) > 0 {
		b.res.profiles = append(b.res.profiles, fmt.Sprintf("%s (%s): %s", caseName, c.name, strings.Join(top, ", ")))
	}
	return nil
}

func skipFrame(sym string) bool {
	for _, s := range profileSkip {
		if strings.Contains(sym, s) {
			return true
		}
	}
	return false
}
