package lifecycle

import (
	"io"
	"log/slog"
	"sync"
	"time"
)

// What the daemon's log may take: LogRate bytes a second on average, in
// bursts of up to LogBurst. Every refusal is one line (DESIGN.md §15) and
// a user chooses how often to be refused and how long the path it names
// is (64 components of 255 bytes, each escaped to up to four), so without
// a bound one user writes the log (on /run, a tmpfs) at 100 MB a second.
const (
	LogRate  = 16 << 10
	LogBurst = 1 << 20
)

// boundedLog is a writer that passes whole writes (slog writes one record
// at a time) while its bucket of LogRate bytes a second holds them, and
// drops the rest; a write it passes after it dropped some is preceded by
// one line saying how many, at most one such line a second.
type boundedLog struct {
	out     io.Writer
	summary *slog.Logger // writes the dropped-lines line to out itself

	mu      sync.Mutex
	tokens  float64   // bytes that may be written now
	last    time.Time // when tokens was last filled
	dropped int64     // writes dropped since the last line saying so
	bytes   int64     // their bytes
	said    time.Time // when that line was written
}

// BoundLog returns out bounded to LogRate bytes a second (bursts of
// LogBurst), for the daemon's log and the standard logger go-fuse uses.
func BoundLog(out io.Writer) io.Writer {
	return &boundedLog{out: out, summary: slog.New(slog.NewTextHandler(out, nil)), tokens: LogBurst, last: time.Now()}
}

// Write writes p if the bucket holds it, and otherwise drops it, counted;
// a dropped write is no error, so no caller retries it.
func (b *boundedLog) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	b.tokens = min(LogBurst, b.tokens+now.Sub(b.last).Seconds()*LogRate)
	b.last = now
	if float64(len(p)) > b.tokens {
		b.dropped++
		b.bytes += int64(len(p))
		return len(p), nil
	}
	b.tokens -= float64(len(p))
	if b.dropped > 0 && now.Sub(b.said) >= time.Second {
		b.said = now
		b.summary.Warn("log lines dropped: past the log's bound (bytes a second, burst)",
			"lines", b.dropped, "bytes", b.bytes, "rate", LogRate, "burst", LogBurst)
		b.dropped, b.bytes = 0, 0
	}
	return b.out.Write(p)
}
