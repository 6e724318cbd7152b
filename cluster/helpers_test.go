package cluster

import (
	"bytes"
	"context"
	"crypto/rand"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"tensorfs/cluster/transport"
	"tensorfs/internal/etcdtest"
	"tensorfs/internal/testcerts"
)

// testCluster is an etcd (internal/etcdtest) and the certificates of a cluster.
type testCluster struct {
	t    *testing.T
	etcd *etcdtest.Server
	ca   *testcerts.CA
	logs *logBuffer
}

// newTestCluster starts etcd with a fresh cluster CA.
func newTestCluster(t *testing.T) *testCluster {
	t.Helper()
	e, ca, err := etcdtest.StartWithCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Stop)
	return &testCluster{t: t, etcd: e, ca: ca, logs: &logBuffer{t: t}}
}

// creds issues credentials for a node.
func (tc *testCluster) creds(name string) *transport.Credentials {
	f, err := tc.ca.Issue(name, net.IPv4(127, 0, 0, 1))
	if err != nil {
		tc.t.Fatal(err)
	}
	c, err := transport.LoadCredentials(f.CA, f.Cert, f.Key)
	if err != nil {
		tc.t.Fatal(err)
	}
	return c
}

// config is a node's configuration for tests: small pieces, a short lease.
func (tc *testCluster) config(name string) Config {
	return Config{
		Endpoints:   []string{tc.etcd.ClientURL},
		Node:        name,
		Listen:      "127.0.0.1:0",
		Credentials: tc.creds(name),
		LeaseTTL:    2 * time.Second,
		Timeout:     2 * time.Second,
		PieceSize:   64 << 10,
		Log:         slog.New(slog.NewTextHandler(tc.logs, &slog.HandlerOptions{Level: slog.LevelDebug})).With("node", name),
	}
}

// join joins a node and waits until it has joined.
func (tc *testCluster) join(cfg Config) *Node {
	tc.t.Helper()
	n, err := Join(cfg)
	if err != nil {
		tc.t.Fatal(err)
	}
	tc.t.Cleanup(func() { n.Close() })
	if _, err := n.lease(context.Background()); err != nil {
		tc.t.Fatalf("node %s did not join: %v", cfg.Node, err)
	}
	return n
}

// logBuffer collects the nodes' logs and passes them to the test log.
type logBuffer struct {
	t  *testing.T
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b.Write(p)
	l.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

func (l *logBuffer) contains(s string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Contains(l.b.String(), s)
}

// kill stops a node as a crash would: no revoke, its keys stay until the
// lease expires.
func (n *Node) kill() {
	n.mu.Lock()
	n.closed = true
	n.mu.Unlock()
	n.cancel()
	n.tr.Close()
	n.etcd.Close()
	n.wg.Wait()
}

// randomBytes returns n random bytes.
func randomBytes(t testing.TB, n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

// dirEntry and fileEntry build LocalEntries.
func dirEntry(path string) LocalEntry {
	return LocalEntry{Entry: Entry{Path: path, Mode: syscall.S_IFDIR | 0o755, UID: 1000, GID: 1000, Mtime: 1700000000e9}}
}

func fileEntry(path string, data []byte) LocalEntry {
	return LocalEntry{Entry: Entry{Path: path, Mode: syscall.S_IFREG | 0o644, UID: 1000, GID: 1000, Mtime: 1700000001e9, Size: int64(len(data))},
		Data: bytes.NewReader(data)}
}

// dst makes a destination file of size bytes.
func dst(t testing.TB, size int64) *os.File {
	f, err := os.CreateTemp(t.TempDir(), "dst")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	return f
}

// contents reads a file whole.
func contents(t testing.TB, f *os.File) []byte {
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, st.Size())
	if _, err := f.ReadAt(b, 0); err != nil && err != io.EOF {
		t.Fatal(err)
	}
	return b
}

// slowReader delays every read once slowed, so that a pull lasts long
// enough to interrupt.
type slowReader struct {
	r     io.ReaderAt
	delay *atomic.Int64 // nanoseconds
}

func newSlowReader(b []byte) slowReader { return slowReader{bytes.NewReader(b), new(atomic.Int64)} }

func (s slowReader) slow(d time.Duration) { s.delay.Store(int64(d)) }

func (s slowReader) ReadAt(p []byte, off int64) (int, error) {
	time.Sleep(time.Duration(s.delay.Load()))
	return s.r.ReadAt(p, off)
}

// waitFor polls cond until it holds or d passes.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// pullAll pulls every file of v into fresh destinations and returns them
// by path.
func pullAll(t testing.TB, n *Node, v *Version) (*Pull, map[string]*os.File) {
	t.Helper()
	var jobs []Job
	files := map[string]*os.File{}
	for _, e := range v.Entries {
		if e.IsDir() {
			continue
		}
		f := dst(t, e.Size)
		files[e.Path] = f
		jobs = append(jobs, Job{Content: v.Contents[e.Content], Dst: f})
	}
	p, err := n.Pull(context.Background(), jobs)
	if err != nil {
		t.Fatal(err)
	}
	return p, files
}
