package main

import (
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
