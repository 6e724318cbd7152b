package main

import (
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestParseMountinfo: a mount point's octal escapes are undone, the type
// follows the "-" after the optional fields, and a short line is skipped.
func TestParseMountinfo(t *testing.T) {
	m, ok := parseMountinfo(`55 27 0:46 / /tmp/my\040mnt rw,nosuid shared:1 master:2 - fuse.tensorfs tensorfs rw,user_id=0`)
	if !ok || m.point != "/tmp/my mnt" || m.fsType != fsType || m.dev != unix.Mkdev(0, 46) {
		t.Errorf("parseMountinfo = %+v, %v", m, ok)
	}
	if _, ok := parseMountinfo("55 27 0:46 / /x rw"); ok {
		t.Error("a line without the separator parsed")
	}
}

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
