package main

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestVersion: --version prints the module version, what it knows of the
// commit and the Go release on one line.
func TestVersion(t *testing.T) {
	code, out, errOut := runCLI("--version")
	if code != 0 || errOut != "" || !strings.HasPrefix(out, "tensorfs ") || !strings.Contains(out, "commit ") ||
		!strings.HasSuffix(out, "\n") || strings.Count(out, "\n") != 1 || !strings.Contains(out, ", go1.") {
		t.Errorf("--version = %d %q %q", code, out, errOut)
	}
}

// TestStatusOutside: status of a directory that is no mount says where it
// is, exit 1; --json reports the same as an error field.
func TestStatusOutside(t *testing.T) {
	dir := t.TempDir()
	code, out, errOut := runCLI("status", dir)
	if code != 1 || out != "" || !strings.Contains(errOut, dir+" is not in a tensorfs mount") {
		t.Errorf("status %s = %d %q %q", dir, code, out, errOut)
	}
	code, out, _ = runCLI("status", "--json", dir)
	if code != 1 || !strings.Contains(out, `"error": "`+dir+` is not in a tensorfs mount`) {
		t.Errorf("status --json %s = %d %q", dir, code, out)
	}
}

// TestStatusCluster: the CLUSTER column names the node and its address,
// and says "not joined" while the daemon's stats say why it is not.
func TestStatusCluster(t *testing.T) {
	var reports []statusReport
	for _, raw := range []string{
		`{"cluster": {"node": "node1", "addr": "10.0.0.1:7070", "joined": true}}`,
		`{"cluster": {"node": "node2", "addr": "10.0.0.2:7070", "joined": false, "not_joined": "node name in use"}}`,
	} {
		var r statusReport
		if err := json.Unmarshal([]byte(raw), &r.stats); err != nil {
			t.Fatal(err)
		}
		r.Mountpoint = "/mnt/" + r.stats.Cluster.Node
		reports = append(reports, r)
	}
	var b strings.Builder
	writeStatusTable(&b, reports)
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 3 || !strings.HasSuffix(lines[1], "node1 (10.0.0.1:7070)") || !strings.HasSuffix(lines[2], "node2 (10.0.0.2:7070) not joined") {
		t.Errorf("status table:\n%s", b.String())
	}
}
