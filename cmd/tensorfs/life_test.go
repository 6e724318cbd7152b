package main

import "testing"

func TestFormatHolders(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"", "-"},
		{"12 python3 1\n", "12:python3(1)"},
		{"12 python3 1\n34 sh 2\n", "12:python3(1),34:sh(2)"},
		// Escaped by the daemon: kept as it is.
		{`12 x\x0a1\x20systemd\x209 1` + "\n", `12:x\x0a1\x20systemd\x209(1)`},
		// A comma would start another holder.
		{"12 a(1),1:init 1\n", `12:a(1)\x2c1:init(1)`},
		// Not from tensorfs: raw bytes are escaped, malformed lines skipped.
		{"12 \x1b[2J 1\n1 systemd 9 x\nsystemd 1 1\n1  9\n", `12:\x1b[2J(1)`},
	} {
		if got := formatHolders(c.in); got != c.want {
			t.Errorf("formatHolders(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestBusyMessage(t *testing.T) {
	for _, c := range []struct {
		held  int
		purge bool
		want  string
	}{
		{2, true, "/m detached; 2 processes still hold files; the daemon (pid 7) purges the backing when the last one exits"},
		{1, false, "/m detached; 1 process still holds files; the daemon (pid 7) serves them until the last one exits"},
		{0, true, "/m detached; its files are still in use; the daemon (pid 7) purges the backing when the last one exits"},
	} {
		if got := busyMessage("/m", 7, c.held, c.purge); got != "tensorfs unmount: "+c.want {
			t.Errorf("busyMessage(held %d, purge %v) = %q", c.held, c.purge, got)
		}
	}
}
