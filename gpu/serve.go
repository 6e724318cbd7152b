package gpu

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// maxInFlight bounds the requests a helper serves at once.
const maxInFlight = 64

// Pinner is implemented by devices that can page-lock host memory so that
// copies from and to it run at DMA speed without further staging. Serve
// pins the shared staging area with it.
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
// device and serves it on file descriptor 3, one end of the socket pair
// Start made, until the daemon closes the socket. Errors go to stderr as
// one line, which Start reports as the reason the GPU is unavailable. It
// returns the exit status: 0 after a clean shutdown, 1 when the device or
// the socket fails, 2 on bad arguments.
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

	f := os.NewFile(3, "gpu-socket")
	c, err := net.FileConn(f)
	f.Close()
	if err != nil {
		fmt.Fprintf(stderr, "gpu-helper: fd 3 is not the daemon's socket: %v\n", err)
		return 1
	}
	conn, ok := c.(*net.UnixConn)
	if !ok {
		c.Close()
		fmt.Fprintf(stderr, "gpu-helper: fd 3 is a %T, not a unix socket\n", c)
		return 1
	}
	defer conn.Close()
	if err := serve(conn, dev, stall); err != nil {
		fmt.Fprintf(stderr, "gpu-helper: %v\n", err)
		return 1
	}
	return 0
}

// SimStallEnv names the environment variable that makes a sim helper
// stall, for tests of the daemon's deadlines only: a comma-separated list
// of request kinds (alloc, free, copy, ipc, export, stats), each either
// alone, to never answer such a request, or as KIND=DURATION, to answer it
// that late (e.g. "copy" or "copy=2s,stats"). The cuda helper ignores it.
const SimStallEnv = "TENSORFS_GPU_SIM_STALL"

// stallKinds are the request kinds SimStallEnv names, with their ops.
var stallKinds = map[string][]uint8{
	"alloc": {opAlloc, opAllocExportable}, "free": {opFree},
	"copy": {opCopyIn, opCopyOut, opCopyFromFile, opCopyToFile},
	"ipc":  {opIPC}, "export": {opExport}, "stats": {opStats},
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
			return nil, fmt.Errorf("%q: unknown kind (want alloc, free, copy, ipc, export or stats)", kind)
		}
		for _, op := range ops {
			stall[op] = d
		}
	}
	return stall, nil
}

// server serves one connection.
type server struct {
	conn    *net.UnixConn
	dev     Device
	staging []byte                  // the daemon's staging area, mapped shared
	stall   map[uint8]time.Duration // how long to sleep before serving an op (tests)
}

// Serve serves dev to the daemon at the other end of conn, a SOCK_SEQPACKET
// socket, until the daemon closes it; requests run concurrently. It returns
// nil once the daemon has closed the connection and every request is
// answered. It neither closes conn nor dev.
func Serve(conn *net.UnixConn, dev Device) error { return serve(conn, dev, nil) }

// serve is Serve with each op in stall answered that much later.
func serve(conn *net.UnixConn, dev Device, stall map[uint8]time.Duration) error {
	s := &server{conn: conn, dev: dev, stall: stall}
	rx := newReceiver(conn)
	m, fd, err := rx.receive()
	if err != nil {
		return fmt.Errorf("no hello from the daemon: %w", err)
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
	if serr := send(conn, reply, -1); err == nil {
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
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			s.handle(m, fd)
		})
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
	if d, ok := s.stall[m.op]; ok {
		time.Sleep(d)
	}
	reply := &message{op: m.op, id: m.id}
	export, err := s.do(m, fd, reply)
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

// requestArgs is the number of arguments of each request but hello.
var requestArgs = map[uint8]int{
	opAlloc: 1, opAllocExportable: 1, opFree: 2, opCopyIn: 5, opCopyOut: 5,
	opCopyFromFile: 5, opCopyToFile: 5, opIPC: 2, opExport: 2, opStats: 0,
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
		return nil, err
	case opFree:
		return nil, s.dev.Free(m.block())
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
