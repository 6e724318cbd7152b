package transport

import (
	"bufio"
	"net"
	"sync"
)

// batchSize is how many bytes a batchConn gathers into one write, and
// reads at most with one.
const batchSize = 256 << 10

// batchConn is the TCP connection under a TLS one. Go's TLS writes each
// record (at most 16 KiB) with a write of its own and reads about one
// record a read; a batchConn reads through a buffer of batchSize, and
// between batch and flush gathers the records written into one buffer
// written whenever it fills: a system call per 256 KiB, not per 16 KiB.
type batchConn struct {
	net.Conn
	r *bufio.Reader
	w *[]byte // gathered writes, from writeBufs, between batch and flush; nil outside
}

// newBatchConn returns c with reads through a buffer of readBuf bytes.
func newBatchConn(c net.Conn, readBuf int) *batchConn {
	return &batchConn{Conn: c, r: bufio.NewReaderSize(c, readBuf)}
}

// writeBufs are the buffers writes are gathered in.
var writeBufs = sync.Pool{New: func() any {
	b := make([]byte, 0, batchSize)
	return &b
}}

// Read reads through the connection's buffer.
func (c *batchConn) Read(b []byte) (int, error) { return c.r.Read(b) }

// Write writes b, or gathers it while batching.
func (c *batchConn) Write(b []byte) (int, error) {
	if c.w == nil {
		return c.Conn.Write(b)
	}
	if len(*c.w)+len(b) > cap(*c.w) {
		if err := c.writeGathered(); err != nil {
			return 0, err
		}
	}
	if len(b) > cap(*c.w) {
		return c.Conn.Write(b)
	}
	*c.w = append(*c.w, b...)
	return len(b), nil
}

// batch starts gathering writes.
func (c *batchConn) batch() { c.w = writeBufs.Get().(*[]byte) }

// flush writes what was gathered and stops gathering (if it was).
func (c *batchConn) flush() error {
	if c.w == nil {
		return nil
	}
	err := c.writeGathered()
	writeBufs.Put(c.w)
	c.w = nil
	return err
}

// writeGathered writes the gathered bytes and empties the buffer.
func (c *batchConn) writeGathered() error {
	_, err := c.Conn.Write(*c.w)
	*c.w = (*c.w)[:0]
	return err
}
