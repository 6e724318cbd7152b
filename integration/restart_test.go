package integration

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
)

// TestRestartKeepsClients: a successor takes the live mount over three
// times (tensorfs mount --takeover, what tensorfs restart runs) while a
// client keeps its working directory in the mount and a segment open;
// after each, the client writes and reads through its descriptor, stats
// it, lists its directory and makes a file there with no error, and the
// mount never goes away.
func TestRestartKeepsClients(t *testing.T) {
	forEachMode(t, func(t *testing.T, m *mount) {
		if err := os.MkdirAll(m.path("d"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(m.path("d/f"), []byte("start"), 0o644); err != nil {
			t.Fatal(err)
		}
		client := startTakeover(t, "client", "", m.dir, nil)
		if l := client.next(t, "the open"); l != "ready" {
			t.Fatalf("client: %s", l)
		}
		round := 0
		check := func(when string) {
			t.Helper()
			io.WriteString(client.stdin, "check\n")
			if l := client.next(t, "a check"); l != "ok" {
				t.Fatalf("client %s: %s", when, l)
			}
			round++
		}
		check("before the restarts")
		for i := 0; i < 3; i++ {
			m = m.takeover(t)
			check(fmt.Sprintf("after restart %d", i+1))
		}
		client.stdin.Close()
		for range client.lines {
		} // the client has exited: its descriptor and directory are let go
		for i := 0; i < round; i++ {
			b, err := os.ReadFile(filepath.Join(m.dir, "d", fmt.Sprintf("new%d", i)))
			if want := fmt.Sprintf("round %d", i); err != nil || string(b) != want {
				t.Fatalf("new%d: %q %v, want %q", i, b, err, want)
			}
		}
		if b, err := os.ReadFile(m.path("d/f")); err != nil || string(b) != fmt.Sprintf("round %d", round-1) {
			t.Fatalf("d/f: %q %v", b, err)
		}
	})
}
