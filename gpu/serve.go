package gpu

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/fdpass"
)

// maxInFlight bounds the requests a helper serves at once.
const maxInFlight = 64

// Pinner is implemented by devices that can page-lock host memory so that
// copies from and to it run at DMA speed without further staging. A
// helper's session pins the shared staging area with it.
type Pinner interface {
	Pin(mem []byte) (unpin func() error, err error)
}

// openBackend makes the device a helper process serves: sim here, cuda
// with openCUDA. Tests replace it to make helpers that misbehave.
var openBackend = func(backend string, index int, openCUDA func(int) (Device, error)) (Device, error) {
	switch {
	case backend == "sim":
		return NewSim(index, 0), nil
	case openCUDA == nil:
		return nil, fmt.Errorf("%w: the cuda backend is not in this binary; it is in tensorfs-gpu (gpu/cmd/tensorfs-gpu)", ErrUnavailable)
	}
	return openCUDA(index)
}

// HelperMain is the helper process: `tensorfs gpu-helper --backend sim|cuda
// --device N`, with args the arguments after "gpu-helper". It opens the
// device and serves each session that comes through its door, file
// descriptor 3 (one end of the socket pair Start made), until none is left
// and nobody can come back (helper.run). Errors go to stderr as one line,
// which Start reports as the reason the GPU is unavailable. It returns the
// exit status: 0 after a clean shutdown, 1 when the device or the door
// fails, 2 on bad arguments.
//
// For tests only, a sim helper reads SimStallEnv (see there) to answer
// some requests late or never, as a hung driver would.
//
// openCUDA opens the cuda backend: cuda.Open (package gpu/cuda) in the
// tensorfs-gpu helper, nil in the daemon, which serves sim only and must
// never link CUDA (see the package doc).
func HelperMain(args []string, stderr io.Writer, openCUDA func(index int) (Device, error)) int {
	set := flag.NewFlagSet("gpu-helper", flag.ContinueOnError)
	set.SetOutput(io.Discard)
	backend := set.String("backend", "", "device backend: sim or cuda")
	index := set.Int("device", 0, "device ordinal")
	if err := set.Parse(args); err != nil {
		fmt.Fprintf(stderr, "gpu-helper: %v (usage: gpu-helper --backend sim|cuda --device N)\n", err)
		return 2
	}
	if set.NArg() > 0 || *index < 0 || (*backend != "sim" && *backend != "cuda") {
		fmt.Fprintf(stderr, "gpu-helper: want --backend sim or --backend cuda, and --device N >= 0; got %q (usage: gpu-helper --backend sim|cuda --device N)\n", args)
		return 2
	}
	var stall map[uint8]time.Duration
	if *backend == "sim" {
		var err error
		if stall, err = parseStall(os.Getenv(SimStallEnv)); err != nil {
			fmt.Fprintf(stderr, "gpu-helper: %s: %v\n", SimStallEnv, err)
			return 2
		}
	}
	dev, err := openBackend(*backend, *index, openCUDA)
	if err != nil {
		fmt.Fprintf(stderr, "gpu-helper: %v\n", err)
		return 1
	}
	defer dev.Close()

	f := os.NewFile(3, "gpu-door")
	c, err := net.FileConn(f)
	f.Close()
	if err != nil {
		fmt.Fprintf(stderr, "gpu-helper: fd 3 is not the daemon's socket: %v\n", err)
		return 1
	}
	door, ok := c.(*net.UnixConn)
	if !ok {
		c.Close()
		fmt.Fprintf(stderr, "gpu-helper: fd 3 is a %T, not a unix socket\n", c)
		return 1
	}
	defer door.Close()
	// The daemon that started the helper may be gone when it writes: a
	// write to its closed output is EPIPE, not the end of the helper.
	signal.Ignore(syscall.SIGPIPE)
	newHelper(dev, stall, stderr).run(door)
	return 0
}

// helper is a helper process: one device, its blocks, and the sessions
// of the daemons that use it. It outlives a daemon (DESIGN.md §12): its
// door, fd 3, is held by the daemon and by its keeper, and each daemon
// opens a session of its own through it (Start, Attach). Blocks are the
// helper's, not a session's: a successor claims them (Claim).
type helper struct {
	dev    Device
	stall  map[uint8]time.Duration
	stderr io.Writer

	mu       sync.Mutex // guards the fields below
	blocks   map[uint64]*owned
	sessions map[*server]bool
	// claimant is the session that claimed the device (claim) until it
	// ends; the others' requests are refused meanwhile.
	claimant *server
	// opened counts the sessions opened: the first is Start's, the
	// others Attach's.
	opened int

	// serving is read-held by every request being served but a claim,
	// which write-holds it to wait for them.
	serving sync.RWMutex
}

// owned is a block the helper handed out, with the tag its daemon gave it.
type owned struct {
	block      Block
	exportable bool
	tag        []byte
}

func newHelper(dev Device, stall map[uint8]time.Duration, stderr io.Writer) *helper {
	return &helper{dev: dev, stall: stall, stderr: stderr, blocks: map[uint64]*owned{}, sessions: map[*server]bool{}}
}

// run serves every session that comes through door until none is left
// and either the last to end that decides said goodbye (a clean Close)
// or the door is closed (no daemon and no keeper holds it any more:
// nobody can come back). A session that ends without a goodbye is a
// daemon that died: its blocks stay for a successor. A successor that
// ends before it ever claimed the device (a takeover that failed or
// gave up) decides nothing: it held nothing, and how the helper ends
// must not hang on whether it saw that end before or after its owner's
// goodbye.
func (h *helper) run(door *net.UnixConn) {
	conns := make(chan *net.UnixConn)
	go func() {
		defer close(conns)
		for {
			c, err := receiveConn(door)
			if err != nil {
				return
			}
			conns <- c
		}
	}()
	ended := make(chan sessionEnd)
	live, bye := 0, false // bye: how the last session that decides ended
	for {
		select {
		case c, ok := <-conns:
			if !ok {
				if live == 0 {
					return
				}
				conns = nil
				continue
			}
			live++
			go func() { ended <- h.session(c) }()
		case e := <-ended:
			if e != endUnclaimed {
				bye = e == endBye
			}
			if live--; live == 0 && (bye || conns == nil) {
				return
			}
		}
	}
}

// receiveConn reads the next session from the door: a message carrying
// one end of a SOCK_SEQPACKET socket pair.
func receiveConn(door *net.UnixConn) (*net.UnixConn, error) {
	for {
		m, err := fdpass.Recv(door, 16, 1)
		if err != nil {
			return nil, err
		}
		if len(m.FDs) != 1 {
			fdpass.Close(m.FDs)
			continue
		}
		f := os.NewFile(uintptr(m.FDs[0]), "gpu-session")
		c, err := net.FileConn(f)
		f.Close()
		if uc, ok := c.(*net.UnixConn); ok {
			return uc, nil
		}
		if err == nil {
			c.Close()
		}
	}
}

// sessionEnd is how a session ended, for run.
type sessionEnd int

const (
	endDied      sessionEnd = iota // no goodbye: its daemon died
	endBye                         // a goodbye: a clean Close
	endUnclaimed                   // a successor's, which never claimed the device
)

// session serves one daemon on c until it closes c or a successor
// settles the device, and reports how it ended. A claimant that ends
// unsettled (it died, or failed to take the mount over) gives the device
// back to the other sessions.
func (h *helper) session(c *net.UnixConn) sessionEnd {
	s := &server{h: h, conn: c, dev: h.dev, stall: h.stall, done: make(chan struct{})}
	h.mu.Lock()
	h.sessions[s] = true
	s.attached = h.opened > 0
	h.opened++
	h.mu.Unlock()
	err := s.serve()
	h.mu.Lock()
	delete(h.sessions, s)
	if h.claimant == s {
		h.claimant = nil
	}
	h.mu.Unlock()
	c.Close()
	close(s.done)
	if err != nil && !s.cut.Load() {
		fmt.Fprintf(h.stderr, "gpu-helper: session: %v\n", err)
	}
	switch {
	case s.attached && !s.claimed.Load():
		return endUnclaimed
	case s.bye.Load():
		return endBye
	}
	return endDied
}

// others returns the sessions but s.
func (h *helper) others(s *server) []*server {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []*server
	for o := range h.sessions {
		if o != s {
			out = append(out, o)
		}
	}
	return out
}

// claim makes s the one session served: the others' requests are refused
// from now on (refused), and claim returns once those in flight are
// answered, so that s alone changes the blocks and they are what it lists.
func (h *helper) claim(s *server) error {
	h.mu.Lock()
	if h.claimant != nil && h.claimant != s {
		h.mu.Unlock()
		return errClaimed
	}
	h.claimant = s
	h.mu.Unlock()
	s.claimed.Store(true)
	h.serving.Lock() // every request in flight is answered
	h.serving.Unlock()
	return nil
}

// settle ends every session but the claimant s, whose daemon now serves
// the mount alone; their requests in flight are answered to nobody. The
// claim ends with it, so that the next successor can claim the device.
func (h *helper) settle(s *server) error {
	h.mu.Lock()
	claimed := h.claimant == s
	h.mu.Unlock()
	if !claimed {
		return fmt.Errorf("%w: settle without a claim", errProtocol)
	}
	for _, o := range h.others(s) {
		o.cut.Store(true)
		o.conn.Close()
		<-o.done
	}
	h.mu.Lock()
	if h.claimant == s {
		h.claimant = nil
	}
	h.mu.Unlock()
	return nil
}

// refused says why s may not be served now: another session claimed the
// device; nil if s may.
func (h *helper) refused(s *server) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.claimant != nil && h.claimant != s {
		return errClaimed
	}
	return nil
}

// errClaimed refuses a session while another claims the device.
var errClaimed = fmt.Errorf("%w: another daemon is taking the device over", ErrUnavailable)

// SimStallEnv names the environment variable that makes a sim helper
// stall, for tests of the daemon's deadlines only: a comma-separated list
// of request kinds (alloc, free, copy, ipc, export, stats, claim, and
// attach: the hello of every session but the first, a successor's), each
// either alone, to never answer such a request, or as KIND=DURATION, to
// answer it that late (e.g. "copy" or "copy=2s,stats"). The cuda helper
// ignores it.
const SimStallEnv = "TENSORFS_GPU_SIM_STALL"

// stallKinds are the request kinds SimStallEnv names, with their ops.
var stallKinds = map[string][]uint8{
	"alloc": {opAlloc, opAllocExportable}, "free": {opFree},
	"copy": {opCopyIn, opCopyOut, opCopyFromFile, opCopyToFile},
	"ipc":  {opIPC}, "export": {opExport}, "stats": {opStats},
	"claim": {opClaim}, "attach": {opHello},
}

// parseStall parses the value of SimStallEnv into how long each op
// stalls; "" is nil.
func parseStall(v string) (map[uint8]time.Duration, error) {
	if v == "" {
		return nil, nil
	}
	stall := map[uint8]time.Duration{}
	for _, item := range strings.Split(v, ",") {
		kind, after, timed := strings.Cut(item, "=")
		d := time.Duration(math.MaxInt64) // never answer
		if timed {
			var err error
			if d, err = time.ParseDuration(after); err != nil || d < 0 {
				return nil, fmt.Errorf("%q: want KIND or KIND=DURATION", item)
			}
		}
		ops, ok := stallKinds[kind]
		if !ok {
			return nil, fmt.Errorf("%q: unknown kind (want alloc, free, copy, ipc, export, stats, claim or attach)", kind)
		}
		for _, op := range ops {
			stall[op] = d
		}
	}
	return stall, nil
}

// server serves one session: one daemon's connection.
type server struct {
	h       *helper
	conn    *net.UnixConn
	dev     Device
	staging []byte                  // the daemon's staging area, mapped shared
	stall   map[uint8]time.Duration // how long to sleep before serving an op (tests)
	done    chan struct{}           // closed once the session has ended
	// bye is set by the daemon's goodbye (Close); cut when a successor
	// settled the device and ended this session; claimed once the session
	// claimed the device.
	bye, cut, claimed atomic.Bool
	// attached says the session is not the helper's first: a successor's.
	attached bool
}

// serve answers the session's hello, then its requests, until the daemon
// closes the connection.
func (s *server) serve() error {
	conn, dev := s.conn, s.dev
	rx := newReceiver(conn)
	m, fd, err := rx.receive()
	if err != nil {
		return fmt.Errorf("no hello from the daemon: %w", err)
	}
	if s.attached {
		s.stallOn(opHello)
	}
	unpin, err := s.hello(m, fd)
	if fd >= 0 {
		unix.Close(fd)
	}
	reply := &message{op: m.op, id: m.id}
	if err != nil {
		reply.setError(err)
	} else {
		reply.args = []int64{dev.Granularity()}
		reply.data = []byte(dev.Name() + "\x00" + dev.Backend())
	}
	// The hello's reply carries a pidfd of the helper: a daemon that did
	// not start it (a successor) can still kill it, and see it exit.
	pidfd, perr := unix.PidfdOpen(os.Getpid(), 0)
	if perr != nil {
		pidfd = -1
	} else {
		defer unix.Close(pidfd)
	}
	if serr := send(conn, reply, pidfd); err == nil {
		err = serr
	}
	if err != nil {
		return err
	}
	defer func() {
		if unpin != nil {
			unpin()
		}
		unix.Munmap(s.staging)
	}()

	var wg sync.WaitGroup
	defer wg.Wait()
	sem := make(chan struct{}, maxInFlight)
	for {
		m, fd, err := rx.receive()
		if errors.Is(err, io.EOF) || s.cut.Load() {
			if fd >= 0 {
				unix.Close(fd)
			}
			return nil
		}
		if err != nil {
			return err
		}
		if m.op == opBye {
			s.bye.Store(true)
			continue
		}
		if m.op == opClaim { // no other request of this session is in flight
			wg.Wait()
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			s.handle(m, fd)
		})
		if m.op == opClaim {
			wg.Wait()
		}
	}
}

// hello maps the staging area and pins it when the device can. The area
// must be a file of at least the size asked that cannot shrink
// (checkMappable): a touch of a mapping past its file's end is SIGBUS.
func (s *server) hello(m *message, fd int) (unpin func() error, err error) {
	if m.op != opHello {
		return nil, fmt.Errorf("%w: first op %d, want hello", errProtocol, m.op)
	}
	if err := m.want(1); err != nil {
		return nil, err
	}
	if fd < 0 || m.args[0] <= 0 {
		return nil, fmt.Errorf("%w: hello without a staging area", errProtocol)
	}
	if err := checkMappable(fd, m.args[0]); err != nil {
		return nil, fmt.Errorf("%w: staging area: %v", errProtocol, err)
	}
	s.staging, err = unix.Mmap(fd, 0, int(m.args[0]), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap staging area: %w", err)
	}
	if p, ok := s.dev.(Pinner); ok {
		if unpin, err = p.Pin(s.staging); err != nil {
			unix.Munmap(s.staging)
			return nil, fmt.Errorf("pin staging area: %w", err)
		}
	}
	return unpin, nil
}

// handle answers one request; fd, when not -1, is closed afterwards.
func (s *server) handle(m *message, fd int) {
	if fd >= 0 {
		defer unix.Close(fd)
	}
	reply := &message{op: m.op, id: m.id}
	export, err := s.execute(m, fd, reply)
	if err != nil {
		reply.setError(err)
	}
	replyFD := -1
	if export != nil {
		defer export.Close()
		replyFD = int(export.Fd())
	}
	send(s.conn, reply, replyFD) // fails only when the daemon is gone
}

// execute runs a request (do) with serving read-held, a claim aside
// (it waits for the others): the reply goes out after.
func (s *server) execute(m *message, fd int, reply *message) (*os.File, error) {
	if m.op != opClaim {
		s.h.serving.RLock()
		defer s.h.serving.RUnlock()
		if err := s.h.refused(s); err != nil {
			return nil, err
		}
	}
	s.stallOn(m.op)
	return s.do(m, fd, reply)
}

// stallOn sleeps as long as SimStallEnv says op stalls (tests).
func (s *server) stallOn(op uint8) {
	if d, ok := s.stall[op]; ok {
		time.Sleep(d)
	}
}

// requestArgs is the number of arguments of each request but hello.
var requestArgs = map[uint8]int{
	opAlloc: 1, opAllocExportable: 1, opFree: 2, opCopyIn: 5, opCopyOut: 5,
	opCopyFromFile: 5, opCopyToFile: 5, opIPC: 2, opExport: 2, opStats: 0,
	opTag: 2, opClaim: 0, opSettle: 0, opBlocks: 1,
}

// do runs a request and fills in reply; Export's file is returned, to be
// sent with the reply.
func (s *server) do(m *message, fd int, reply *message) (*os.File, error) {
	n, ok := requestArgs[m.op]
	if !ok {
		return nil, fmt.Errorf("%w: unknown op %d", errProtocol, m.op)
	}
	if err := m.want(n); err != nil {
		return nil, err
	}
	switch m.op {
	case opAlloc, opAllocExportable:
		alloc := s.dev.Alloc
		if m.op == opAllocExportable {
			alloc = s.dev.AllocExportable
		}
		b, err := alloc(m.args[0])
		reply.args = []int64{int64(b.ID), b.Size}
		if err == nil {
			s.h.mu.Lock()
			s.h.blocks[b.ID] = &owned{block: b, exportable: m.op == opAllocExportable}
			s.h.mu.Unlock()
		}
		return nil, err
	case opFree:
		err := s.dev.Free(m.block())
		if err == nil || errors.Is(err, ErrNoBlock) {
			s.h.mu.Lock()
			if o := s.h.blocks[m.block().ID]; o != nil && o.block == m.block() {
				delete(s.h.blocks, o.block.ID)
			}
			s.h.mu.Unlock()
		}
		return nil, err
	case opTag:
		return nil, s.h.tag(m.block(), m.data)
	case opClaim:
		return nil, s.h.claim(s)
	case opSettle:
		return nil, s.h.settle(s)
	case opBlocks:
		reply.data = s.h.list(uint64(m.args[0]))
		return nil, nil
	case opCopyIn, opCopyOut:
		so, k := m.args[3], m.args[4]
		if so < 0 || k < 0 || so > int64(len(s.staging)) || k > int64(len(s.staging))-so {
			return nil, fmt.Errorf("%w: staging range at %d of %d bytes", errProtocol, so, k)
		}
		buf := s.staging[so : so+k]
		if m.op == opCopyIn {
			return nil, s.dev.CopyIn(m.block(), m.args[2], buf)
		}
		return nil, s.dev.CopyOut(m.block(), m.args[2], buf)
	case opCopyFromFile, opCopyToFile:
		if fd < 0 {
			return nil, fmt.Errorf("%w: file copy without a file", errProtocol)
		}
		if m.op == opCopyFromFile {
			return nil, s.dev.CopyFromFile(m.block(), m.args[2], fd, m.args[3], m.args[4])
		}
		return nil, s.dev.CopyToFile(m.block(), m.args[2], fd, m.args[3], m.args[4])
	case opIPC:
		info, err := s.dev.IPC(m.block())
		reply.data = append(info.MemHandle[:], info.EventHandle[:]...)
		return nil, err
	case opExport:
		return s.dev.Export(m.block())
	default: // opStats
		st := s.dev.Stats()
		reply.args = []int64{int64(st.Blocks), st.BlockBytes, st.DeviceBytes}
		return nil, nil
	}
}

// maxTag bounds a block's tag.
const maxTag = 256

// tag gives block b the tag t, replacing the one it had.
func (h *helper) tag(b Block, t []byte) error {
	if len(t) > maxTag {
		return fmt.Errorf("%w: a %d-byte tag (at most %d)", ErrInvalid, len(t), maxTag)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	o := h.blocks[b.ID]
	if o == nil || o.block != b {
		return fmt.Errorf("%w: block %d", ErrNoBlock, b.ID)
	}
	o.tag = append([]byte(nil), t...)
	return nil
}

// list encodes the blocks whose IDs follow after, in ascending order, as
// many as a reply holds (marshalOwned); none past the last.
func (h *helper) list(after uint64) []byte {
	h.mu.Lock()
	defer h.mu.Unlock()
	ids := make([]uint64, 0, len(h.blocks))
	for id := range h.blocks {
		if id > after {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	var out []byte
	for _, id := range ids {
		e := marshalOwned(h.blocks[id])
		if headerSize+len(out)+len(e) > maxMessage {
			break
		}
		out = append(out, e...)
	}
	return out
}

// checkMappable returns nil if the file open at fd holds at least size
// bytes and is sealed against shrinking, so that a shared mapping of its
// first size bytes can be touched for as long as it lives; else EINVAL,
// saying why.
func checkMappable(fd int, size int64) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if st.Size < size {
		return fmt.Errorf("%w: %d bytes, %d to map", syscall.EINVAL, st.Size, size)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&unix.F_SEAL_SHRINK == 0 {
		return fmt.Errorf("%w: not sealed against shrinking (F_SEAL_SHRINK)", syscall.EINVAL)
	}
	return nil
}
