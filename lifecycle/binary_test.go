package lifecycle

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// script writes a shell script at p that prints what, mode 0755.
func script(t *testing.T, p, what string) {
	t.Helper()
	if err := os.WriteFile(p, []byte("#!/bin/sh\necho "+what+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
}

// runBinary runs b through its descriptor and returns what it printed.
func runBinary(t *testing.T, b *binary) string {
	t.Helper()
	null, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	out, err := b.command(null).Output()
	if err != nil {
		t.Fatalf("run %s: %v", b.path, err)
	}
	return strings.TrimSpace(string(out))
}

// TestOpenBinary: openBinary takes an executable whose directories all
// belong to root and are writable by root alone (or sticky, as /tmp), and
// runs the inode it checked even once its path names another file; it
// refuses a file or directory of another uid, one writable by others, a
// symbolic link and a relative path, saying which and why.
func TestOpenBinary(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the binaries are given to uid 65534")
	}
	dir := t.TempDir()
	mk := func(rel string, mode os.FileMode, uid int) string {
		t.Helper()
		p := filepath.Join(dir, rel)
		if err := os.Mkdir(p, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil { // past the umask
			t.Fatal(err)
		}
		if err := os.Chown(p, uid, uid); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := filepath.Join(mk("good", 0o755, 0), "bin")
	script(t, good, "checked")
	sticky := filepath.Join(mk("sticky", os.ModeSticky|0o777, 0), "bin")
	script(t, sticky, "sticky")
	open := filepath.Join(mk("open", 0o777, 0), "bin")
	script(t, open, "open")
	theirs := filepath.Join(mk("theirs", 0o755, 65534), "bin")
	script(t, theirs, "theirs")
	owned := filepath.Join(dir, "good", "owned")
	script(t, owned, "owned")
	writable := filepath.Join(dir, "good", "writable")
	script(t, writable, "writable")
	link := filepath.Join(dir, "good", "link")
	err := os.Chown(owned, 65534, 65534)
	if err == nil {
		err = os.Chmod(writable, 0o757)
	}
	if err == nil {
		err = os.Symlink(good, link)
	}
	if err != nil {
		t.Fatal(err)
	}

	b, err := openBinary(good)
	if err != nil {
		t.Fatal(err)
	}
	defer b.f.Close()
	script(t, good+".new", "replaced")
	if err := os.Rename(good+".new", good); err != nil {
		t.Fatal(err)
	}
	if out := runBinary(t, b); out != "checked" {
		t.Errorf("the checked binary, its path replaced since, ran %q", out)
	}
	if b, err := openBinary(sticky); err != nil {
		t.Errorf("a binary of root's in a sticky directory: %v", err)
	} else {
		b.f.Close()
	}

	for _, c := range []struct{ path, why string }{
		{open, "open is writable by group or others (mode 0777)"},
		{theirs, "theirs belongs to uid 65534"},
		{owned, "owned belongs to uid 65534"},
		{writable, "writable is writable by group or others (mode 0757)"},
		{link, "link is a symbolic link"},
		{"bin", "want a clean absolute path"},
	} {
		if b, err := openBinary(c.path); err == nil {
			b.f.Close()
			t.Errorf("%s: accepted", c.path)
		} else if !strings.Contains(err.Error(), c.why) {
			t.Errorf("%s: %v; want it to say %q", c.path, err, c.why)
		}
	}
}
