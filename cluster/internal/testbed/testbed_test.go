package main

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/cluster/internal/testcerts"
)

// testbed is a test bed brought up by scripts/cluster.sh.
type testbed struct {
	t   *testing.T
	dir string
	env map[string]string
}

// upTestbed brings up n nodes with links of rate, and takes them down at
// the end of the test. Without root or the tools it skips, except under
// CI=true, where it fails.
func upTestbed(t *testing.T, n int, rate string) *testbed {
	unavailable := func(format string, args ...any) {
		t.Helper()
		if os.Getenv("CI") == "true" {
			t.Fatalf("test bed unavailable under CI: "+format, args...)
		}
		t.Skipf("test bed unavailable: "+format, args...)
	}
	if os.Geteuid() != 0 {
		unavailable("network namespaces need root")
	}
	if _, err := exec.LookPath("ip"); err != nil && os.Getenv("CI") != "true" {
		unavailable("no ip (iproute2) on PATH")
	}
	dir := filepath.Join(t.TempDir(), "tb")
	script, err := filepath.Abs("../../../scripts/cluster.sh")
	if err != nil {
		t.Fatal(err)
	}
	tb := &testbed{t: t, dir: dir, env: map[string]string{}}
	out, err := exec.Command(script, "up", fmt.Sprint(n), dir, "--rate", rate).CombinedOutput()
	t.Cleanup(func() {
		if out, err := exec.Command(script, "down", dir).CombinedOutput(); err != nil {
			t.Errorf("cluster.sh down: %v\n%s", err, out)
		}
	})
	if err != nil {
		unavailable("cluster.sh up: %v\n%s", err, out)
	}
	b, err := os.ReadFile(filepath.Join(dir, "testbed.env"))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		k, v, _ := strings.Cut(line, "=")
		tb.env[k] = v
	}
	return tb
}

// node starts the node agent of nodeK in its namespace with args after its
// identity flags; certs overrides the certificate directory ("" for the
// test bed's).
func (tb *testbed) node(k int, certs string, args ...string) *agent {
	if certs == "" {
		certs = tb.env["TESTBED_CERTS"]
	}
	name := fmt.Sprintf("node%d", k)
	argv := append([]string{"exec", tb.dir, name, tb.env["TESTBED_BIN"], "node",
		"-etcd", tb.env["TESTBED_ETCD"], "-node", name, "-listen", fmt.Sprintf("10.99.0.%d:7070", k),
		"-ca", filepath.Join(certs, "ca.pem"), "-cert", filepath.Join(certs, name+".pem"), "-key", filepath.Join(certs, name+"-key.pem")}, args...)
	cmd := exec.Command("../../../scripts/cluster.sh", argv...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		tb.t.Fatal(err)
	}
	a := &agent{t: tb.t, name: name, cmd: cmd, lines: make(chan string, 16), done: make(chan struct{})}
	cmd.Stderr = &a.stderr
	if err := cmd.Start(); err != nil {
		tb.t.Fatal(err)
	}
	go func() {
		s := bufio.NewScanner(stdout)
		for s.Scan() {
			a.lines <- s.Text()
		}
		close(a.lines)
	}()
	go func() {
		a.err = cmd.Wait()
		close(a.done)
	}()
	tb.t.Cleanup(a.stop)
	return a
}

// agent is a running node agent.
type agent struct {
	t      *testing.T
	name   string
	cmd    *exec.Cmd
	stderr lockedBuffer
	lines  chan string
	done   chan struct{}
	err    error
}

// result waits for the agent's next JSON line and decodes it into v.
func (a *agent) result(v any, timeout time.Duration) {
	a.t.Helper()
	select {
	case line, ok := <-a.lines:
		if !ok {
			<-a.done
			a.t.Fatalf("%s exited (%v) without a result:\n%s", a.name, a.err, a.stderr.String())
		}
		if err := json.Unmarshal([]byte(line), v); err != nil {
			a.t.Fatalf("%s: %q: %v", a.name, line, err)
		}
	case <-time.After(timeout):
		a.t.Fatalf("%s: no result after %v:\n%s", a.name, timeout, a.stderr.String())
	}
}

// stop ends the agent with SIGTERM (as cluster.sh exec execs it, the
// signal reaches it) and waits.
func (a *agent) stop() {
	a.cmd.Process.Signal(unix.SIGTERM)
	select {
	case <-a.done:
	case <-time.After(10 * time.Second):
		a.cmd.Process.Kill()
		<-a.done
	}
}

// kill ends the agent with SIGKILL, as a crash.
func (a *agent) kill() {
	a.cmd.Process.Kill()
	<-a.done
}

// lockedBuffer is a bytes.Buffer that a process writes while the test
// reads it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// makeModel writes files of the given sizes under dir/model, with tensor
// attributes and a user xattr, and returns the directory.
func makeModel(t *testing.T, sizes ...int) string {
	root := filepath.Join(t.TempDir(), "model")
	if err := os.MkdirAll(filepath.Join(root, "layers"), 0o755); err != nil {
		t.Fatal(err)
	}
	for i, size := range sizes {
		p := filepath.Join(root, "layers", fmt.Sprintf("%d.weight", i))
		f, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.CopyN(f, rand.Reader, int64(size)); err != nil {
			t.Fatal(err)
		}
		f.Close()
		for name, v := range map[string]string{alloc.AttrDtype: "uint8", alloc.AttrShape: fmt.Sprintf("[%d]", size), "user.origin": "testbed"} {
			if err := unix.Setxattr(p, name, []byte(v), 0); err != nil {
				t.Fatal(err)
			}
		}
	}
	return root
}

// sameTree compares two trees: contents, modes and user xattrs.
func sameTree(t *testing.T, want, got string) {
	t.Helper()
	err := filepath.Walk(want, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(want, p)
		q := filepath.Join(got, rel)
		gi, err := os.Stat(q)
		if err != nil {
			return err
		}
		if gi.Mode() != fi.Mode() || !fi.IsDir() && gi.Size() != fi.Size() {
			return fmt.Errorf("%s: mode %v size %d, want %v %d", rel, gi.Mode(), gi.Size(), fi.Mode(), fi.Size())
		}
		if !fi.IsDir() {
			a, _ := os.ReadFile(p)
			b, _ := os.ReadFile(q)
			if !bytes.Equal(a, b) {
				return fmt.Errorf("%s: contents differ", rel)
			}
		}
		names, err := alloc.Listxattr(p)
		if err != nil {
			return err
		}
		for _, name := range names {
			a, b := make([]byte, 4096), make([]byte, 4096)
			na, _ := unix.Getxattr(p, name, a)
			nb, err := unix.Getxattr(q, name, b)
			if err != nil || !bytes.Equal(a[:na], b[:nb]) {
				return fmt.Errorf("%s: xattr %s: %q, want %q (%v)", rel, name, b[:max(nb, 0)], a[:na], err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

type pulled struct {
	Bytes   int64            `json:"bytes"`
	Seconds float64          `json:"seconds"`
	ByPeer  map[string]int64 `json:"by_peer"`
}

// TestTestbed runs the cluster over the test bed's shaped links: a model
// published on node1 and pulled on node2 and node3 arrives identical
// (bytes, modes, xattrs); a holder killed mid-pull leaves the pull to the
// others; a node without a certificate of the cluster gets nothing.
func TestTestbed(t *testing.T) {
	tb := upTestbed(t, 3, "500mbit") // pulls last 3-4s: time to kill a holder
	src := makeModel(t, 40<<20, 30<<20+3, 1, 0, 60<<20, 70<<20)
	pub := tb.node(1, "", "publish", "model", src)
	var published struct{ Version string }
	pub.result(&published, time.Minute)

	out2 := filepath.Join(t.TempDir(), "node2")
	p2 := tb.node(2, "", "pull", "model", out2)
	var r2 pulled
	p2.result(&r2, time.Minute)
	sameTree(t, src, out2)
	if r2.ByPeer["node1"] != r2.Bytes {
		t.Fatalf("node2 pulled %+v: want everything from node1", r2)
	}
	t.Logf("node2 pulled %d bytes in %.2fs (%.0f MB/s over %s links)", r2.Bytes, r2.Seconds, float64(r2.Bytes)/r2.Seconds/1e6, tb.env["TESTBED_RATE"])

	// node3 pulls from node1 and node2; node2 dies once it has sent a piece.
	out3 := filepath.Join(t.TempDir(), "node3")
	p3 := tb.node(3, "", "-exit", "pull", "model", out3)
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(p3.stderr.String(), "node2:") {
		if time.Now().After(deadline) {
			t.Fatalf("node3 got nothing from node2:\n%s", p3.stderr.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	p2.kill()
	var r3 pulled
	p3.result(&r3, time.Minute)
	sameTree(t, src, out3)
	if r3.ByPeer["node1"] == 0 || r3.ByPeer["node2"] == 0 {
		t.Fatalf("node3 pulled %+v: want pieces from node2 before it died, and the rest from node1\n%s", r3, p3.stderr.String())
	}
	t.Logf("node3, node2 killed once it had sent a piece: %+v", r3)

	// A node with a certificate of another CA is refused by etcd (the
	// transport's tests show peers refusing it too).
	certs := t.TempDir()
	ca, err := testcerts.NewCA(certs, "other")
	if err != nil {
		t.Fatal(err)
	}
	f, err := ca.Issue("node3", net.IPv4(10, 99, 0, 3))
	if err != nil {
		t.Fatal(err)
	}
	for from, to := range map[string]string{f.CA: "ca.pem", f.Cert: "node3.pem", f.Key: "node3-key.pem"} {
		if err := os.Rename(from, filepath.Join(certs, to)); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	intruder := tb.node(3, certs, "-exit", "pull", "model", filepath.Join(t.TempDir(), "intruder"))
	select {
	case <-intruder.done:
	case <-time.After(30 * time.Second):
		t.Fatal("the intruder's pull did not end")
	}
	if intruder.err == nil || !strings.Contains(intruder.stderr.String(), "cluster unavailable") {
		t.Fatalf("intruder: %v\n%s", intruder.err, intruder.stderr.String())
	}
	t.Logf("intruder refused after %v: %s", time.Since(start).Round(time.Millisecond), strings.TrimSpace(intruder.stderr.String()))
}
