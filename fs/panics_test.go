package fs

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// TestPanicLogBounded: every panic of a request is answered EIO, and
// only the first of a minute is logged, with its stack; the standard
// logger's writer passes one line a second.
func TestPanicLogBounded(t *testing.T) {
	var out bytes.Buffer
	p := &panicLog{log: slog.New(slog.NewTextHandler(&out, nil))}
	for i := 0; i < 100; i++ {
		if st := p.handle("unknown node 7"); st != fuse.EIO {
			t.Fatalf("panic %d answered %v, want EIO", i, st)
		}
	}
	if n := strings.Count(out.String(), "\n"); n != 1 || !strings.Contains(out.String(), "goroutine") {
		t.Errorf("100 panics logged %d lines, want one with its stack:\n%s", n, out.String())
	}
}
