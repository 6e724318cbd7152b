package integration

import (
	"context"
	"fmt"
	"os"
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

// openAll opens every file named on its standard input at once, a
// thread each, reads a byte of it, and says how many it read.
const openAll = `
import sys, threading
names, ok = sys.stdin.read().split(), []
def one(p):
    try:
        with open(p, "rb") as f:
            if f.read(1):
                ok.append(p)
    except OSError:
        pass
ts = [threading.Thread(target=one, args=(p,)) for p in names]
for t in ts: t.start()
for t in ts: t.join()
print(len(ok), "of", len(names))
`

// TestAttackClusterPullConnections: every open of a published segment not
// here yet is a pull of its own, and each fetched on a connection of its
// own where none was free: bob and nobody, who may read alice's model of
// 600 small segments, opened them all at once on node2 (300 each, each
// within his share of descriptors), whose daemon then dialled
// node1 as many times and kept the connections after; node1's piece
// server held 512 and closed every other for the two minutes it keeps an
// idle one (307 here, on 2 CPUs, from 600 opens; past 512, node3's pull
// of another model only node1 holds failed, as in
// TestAttackClusterPieceServerFlood, for those two minutes).
func TestAttackClusterPullConnections(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 3)
	n1, n2, n3 := tb.node(1), tb.node(2), tb.node(3)
	const segments = 600
	var files []modelFile
	var names []string
	for i := range segments {
		files = append(files, modelFile{fmt.Sprintf("s%03d", i), 4 << 10, uint64(100 + i)})
		names = append(names, filepath.Join(n2, "many", fmt.Sprintf("s%03d", i)))
	}
	for _, dir := range []string{"many", "model"} {
		userTree(t, filepath.Join(n1, dir), userA, 0)
	}
	writeModel(t, filepath.Join(n1, "many"), userA, files...)
	want := writeModel(t, filepath.Join(n1, "model"), userA, modelFile{"a", 4 << 20, 1}, modelFile{"b", 64 << 10, 2})
	for _, dir := range []string{"many", "model"} {
		out, err := tb.tensorfs(userA, "publish", filepath.Join(n1, dir))
		if err != nil {
			t.Fatalf("alice's publish: %v\n%s", err, out)
		}
		waitVersion(t, filepath.Join(n2, dir), versionOf(t, out))
		waitVersion(t, filepath.Join(n3, dir), versionOf(t, out))
	}

	// Two users at once (one alone is bounded by her share of the
	// daemon's descriptors: 545 here, on a limit of 20000; a daemon with a
	// limit of a million gives each some 30000).
	users := []int{userB, 65534}
	outs := make(chan string, len(users))
	for k, uid := range users {
		go func() {
			cmd := asUser(exec.Command(systemPython, "-c", openAll), uid)
			cmd.Stdin = strings.NewReader(strings.Join(names[k*segments/len(users):(k+1)*segments/len(users)], "\n"))
			out, err := cmd.CombinedOutput()
			outs <- fmt.Sprintf("uid %d: %v %s", uid, err, strings.TrimSpace(string(out)))
		}()
	}
	var said []string
	for range users {
		said = append(said, <-outs)
	}
	out := strings.Join(said, "; ")
	ss, _ := exec.Command(tb.script, "exec", tb.dir, "node1", "ss", "-Htn", "state", "established", "( sport = :7070 )").CombinedOutput()
	held := len(strings.Split(strings.TrimSpace(string(ss)), "\n"))
	t.Logf("the users read %s; node1's piece server holds %d connections", out, held)
	// node2's daemon has at most 8 connections to a peer now (node1's
	// server holds 16 of one member's at most); 307 before.
	if held > 16 {
		t.Errorf("node2's daemon holds %d connections to node1 after its users' opens; want at most 8", held)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	defer cancel()
	start := time.Now()
	b, err := exec.CommandContext(ctx, tb.env["TESTBED_TENSORFS"], "pull", filepath.Join(n3, "model")).CombinedOutput()
	if err != nil {
		t.Fatalf("node3's pull after the users' opens on node2: %v after %v\n%s", err, time.Since(start).Round(time.Millisecond), b)
	}
	sameFiles(t, filepath.Join(n3, "model"), want)
}

// TestAttackClusterRestartHeldOff: a handover waits 5 s at most for the
// requests in flight, and an open of a published segment not here yet is
// one until its pull ends: with no holder, after 30 s. alice publishes a
// directory on node1 and removes it there (rm -r: node1 holds it no more,
// the version stays), then opens its segment on node2, again each time
// the open fails: every `tensorfs restart` of node2 by root fails
// ("requests in flight did not finish within 5s"), and holds every
// user's requests off for those 5 s, for as long as she goes on.
// Such a wait is now outside the handover's gate: the handover goes on,
// and the kernel sends the open again to the successor (FUSE 7.40).
func TestAttackClusterRestartHeldOff(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 2)
	stickyScratch(t, tb, 2, "scratch") // as /tmp: alice may remove what she made there
	n1, n2 := filepath.Join(tb.node(1), "scratch"), filepath.Join(tb.node(2), "scratch")
	userTree(t, filepath.Join(n1, "gone"), userA, 0)
	writeModel(t, filepath.Join(n1, "gone"), userA, modelFile{"a", 1 << 20, 1})
	out, err := tb.tensorfs(userA, "publish", filepath.Join(n1, "gone"))
	if err != nil {
		t.Fatalf("alice's publish: %v\n%s", err, out)
	}
	waitVersion(t, filepath.Join(n2, "gone"), versionOf(t, out))
	if out, err := runAs(t, userA, "/", "rm", "-r", filepath.Join(n1, "gone")); err != nil {
		t.Fatalf("alice's rm -r on node1: %v\n%s", err, out)
	}

	open := asUser(exec.Command("cat", filepath.Join(n2, "gone", "a")), userA)
	if err := open.Start(); err != nil {
		t.Fatal(err)
	}
	opened := make(chan error, 1)
	go func() { opened <- open.Wait() }()
	defer func() {
		open.Process.Kill()
		<-opened
	}()
	time.Sleep(time.Second)
	start := time.Now()
	b, err := exec.Command(tb.env["TESTBED_TENSORFS"], "restart", tb.node(2)).CombinedOutput()
	if err != nil {
		t.Fatalf("root's restart of node2 while alice's open waits for a pull with no holder: %v after %v\n%s", err, time.Since(start).Round(time.Millisecond), b)
	}
	t.Logf("the restart took %v: %s", time.Since(start).Round(time.Millisecond), strings.TrimSpace(string(b)))
	// The successor answers her open: no holder, once its pull has waited.
	select {
	case err := <-opened:
		if err == nil {
			t.Error("alice's open of a segment no node holds read it")
		}
		opened <- err
	case <-time.After(60 * time.Second):
		t.Error("alice's open, sent again to the successor, had no answer in 60 s")
	}
	if _, err := os.Stat(filepath.Join(tb.node(2), "scratch")); err != nil {
		t.Errorf("node2 after the restart: %v", err)
	}
}
