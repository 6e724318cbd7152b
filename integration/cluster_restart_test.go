package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// nodeKeys returns node k's keys in the test bed's etcd (its node key and
// its holder keys), each with its lease.
func (tb *testbed) nodeKeys(k int) map[string]string {
	tb.t.Helper()
	member := []string{"-etcd", tb.env["TESTBED_ETCD"], "-ca", tb.env["TESTBED_CA"],
		"-cert", tb.env["TESTBED_CERTS"] + "/node1.pem", "-key", tb.env["TESTBED_CERTS"] + "/node1-key.pem"}
	out, err := tb.testbedBin(1, append(append([]string{"keys"}, member...), "/tensorfs/")...)
	if err != nil {
		tb.t.Fatalf("keys: %v\n%s", err, out)
	}
	name := fmt.Sprintf("node%d", k)
	keys := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(line)
		if len(f) == 3 && (f[1] == "/tensorfs/nodes/"+name || strings.HasPrefix(f[1], "/tensorfs/holders/") && strings.HasSuffix(f[1], "/"+name)) {
			keys[f[1]] = f[2]
		}
	}
	return keys
}

// clusterRestartMidPull (TestCluster's bed): node2 publishes two models,
// and node3 pulls each from node2, their one holder, node2's daemon
// restarted (tensorfs restart) in the middle of the first pull and
// SIGKILLed in the middle of the second (its keeper starts another). Both
// pulls complete, byte for byte: node2 serves on, and its node and holder
// keys stay, under the same lease.
func clusterRestartMidPull(t *testing.T, tb *testbed) {
	n2, n3 := tb.node(2), tb.node(3)
	models := map[string]map[string][]byte{}
	versions := map[string]string{}
	for i, name := range []string{"kept1", "kept2"} {
		if err := os.Mkdir(filepath.Join(n2, name), 0o755); err != nil {
			t.Fatal(err)
		}
		var files []modelFile
		for j := range 4 {
			files = append(files, modelFile{fmt.Sprintf("w%d", j), 16 << 20, uint64(40 + 10*i + j)})
		}
		models[name] = writeModel(t, filepath.Join(n2, name), 0, files...)
		versions[name] = versionOf(t, tb.must("publish", filepath.Join(n2, name)))
	}
	before := tb.nodeKeys(2)
	lease := before["/tensorfs/nodes/node2"]
	if len(before) < 2 || lease == "" {
		t.Fatalf("node2's keys in etcd: %v, want its node key and holder keys", before)
	}
	for _, c := range []struct{ model, how string }{{"kept1", "restart"}, {"kept2", "crash"}} {
		waitVersion(t, filepath.Join(n3, c.model), versions[c.model])
		done := make(chan error, 1)
		go func() {
			_, err := tb.tensorfs(0, "pull", filepath.Join(n3, c.model))
			done <- err
		}()
		eventually(t, "node3 fetches from node2", func() (bool, string) {
			a, err := readClusterAttr(filepath.Join(n3, c.model))
			return err == nil && a.Pull != nil && a.Pull.ByPeer["node2"] > 0, fmt.Sprintf("%+v %v", a, err)
		})
		old := daemonPid(t, n2)
		if c.how == "restart" {
			tb.must("restart", n2)
		} else {
			syscall.Kill(old, syscall.SIGKILL)
		}
		if err := <-done; err != nil {
			t.Fatalf("node3's pull of %s with node2's daemon (%s) taken over: %v\n%s", c.model, c.how, err, tail(tb.log(3)))
		}
		sameFiles(t, filepath.Join(n3, c.model), models[c.model])
		if pid := daemonPid(t, n2); pid == old {
			t.Errorf("after a %s, node2's daemon is still %d", c.how, pid)
		}
		// Holder keys written since may join them, under the same lease.
		after := tb.nodeKeys(2)
		for k, l := range after {
			if l != lease {
				t.Errorf("after a %s, node2's key %s has lease %s, want %s, its lease before", c.how, k, l, lease)
			}
		}
		for k := range before {
			if _, ok := after[k]; !ok {
				t.Errorf("after a %s, node2's key %s is gone", c.how, k)
			}
		}
	}
}
