package fs

import (
	"log/slog"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// A request that panics in go-fuse is answered EIO, and what it logs is
// bounded: the bridge panics on a node ID it does not know, which a
// successor meets for a node the kernel held from an earlier daemon and
// that no name, handle or handed-over file let it register (one whose
// name the dead daemon removed from the backing but had not answered the
// removal of); that one is answered ESTALE. go-fuse's own
// handler logs a stack per request, 2.6 KB each, that any user could
// repeat at will. (The message go-fuse's bridge prints on the standard
// logger before it panics is bounded with the rest of the log:
// lifecycle.BoundLog.)

// panicEvery is how often a panic's stack is logged at most.
const panicEvery = time.Minute

// panicLog logs the panics of requests, at most one every panicEvery.
type panicLog struct {
	log *slog.Logger

	mu      sync.Mutex
	last    time.Time
	skipped int
}

// handle is go-fuse's PanicHandler: it logs the panic and its stack
// unless one was logged less than panicEvery ago, and answers EIO. A
// request about a node ID the bridge does not know (unknownNode) is
// ESTALE, as a stale node's are, and logged without a stack: go-fuse
// panics on it before it changes anything.
func (p *panicLog) handle(v any) fuse.Status {
	p.mu.Lock()
	defer p.mu.Unlock()
	id, unknown := unknownNode(v)
	st := fuse.EIO
	if unknown {
		st = fuse.Status(syscall.ESTALE)
	}
	if time.Since(p.last) < panicEvery {
		p.skipped++
		return st
	}
	if unknown {
		p.log.Warn("a request is about a node this daemon never had (one an earlier daemon gave the kernel and no name, handle or journal record reached); answered ESTALE (one such line a minute at most)", "node", id, "not_logged_since", p.skipped)
	} else {
		buf := make([]byte, 16<<10)
		buf = buf[:runtime.Stack(buf, false)]
		p.log.Error("a request panicked; answered EIO (one such line a minute at most)", "panic", v, "not_logged_since", p.skipped, "stack", string(buf))
	}
	p.last, p.skipped = time.Now(), 0
	return st
}

// unknownNode returns the node ID of v, if v is the panic of go-fuse's
// bridge on a node ID it does not know ("unknown node N", before the
// request changed anything).
func unknownNode(v any) (uint64, bool) {
	s, ok := v.(string)
	if !ok {
		return 0, false
	}
	rest, ok := strings.CutPrefix(s, "unknown node ")
	if !ok {
		return 0, false
	}
	id, err := strconv.ParseUint(rest, 10, 64)
	return id, err == nil
}
