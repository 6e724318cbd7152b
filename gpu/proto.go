package gpu

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"

	"golang.org/x/sys/unix"

	"tensorfs/fdpass"
)

// The helper protocol. Daemon and helper exchange messages over a
// SOCK_SEQPACKET socket pair, one message per packet:
//
//	[0] version (protoVersion)  [1] op  [2] status (replies)  [3] nargs
//	[4:8] request id            then nargs int64 arguments, then data
//
// all integers little-endian. Every request gets one reply with its id and
// op; replies may come out of order, as the helper serves requests
// concurrently. Status 0 is success; any other status names a sentinel
// error (wireErrors) and data holds the error text.
//
// The first request is opHello, with the staging area attached: a memfd
// that both processes map, split into slots of stagingSlot bytes, through
// which CopyIn and CopyOut move their bytes (the socket carries only
// offsets). Its reply carries a pidfd of the helper. CopyFromFile and
// CopyToFile carry the caller's file descriptor and the reply to Export
// carries the exported one, as SCM_RIGHTS.
//
// A helper serves several sessions, one per daemon: the daemon that
// starts it gives it a door (fd 3), a socket on which each session comes
// as one end of a new socket pair. Its blocks outlive a session: each
// carries a tag its daemon gave it (opTag). A successor claims the device
// (opClaim: the other sessions' requests are refused, once those in flight
// are answered) before it lists the blocks (opBlocks), and ends the other
// sessions once it serves the mount (opSettle); should it end first, the
// others are served again. opBye, unanswered, says that the daemon closes
// the device: the helper exits once no session is left.
const protoVersion = 4

const (
	opHello           = 1 + iota // args: staging size; fd: staging memfd. reply args: granularity; data: name NUL backend
	opAlloc                      // args: size. reply args: block id, size
	opAllocExportable            // args: size. reply args: block id, size
	opFree                       // args: block id, size
	opCopyIn                     // args: block id, size, off, staging offset, n
	opCopyOut                    // args: block id, size, off, staging offset, n
	opCopyFromFile               // args: block id, size, off, file offset, n; fd: the file
	opCopyToFile                 // args: block id, size, off, file offset, n; fd: the file
	opIPC                        // args: block id, size. reply data: mem handle, event handle
	opExport                     // args: block id, size. reply fd: the export
	opStats                      // reply args: the Stats fields in order
	opTag                        // args: block id, size; data: the tag
	opClaim                      // refuses every other session's requests, once those in flight are answered
	opSettle                     // ends every other session (after opClaim)
	opBlocks                     // args: the last block id listed. reply data: the next blocks (marshalOwned)
	opBye                        // no reply: the daemon closes the device
)

// opNames name the requests, after the Device methods, for errors and logs.
var opNames = [...]string{
	opHello: "hello", opAlloc: "Alloc", opAllocExportable: "AllocExportable", opFree: "Free",
	opCopyIn: "CopyIn", opCopyOut: "CopyOut", opCopyFromFile: "CopyFromFile", opCopyToFile: "CopyToFile",
	opIPC: "IPC", opExport: "Export", opStats: "Stats",
	opTag: "Tag", opClaim: "Claim", opSettle: "Settle", opBlocks: "Blocks", opBye: "bye",
}

const (
	headerSize = 8
	maxMessage = 64 << 10 // bytes of one message, header included
	maxErrText = 4 << 10  // bytes of error text in a reply
	statusMisc = 255      // an error without a sentinel
)

// wireErrors are the errors a reply's status can name, by index.
var wireErrors = [...]error{
	1: ErrUnavailable,
	2: ErrOutOfMemory,
	3: ErrNotExportable,
	4: ErrNoIPC,
	5: ErrNoBlock,
	6: ErrInvalid,
	7: io.ErrUnexpectedEOF,
}

// errProtocol reports a message that does not follow the protocol.
var errProtocol = errors.New("gpu helper protocol error")

type message struct {
	op     uint8
	status uint8
	id     uint32
	args   []int64
	data   []byte
}

func (m *message) marshal() []byte {
	b := make([]byte, headerSize+8*len(m.args)+len(m.data))
	b[0], b[1], b[2], b[3] = protoVersion, m.op, m.status, uint8(len(m.args))
	binary.LittleEndian.PutUint32(b[4:], m.id)
	for i, a := range m.args {
		binary.LittleEndian.PutUint64(b[headerSize+8*i:], uint64(a))
	}
	copy(b[headerSize+8*len(m.args):], m.data)
	return b
}

func unmarshal(b []byte) (*message, error) {
	if len(b) < headerSize {
		return nil, fmt.Errorf("%w: %d-byte message", errProtocol, len(b))
	}
	if b[0] != protoVersion {
		return nil, fmt.Errorf("%w: version %d, want %d", errProtocol, b[0], protoVersion)
	}
	n := int(b[3])
	if len(b) < headerSize+8*n {
		return nil, fmt.Errorf("%w: %d arguments in %d bytes", errProtocol, n, len(b))
	}
	m := &message{op: b[1], status: b[2], id: binary.LittleEndian.Uint32(b[4:]), args: make([]int64, n)}
	for i := range m.args {
		m.args[i] = int64(binary.LittleEndian.Uint64(b[headerSize+8*i:]))
	}
	m.data = append([]byte(nil), b[headerSize+8*n:]...)
	return m, nil
}

// want checks that m has at least n arguments.
func (m *message) want(n int) error {
	if len(m.args) < n {
		return fmt.Errorf("%w: op %d with %d arguments, want %d", errProtocol, m.op, len(m.args), n)
	}
	return nil
}

// block returns the Block named by the first two arguments.
func (m *message) block() Block { return Block{ID: uint64(m.args[0]), Size: m.args[1]} }

// setError makes m a reply that carries err.
func (m *message) setError(err error) {
	m.status = statusMisc
	for i, e := range wireErrors {
		if e != nil && errors.Is(err, e) {
			m.status = uint8(i)
			break
		}
	}
	text := err.Error()
	if len(text) > maxErrText {
		text = text[:maxErrText]
	}
	m.args, m.data = nil, []byte(text)
}

// err returns the error a reply carries, nil on success.
func (m *message) err() error {
	if m.status == 0 {
		return nil
	}
	e := &remoteError{text: string(m.data)}
	if int(m.status) < len(wireErrors) {
		e.sentinel = wireErrors[m.status]
	}
	return e
}

// remoteError is an error returned by the helper: its text, and its
// sentinel for errors.Is.
type remoteError struct {
	sentinel error
	text     string
}

func (e *remoteError) Error() string { return e.text }
func (e *remoteError) Unwrap() error { return e.sentinel }

// send writes m with the file descriptor fd attached when fd >= 0.
func send(c *net.UnixConn, m *message, fd int) error {
	if fd < 0 {
		return fdpass.Send(c, m.marshal())
	}
	return fdpass.Send(c, m.marshal(), fd)
}

// receiver reads messages from one connection.
type receiver struct{ c *net.UnixConn }

func newReceiver(c *net.UnixConn) *receiver { return &receiver{c: c} }

// receive reads one message and the file descriptor attached to it, or -1.
// It returns io.EOF when the peer has closed the connection.
func (r *receiver) receive() (*message, int, error) {
	msg, err := fdpass.Recv(r.c, maxMessage, 4)
	if err != nil {
		return nil, -1, err
	}
	fd := -1
	if len(msg.FDs) > 0 {
		fd = msg.FDs[0]
		fdpass.Close(msg.FDs[1:])
	}
	m, err := unmarshal(msg.Data)
	if err == nil && (msg.Truncated || msg.FDsTruncated) {
		err = fmt.Errorf("%w: truncated message", errProtocol)
	}
	if err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		return nil, -1, err
	}
	return m, fd, nil
}

// marshalOwned encodes a block of the helper's for opBlocks: its ID and
// size, 1 if exportable, the tag's length (2 bytes) and the tag.
func marshalOwned(o *owned) []byte {
	b := make([]byte, 19, 19+len(o.tag))
	binary.LittleEndian.PutUint64(b, o.block.ID)
	binary.LittleEndian.PutUint64(b[8:], uint64(o.block.Size))
	if o.exportable {
		b[16] = 1
	}
	binary.LittleEndian.PutUint16(b[17:], uint16(len(o.tag)))
	return append(b, o.tag...)
}

// unmarshalOwned decodes the blocks of an opBlocks reply.
func unmarshalOwned(b []byte) ([]Owned, error) {
	var out []Owned
	for len(b) > 0 {
		if len(b) < 19 || len(b) < 19+int(binary.LittleEndian.Uint16(b[17:])) {
			return nil, fmt.Errorf("%w: %d bytes of a block list", errProtocol, len(b))
		}
		n := int(binary.LittleEndian.Uint16(b[17:]))
		out = append(out, Owned{Block: Block{ID: binary.LittleEndian.Uint64(b), Size: int64(binary.LittleEndian.Uint64(b[8:]))},
			Exportable: b[16] == 1, Tag: append([]byte(nil), b[19:19+n]...)})
		b = b[19+n:]
	}
	return out, nil
}
