package fs

import (
	"log/slog"
	"runtime"
	"sync"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// A request that panics in go-fuse is answered EIO, and what it logs is
// bounded: the bridge panics on a node ID it does not know, which a
// successor meets for a node the kernel held from an earlier daemon and
// that no name, handle or handed-over file let it register (a directory
// removed while it was a process's working directory). go-fuse's own
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
// unless one was logged less than panicEvery ago, and answers EIO.
func (p *panicLog) handle(v any) fuse.Status {
	p.mu.Lock()
	defer p.mu.Unlock()
	if time.Since(p.last) < panicEvery {
		p.skipped++
		return fuse.EIO
	}
	buf := make([]byte, 16<<10)
	buf = buf[:runtime.Stack(buf, false)]
	p.log.Error("a request panicked; answered EIO (one such line a minute at most)", "panic", v, "not_logged_since", p.skipped, "stack", string(buf))
	p.last, p.skipped = time.Now(), 0
	return fuse.EIO
}
