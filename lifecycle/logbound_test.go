package lifecycle

import (
	"bytes"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestBoundLog: writes past the burst are dropped, and once the bucket
// holds a line again it passes, preceded by a line saying how many were
// dropped: every line written is either in the log or counted there.
func TestBoundLog(t *testing.T) {
	var out bytes.Buffer
	start := time.Now()
	w := BoundLog(&out)
	line := []byte(strings.Repeat("x", 1023) + "\n")
	lines := 2 * LogBurst / len(line)
	for range lines {
		if n, err := w.Write(line); n != len(line) || err != nil {
			t.Fatalf("write: %d, %v", n, err)
		}
	}
	// The burst, what the rate refilled meanwhile (a loaded machine
	// takes a while for the writes), and the line that found room.
	refill := int(time.Since(start).Seconds()*LogRate) + 1
	if out.Len() > LogBurst+refill+len(line) {
		t.Fatalf("%d bytes written past a burst of %d and a refill of %d", out.Len(), LogBurst, refill)
	}
	// A line that found room in the middle (the writes paused for a
	// refill's 62 ms) said the drops before it; the count is said at most
	// once a second, so the next line waits one.
	time.Sleep(time.Second + time.Duration(2*len(line))*time.Second/LogRate)
	w.Write([]byte("next\n"))
	log := out.String()
	if !strings.HasSuffix(log, "next\n") {
		t.Errorf("the log does not end with the line written last: %q", log[max(0, len(log)-300):])
	}
	passed, counted := strings.Count(log, string(line)), 0
	for _, m := range regexp.MustCompile(`log lines dropped.* lines=(\d+) `).FindAllStringSubmatch(log, -1) {
		n, _ := strconv.Atoi(m[1])
		counted += n
	}
	if counted == 0 || passed+counted != lines {
		t.Errorf("of %d lines written, %d are in the log and %d counted as dropped", lines, passed, counted)
	}
}
