package devmem

import (
	"errors"
	"fmt"
	"io"
	"sync"

	"golang.org/x/sys/unix"
)

// MaxLanes bounds the copy operations running at once on a device.
const MaxLanes = 4

// Lane is a pair of equally sized staging buffers (pinned host memory on a
// real device) with the stream that copies them to and from the device.
// One copy operation holds a lane at a time.
type Lane interface {
	Buffers() *[2][]byte
	// Wait returns once the last copy started on buffer i has finished.
	Wait(i int) error
	Close() error
}

// Lanes is a small pool of lanes made on demand, at most max of them.
type Lanes struct {
	newLane func() (Lane, error)
	tokens  chan struct{} // one per lane in use

	mu   sync.Mutex // guards idle
	idle []Lane
}

// NewLanes returns a pool of at most max lanes that newLane makes.
func NewLanes(max int, newLane func() (Lane, error)) *Lanes {
	return &Lanes{newLane: newLane, tokens: make(chan struct{}, max)}
}

// Get returns an idle lane, or a new one; it blocks while max are in use.
func (ls *Lanes) Get() (Lane, error) {
	ls.tokens <- struct{}{}
	ls.mu.Lock()
	if n := len(ls.idle); n > 0 {
		l := ls.idle[n-1]
		ls.idle = ls.idle[:n-1]
		ls.mu.Unlock()
		return l, nil
	}
	ls.mu.Unlock()
	l, err := ls.newLane()
	if err != nil {
		<-ls.tokens
		return nil, err
	}
	return l, nil
}

// Put returns a lane that Get handed out to the pool.
func (ls *Lanes) Put(l Lane) {
	ls.mu.Lock()
	ls.idle = append(ls.idle, l)
	ls.mu.Unlock()
	<-ls.tokens
}

// Close releases the idle lanes.
func (ls *Lanes) Close() error {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	var errs []error
	for _, l := range ls.idle {
		errs = append(errs, l.Close())
	}
	ls.idle = nil
	return errors.Join(errs...)
}

// StagedUpload moves n bytes to the device through the lane's two buffers,
// alternating between them so that filling one overlaps the device copy of
// the other. fill(buf, pos) fills buf with source bytes pos..pos+len(buf);
// put(i, pos, k) starts the copy of buffer i's first k bytes to device
// position pos. It returns once every copy has finished.
func StagedUpload(l Lane, n int64, fill func(buf []byte, pos int64) error, put func(i int, pos int64, k int) error) error {
	bufs := l.Buffers()
	size := int64(len(bufs[0]))
	var pending [2]bool
	var err error
	for pos, i := int64(0), 0; pos < n && err == nil; pos, i = pos+size, 1-i {
		if pending[i] {
			pending[i] = false
			if err = l.Wait(i); err != nil {
				break
			}
		}
		k := min(size, n-pos)
		if err = fill(bufs[i][:k], pos); err != nil {
			break
		}
		if err = put(i, pos, int(k)); err != nil {
			break
		}
		pending[i] = true
	}
	return finish(l, &pending, err)
}

// StagedDownload moves n bytes from the device through the lane's two
// buffers: get(i, pos, k) starts the copy of k device bytes at pos into
// buffer i, drain(buf, pos) consumes them once there, while the next copy
// runs into the other buffer.
func StagedDownload(l Lane, n int64, get func(i int, pos int64, k int) error, drain func(buf []byte, pos int64) error) error {
	bufs := l.Buffers()
	size := int64(len(bufs[0]))
	var pending [2]bool
	var at [2]int64 // device position of each buffer's pending copy
	start := func(i int, pos int64) error {
		if pos >= n {
			return nil
		}
		if err := get(i, pos, int(min(size, n-pos))); err != nil {
			return err
		}
		pending[i], at[i] = true, pos
		return nil
	}
	err := start(0, 0)
	if err == nil {
		err = start(1, size)
	}
	for i := 0; err == nil && pending[i]; i = 1 - i {
		pending[i] = false
		if err = l.Wait(i); err != nil {
			break
		}
		pos := at[i]
		if err = drain(bufs[i][:min(size, n-pos)], pos); err != nil {
			break
		}
		err = start(i, pos+2*size)
	}
	return finish(l, &pending, err)
}

// finish waits for the copies still pending, so that no buffer is reused
// under a running copy, and returns the first error.
func finish(l Lane, pending *[2]bool, err error) error {
	for i, p := range pending {
		if p {
			if werr := l.Wait(i); err == nil {
				err = werr
			}
		}
	}
	return err
}

// CopyFill returns a fill function for StagedUpload that reads src.
func CopyFill(src []byte) func([]byte, int64) error {
	return func(buf []byte, pos int64) error {
		copy(buf, src[pos:])
		return nil
	}
}

// CopyDrain returns a drain function for StagedDownload that writes dst.
func CopyDrain(dst []byte) func([]byte, int64) error {
	return func(buf []byte, pos int64) error {
		copy(dst[pos:], buf)
		return nil
	}
}

// PreadFill returns a fill function for StagedUpload that reads the file fd
// from fileOff on.
func PreadFill(fd int, fileOff int64) func([]byte, int64) error {
	return func(buf []byte, pos int64) error {
		for done := 0; done < len(buf); {
			k, err := unix.Pread(fd, buf[done:], fileOff+pos+int64(done))
			switch {
			case errors.Is(err, unix.EINTR):
				continue
			case err != nil:
				return fmt.Errorf("pread: %w", err)
			case k == 0:
				return fmt.Errorf("file ends at %d: %w", fileOff+pos+int64(done), io.ErrUnexpectedEOF)
			}
			done += k
		}
		return nil
	}
}

// PwriteDrain returns a drain function for StagedDownload that writes the
// file fd from fileOff on.
func PwriteDrain(fd int, fileOff int64) func([]byte, int64) error {
	return func(buf []byte, pos int64) error {
		for done := 0; done < len(buf); {
			k, err := unix.Pwrite(fd, buf[done:], fileOff+pos+int64(done))
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if err != nil {
				return fmt.Errorf("pwrite: %w", err)
			}
			if k == 0 {
				return fmt.Errorf("pwrite: %w", io.ErrShortWrite)
			}
			done += k
		}
		return nil
	}
}
