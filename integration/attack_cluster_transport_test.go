package integration

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// holdConnections is a user's program that keeps conns TCP connections
// open to addr (host:port) for secs seconds, opening a new one for each
// the server closes: no TLS, no certificate, nothing sent.
const holdConnections = `
import selectors, socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
want, end = int(sys.argv[2]), time.time() + float(sys.argv[3])
sel, opened = selectors.DefaultSelector(), 0
while time.time() < end:
    while len(sel.get_map()) < want:
        s = socket.socket()
        s.settimeout(1)
        try:
            s.connect((host, int(port)))
        except OSError:
            s.close()
            break
        sel.register(s, selectors.EVENT_READ)
        opened += 1
    for key, _ in sel.select(0.05):
        try:
            gone = key.fileobj.recv(4096) == b""
        except OSError:
            gone = True
        if gone:
            sel.unregister(key.fileobj)
            key.fileobj.close()
print("opened", opened, "connections; held", len(sel.get_map()))
`

// TestAttackClusterPieceServerFlood: bob, a user of node2 with no
// certificate, reaches node1's piece server (10.99.0.1:7070) and keeps
// 600 connections open to it that never begin their handshake, opening
// one anew for each the server closes after its 10 s. The server held
// 512 connections and closed every other as it accepted it, so node3's
// pull of alice's model, which only node1 holds, failed (no holder
// served it for 30 s) for as long as bob went on.
func TestAttackClusterPieceServerFlood(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 3)
	n1, n3 := tb.node(1), tb.node(3)
	userTree(t, filepath.Join(n1, "model"), userA, 0)
	want := writeModel(t, filepath.Join(n1, "model"), userA,
		modelFile{"a", 4 << 20, 1}, modelFile{"b", 4 << 20, 2}, modelFile{"c", 64 << 10, 3})
	out, err := tb.tensorfs(userA, "publish", filepath.Join(n1, "model"))
	if err != nil {
		t.Fatalf("alice's publish: %v\n%s", err, out)
	}
	waitVersion(t, filepath.Join(n3, "model"), versionOf(t, out))

	const secs = 45
	flood := exec.Command(tb.script, "exec", tb.dir, "node2", "setpriv", "--reuid=1001", "--regid=1001", "--clear-groups",
		systemPython, "-c", holdConnections, "10.99.0.1:7070", "600", "45")
	var said strings.Builder
	flood.Stdout, flood.Stderr = &said, &said
	if err := flood.Start(); err != nil {
		t.Fatal(err)
	}
	floodDone := make(chan error, 1)
	go func() { floodDone <- flood.Wait() }()
	defer func() {
		flood.Process.Kill()
		<-floodDone
		t.Logf("bob's flood: %s", strings.TrimSpace(said.String()))
	}()
	time.Sleep(3 * time.Second) // bob holds what the server lets him

	ctx, cancel := context.WithTimeout(context.Background(), (secs-10)*time.Second)
	defer cancel()
	start := time.Now()
	pull := exec.CommandContext(ctx, tb.env["TESTBED_TENSORFS"], "pull", filepath.Join(n3, "model"))
	b, err := pull.CombinedOutput()
	if err != nil {
		t.Fatalf("node3's pull while bob floods node1's piece server: %v after %v\n%s\n%s", err, time.Since(start).Round(time.Millisecond), b, lastLine(tb.log(3), "fetch"))
	}
	t.Logf("node3's pull took %v while bob flooded node1", time.Since(start).Round(time.Millisecond))
	sameFiles(t, filepath.Join(n3, "model"), want)
}
