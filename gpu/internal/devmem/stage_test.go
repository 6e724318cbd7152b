package devmem

import (
	"bytes"
	"errors"
	"fmt"
	"testing"
	"time"
)

// asyncLane copies in goroutines, late, as a device's DMA engine does; a
// pipeline that reused a buffer before waiting for its copy would read or
// write it under the copy (corrupt bytes, and a race report under -race).
type asyncLane struct {
	bufs    [2][]byte
	pending [2]chan struct{}
}

func newAsyncLane(size int) *asyncLane {
	return &asyncLane{bufs: [2][]byte{make([]byte, size), make([]byte, size)}}
}

func (l *asyncLane) Buffers() *[2][]byte { return &l.bufs }
func (l *asyncLane) Close() error        { return nil }

func (l *asyncLane) Wait(i int) error {
	if l.pending[i] != nil {
		<-l.pending[i]
		l.pending[i] = nil
	}
	return nil
}

func (l *asyncLane) start(i int, copy func()) {
	if l.pending[i] != nil {
		panic(fmt.Sprintf("buffer %d reused before its copy was waited for", i))
	}
	done := make(chan struct{})
	l.pending[i] = done
	go func() {
		time.Sleep(time.Millisecond)
		copy()
		close(done)
	}()
}

func TestStaged(t *testing.T) {
	const bufSize = 1000
	for _, n := range []int{0, 1, bufSize - 1, bufSize, bufSize + 1, 2 * bufSize, 5*bufSize + 17} {
		src := pattern(uint64(n), n)
		dev := make([]byte, n)
		l := newAsyncLane(bufSize)
		err := StagedUpload(l, int64(n), CopyFill(src), func(i int, pos int64, k int) error {
			l.start(i, func() { copy(dev[pos:pos+int64(k)], l.bufs[i][:k]) })
			return nil
		})
		if err != nil || !bytes.Equal(dev, src) {
			t.Fatalf("upload of %d bytes: %v, equal %v", n, err, bytes.Equal(dev, src))
		}
		for i := range l.pending {
			if l.pending[i] != nil {
				t.Fatalf("upload of %d bytes returned with copies pending", n)
			}
		}

		got := make([]byte, n)
		err = StagedDownload(l, int64(n), func(i int, pos int64, k int) error {
			l.start(i, func() { copy(l.bufs[i][:k], dev[pos:pos+int64(k)]) })
			return nil
		}, CopyDrain(got))
		if err != nil || !bytes.Equal(got, src) {
			t.Fatalf("download of %d bytes: %v, equal %v", n, err, bytes.Equal(got, src))
		}
	}
}

func TestStagedErrors(t *testing.T) {
	errFill := errors.New("fill failed")
	l := newAsyncLane(10)
	calls := 0
	err := StagedUpload(l, 100, func(buf []byte, pos int64) error {
		if pos == 30 {
			return errFill
		}
		return nil
	}, func(i int, pos int64, k int) error {
		calls++
		l.start(i, func() {})
		return nil
	})
	if !errors.Is(err, errFill) || calls != 3 || l.pending != [2]chan struct{}{} {
		t.Errorf("upload: %v after %d copies, pending %v; want the fill error, 3 copies, none pending", err, calls, l.pending)
	}

	errGet := errors.New("copy failed")
	drained := 0
	err = StagedDownload(l, 100, func(i int, pos int64, k int) error {
		if pos == 40 {
			return errGet
		}
		l.start(i, func() {})
		return nil
	}, func([]byte, int64) error { drained++; return nil })
	if !errors.Is(err, errGet) || drained != 3 || l.pending != [2]chan struct{}{} {
		t.Errorf("download: %v after %d drained, pending %v; want the copy error, 3 drained, none pending", err, drained, l.pending)
	}
}

// pattern returns n bytes that differ with seed.
func pattern(seed uint64, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(seed + uint64(i)*7 + uint64(i>>8))
	}
	return b
}
