package lifecycle

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

// TestBoundLog: writes past the burst are dropped, and once the bucket
// holds a line again it passes, preceded by one line saying how many
// were dropped.
func TestBoundLog(t *testing.T) {
	var out bytes.Buffer
	start := time.Now()
	w := BoundLog(&out)
	line := []byte(strings.Repeat("x", 1023) + "\n")
	for range 2 * LogBurst / len(line) {
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
	passed := out.Len()
	time.Sleep(time.Duration(2*len(line)) * time.Second / LogRate)
	w.Write([]byte("next\n"))
	rest := out.String()[passed:]
	if !strings.Contains(rest, "log lines dropped") || !strings.Contains(rest, "lines=") || !strings.HasSuffix(rest, "next\n") {
		t.Errorf("after the drop, the log says %q", rest)
	}
}
