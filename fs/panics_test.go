package fs

import (
	"bytes"
	"log/slog"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// TestPanicLogBounded: every panic of a request is answered EIO, and
// only the first of a minute is logged, with its stack; the standard
// logger's writer passes one line a second.
func TestPanicLogBounded(t *testing.T) {
	var out bytes.Buffer
	p := &panicLog{log: slog.New(slog.NewTextHandler(&out, nil))}
	for i := 0; i < 100; i++ {
		if st := p.handle("unknown file handle 7"); st != fuse.EIO {
			t.Fatalf("panic %d answered %v, want EIO", i, st)
		}
	}
	if n := strings.Count(out.String(), "\n"); n != 1 || !strings.Contains(out.String(), "goroutine") {
		t.Errorf("100 panics logged %d lines, want one with its stack:\n%s", n, out.String())
	}
}

// TestPanicLogUnknownNode: a request about a node ID the bridge does not
// know is ESTALE, logged once a minute without a stack or the word a
// test harness looks for; any other panic is EIO.
func TestPanicLogUnknownNode(t *testing.T) {
	var out bytes.Buffer
	p := &panicLog{log: slog.New(slog.NewTextHandler(&out, nil))}
	for i := 0; i < 3; i++ {
		if st := p.handle("unknown node 7"); st != fuse.Status(syscall.ESTALE) {
			t.Fatalf("a request about unknown node 7 answered %v, want ESTALE", st)
		}
	}
	if n := strings.Count(out.String(), "\n"); n != 1 || !strings.Contains(out.String(), "node=7") || strings.Contains(out.String(), "goroutine") || strings.Contains(out.String(), "panic") {
		t.Errorf("3 requests about an unknown node logged %d lines, want one naming node 7, without a stack:\n%s", n, out.String())
	}
	for _, v := range []any{"unknown node", "unknown node x", "unknown nodes 7", 7} {
		if _, ok := unknownNode(v); ok {
			t.Errorf("%#v is taken for an unknown node", v)
		}
	}
	p.last = time.Time{}
	if st := p.handle("index out of range"); st != fuse.EIO {
		t.Errorf("another panic answered %v, want EIO", st)
	}
}
