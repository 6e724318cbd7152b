package lifecycle

import (
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// capsChildMain is this test binary run with LIFECYCLE_TEST_DROP set to a
// capability's number: it says its pid, drops the capability, and says
// its pid again with the capability sets of every thread.
func capsChildMain(c int) int {
	fmt.Printf("before pid=%d\n", os.Getpid())
	if err := DropCapability(c); err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Printf("after pid=%d\n", os.Getpid())
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	for _, t := range tasks {
		b, err := os.ReadFile("/proc/self/task/" + t.Name() + "/status")
		if err != nil {
			continue // the thread exited
		}
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "Cap") {
				fmt.Printf("task %s %s\n", t.Name(), line)
			}
		}
	}
	return 0
}

// TestDropCapability: a root process that drops a capability it has
// executes itself again (same pid) and then lacks it in every set of
// every thread, bounding set included, while keeping the others.
// CAP_NET_RAW stands for the daemon's CAP_SYS_RESOURCE, which a machine
// may not give root at all.
func TestDropCapability(t *testing.T) {
	needRoot(t)
	const c, kept = unix.CAP_NET_RAW, unix.CAP_SYS_ADMIN
	if in, err := unix.PrctlRetInt(unix.PR_CAPBSET_READ, c, 0, 0, 0); err != nil || in == 0 {
		t.Skipf("root has no CAP_NET_RAW here to drop (%v)", err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "-test.run=^$")
	cmd.Env = append(os.Environ(), "LIFECYCLE_TEST_DROP="+strconv.Itoa(c))
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	var before, after string
	threads := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) == 2 && f[0] == "before":
			before = f[1]
		case len(f) == 2 && f[0] == "after":
			after = f[1]
		case len(f) == 4 && f[0] == "task":
			threads[f[1]] = true
			mask, err := strconv.ParseUint(f[3], 16, 64)
			if err != nil {
				t.Fatalf("%q: %v", line, err)
			}
			if mask&(1<<c) != 0 {
				t.Errorf("thread %s still has CAP_NET_RAW: %s", f[1], line)
			}
			if f[2] == "CapEff:" && mask&(1<<kept) == 0 {
				t.Errorf("thread %s lost CAP_SYS_ADMIN too: %s", f[1], line)
			}
		}
	}
	if before == "" || before != after {
		t.Errorf("child said %q before and %q after: want one process, executed again\n%s", before, after, out)
	}
	if len(threads) < 2 {
		t.Errorf("the child reported %d threads; the check means something only for several\n%s", len(threads), out)
	}
}
