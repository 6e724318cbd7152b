package transfer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

const (
	// chunkSize is the most bytes one job of a worker copies, with one
	// read and one write when the kernel cannot copy: a file's bytes are
	// spread over the workers in chunks this large. Large writes matter
	// on FUSE, where each one costs a round trip to the daemon (the
	// kernel asks for security.capability before it writes).
	chunkSize = 8 << 20
	// workers is the number of copies running at once. More than the
	// CPUs: a copy also waits, on the daemon and on page allocation.
	workers = 4
)

// copier copies byte ranges between files with a few workers: with
// copy_file_range while the kernel can (both files on one filesystem),
// otherwise with reads and writes through a chunk-sized buffer per
// worker. The caller queues pieces in order (add) and collects the outcome
// (wait). After the first error, or once ctx is done, the remaining
// chunks are skipped.
type copier struct {
	ctx      context.Context
	total    int64
	progress func(done, total int64)
	jobs     chan chunk
	workers  sync.WaitGroup
	noCFR    atomic.Bool // copy_file_range failed once: files on different filesystems

	mu   sync.Mutex // guards err and done, and serializes progress calls
	err  error      // the first error
	done int64      // bytes copied
}

// piece is one file's share of the work: its chunks, and what to do once
// they have all been copied or skipped.
type piece struct {
	finish func(error) error
	left   atomic.Int64 // chunks not yet done
	mu     sync.Mutex   // guards err
	err    error        // the first error of its chunks
}

// chunk is one job: n bytes of src at srcOff for dst at dstOff.
type chunk struct {
	p              *piece
	dst, src       *os.File
	dstOff, srcOff int64
	n              int64
}

// newCopier starts the workers of a copy of total bytes; progress may be
// nil.
func newCopier(ctx context.Context, total int64, progress func(done, total int64)) *copier {
	c := &copier{ctx: ctx, total: total, progress: progress, jobs: make(chan chunk, workers)}
	for range workers {
		c.workers.Go(c.work)
	}
	return c
}

// add queues the copy of n bytes of src at srcOff to dst at dstOff.
// finish runs once they are copied, with nil, or once the copy failed or
// was skipped, with the first error; it must close what the caller opened
// for the piece, and what it returns becomes the copier's error if it is
// the first. The files stay in use until then.
func (c *copier) add(dst *os.File, dstOff int64, src *os.File, srcOff, n int64, finish func(error) error) {
	p := &piece{finish: finish}
	k := max(1, (n+chunkSize-1)/chunkSize)
	p.left.Store(k)
	for i := range k {
		off := i * chunkSize
		c.jobs <- chunk{p: p, dst: dst, dstOff: dstOff + off, src: src, srcOff: srcOff + off, n: min(chunkSize, n-off)}
	}
}

// wait waits for every piece to finish and returns the first error. The
// copier cannot be used after.
func (c *copier) wait() error {
	close(c.jobs)
	c.workers.Wait()
	return c.failed()
}

// failed returns the first error so far, errInterrupted once ctx is done.
func (c *copier) failed() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil {
		c.err = interrupted(c.ctx)
	}
	return c.err
}

func (c *copier) fail(err error) {
	c.mu.Lock()
	if c.err == nil {
		c.err = err
	}
	c.mu.Unlock()
}

func (c *copier) work() {
	var buf []byte
	for ch := range c.jobs {
		err := c.failed()
		if err == nil {
			err = c.copy(ch, &buf)
		}
		p := ch.p
		p.mu.Lock()
		if p.err == nil {
			p.err = err
		}
		p.mu.Unlock()
		if p.left.Add(-1) == 0 {
			if err := p.finish(p.err); err != nil {
				c.fail(err)
			}
		}
	}
}

// copy copies one chunk, reporting progress as it goes. buf is the
// worker's buffer, made when first needed.
func (c *copier) copy(ch chunk, buf *[]byte) error {
	for ch.n > 0 {
		if err := interrupted(c.ctx); err != nil {
			return err
		}
		var k int
		var err error
		if !c.noCFR.Load() {
			so, do := ch.srcOff, ch.dstOff
			k, err = unix.CopyFileRange(int(ch.src.Fd()), &so, int(ch.dst.Fd()), &do, int(ch.n), 0)
			if errors.Is(err, unix.EXDEV) || errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS) ||
				errors.Is(err, unix.EINVAL) {
				c.noCFR.Store(true)
				continue
			}
		} else {
			if *buf == nil {
				*buf = make([]byte, chunkSize)
			}
			b := (*buf)[:ch.n]
			k, err = ch.src.ReadAt(b, ch.srcOff)
			if k == len(b) {
				k, err = ch.dst.WriteAt(b, ch.dstOff)
			} else if err == nil || errors.Is(err, io.EOF) {
				k, err = 0, nil
			}
		}
		if err != nil {
			return err
		}
		if k == 0 {
			return fmt.Errorf("source ended %d bytes early", ch.n)
		}
		ch.srcOff += int64(k)
		ch.dstOff += int64(k)
		ch.n -= int64(k)
		c.report(int64(k))
	}
	return nil
}

// report adds n bytes copied and calls progress.
func (c *copier) report(n int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.done += n
	if c.progress != nil {
		c.progress(c.done, c.total)
	}
}
