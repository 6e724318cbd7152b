package gpu

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/fdpass"
	"tensorfs/gpu/internal/devmem"
	"tensorfs/procfs"
)

const (
	// stagingSlot and stagingSlots size the staging area shared with the
	// helper: CopyIn and CopyOut move up to stagingSlot bytes per round
	// trip. Every copy, file copies included, holds a slot while the
	// helper works on it, so that no more copies reach the helper than it
	// has lanes (devmem.MaxLanes): a copy never waits in the helper for
	// another, and its deadline measures its own work.
	stagingSlot  = 4 << 20
	stagingSlots = devmem.MaxLanes
	// helloTimeout bounds the helper's start, CUDA initialisation included.
	helloTimeout = time.Minute
	// exitTimeout is how long a closed helper gets to free the device and
	// exit before it is killed.
	exitTimeout = 10 * time.Second
)

// timeouts bound how long the daemon waits for the helper's answer to a
// call. A call unanswered at its deadline means the helper hangs (a wedged
// driver, a GPU that stopped): the daemon kills it, and GPU segments are
// off (see remote.expire), rather than let a FUSE request wait forever.
type timeouts struct {
	// control bounds Alloc, AllocExportable, Free, IPC, Export and Stats:
	// a few driver calls each, which take micro- to milliseconds (an
	// allocation is zeroed on the device at hundreds of GB/s).
	control time.Duration
	// copyFloor plus n bytes at copyRate bytes per second bound a copy of
	// n bytes. The rate is far below what a copy runs at (device and host
	// memory move GB/s; tmpfs reads as fast) so that it holds for a file
	// copy from a slow disk (--disk) shared by the helper's lanes.
	copyFloor time.Duration
	copyRate  int64
}

// defaultTimeouts are the deadlines of every helper: 10 s for a control
// call, 10 s plus 1 s per 16 MiB for a copy (10.25 s for a 4 MiB staging
// round trip, 74 s for a 1 GiB copy_file_range). Tests shorten them
// through remote.timeouts; users cannot.
var defaultTimeouts = timeouts{control: 10 * time.Second, copyFloor: 10 * time.Second, copyRate: 16 << 20}

// maxTimeout caps a deadline, so that a huge n cannot overflow it.
const maxTimeout = 24 * time.Hour

// of returns how long the helper may take to answer m, in whole
// milliseconds.
func (t timeouts) of(m *message) time.Duration {
	switch m.op {
	case opCopyIn, opCopyOut, opCopyFromFile, opCopyToFile:
		n := float64(max(m.args[4], 0)) // every copy's last argument
		d := time.Duration(min(n/float64(t.copyRate)*float64(time.Second), float64(maxTimeout)))
		return (t.copyFloor + d).Round(time.Millisecond)
	}
	return t.control
}

// errClosed is what calls on a closed Device return.
var errClosed = fmt.Errorf("%w: device closed", ErrUnavailable)

// Start starts a helper process that serves device index with backend
// ("cuda" or "sim"), and returns a Device forwarding every call to it, so
// that a CUDA failure takes down the helper and never the daemon. The
// helper is `exe gpu-helper --backend B --device N` (see HelperMain), with
// its door (one end of a socket pair, through which each daemon opens a
// session: Attach) as file descriptor 3, and its own process group (a
// terminal's Ctrl-C reaches the daemon, which then closes the device).
// It outlives the daemon while someone holds the door (Door: a keeper,
// for a successor), and exits once nobody does or the daemon closes the
// device. Each call has a deadline (timeouts);
// at the first one missed the helper is killed and the Device fails every
// call with ErrUnavailable from then on. log receives the helper's output
// at debug level, its death as a warning and a missed deadline as an
// error; nil discards them.
//
// Backend "none" returns Unavailable, and no error. An unknown backend is
// ErrInvalid. When the helper cannot start, or exits before it serves
// (cuInit failing, say), the error wraps ErrUnavailable and ends with the
// helper's last line of output: one line to tell why GPU segments are off.
// The daemon can then keep Unavailable(err) as its device. Start the helper
// before mounting, so that it inherits nothing of the mount.
//
// For cuda, exe is the helper gpu/cmd/tensorfs-gpu built with -tags cuda:
// the only binary that links the cuda backend (gpu/cuda), whose
// gorgonia.org/cu init calls cuInit and exits the process if that fails.
// For sim, exe may be the daemon itself.
func Start(exe, backend string, index int, log *slog.Logger) (Device, error) {
	switch backend {
	case "none":
		return Unavailable(errors.New("GPU segments are off (--gpu none)")), nil
	case "sim", "cuda":
	default:
		return nil, fmt.Errorf("%w: gpu backend %q (want cuda, sim or none)", ErrInvalid, backend)
	}
	if index < 0 {
		return nil, fmt.Errorf("%w: gpu device %d", ErrInvalid, index)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return start(exe, []string{"gpu-helper", "--backend", backend, "--device", fmt.Sprint(index)}, log)
}

// Attach opens a session of its own with the helper whose door a daemon
// that died or handed its mount over held (Door), and returns a Device
// forwarding every call to it: the successor's. Its blocks are the
// helper's, still allocated; Claim takes them over. door and pidfd (the
// helper's, from Door; nil if the keeper gave none) stay the caller's.
//
// The helper is running, so its hello gets a control call's deadline, not
// a cold start's. An attach that fails (no hello in time, a hello from
// another process than pidfd's) kills the helper through pidfd and waits
// for it to exit (killStuck), so that a new helper never shares the
// device with a hung one.
func Attach(door, pidfd *os.File, log *slog.Logger) (Device, error) {
	return attach(door, pidfd, log, defaultTimeouts)
}

// attach is Attach with deadlines tm.
func attach(door, pidfd *os.File, log *slog.Logger, tm timeouts) (_ Device, err error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d, err := dup(door.Fd(), "gpu-door")
	if err != nil {
		return nil, fmt.Errorf("%w: the gpu helper's door: %v", ErrUnavailable, err)
	}
	r, err := newRemote(d, log)
	if err != nil {
		return nil, err
	}
	r.timeouts = tm
	defer func() {
		if err != nil {
			r.killStuck(err)
			r.release()
		}
	}()
	if pidfd != nil {
		if r.pidfd, err = unix.FcntlInt(pidfd.Fd(), unix.F_DUPFD_CLOEXEC, 0); err != nil {
			r.pidfd = -1
			return nil, fmt.Errorf("%w: the gpu helper's pidfd: %v", ErrUnavailable, err)
		}
	}
	if err := r.hello(tm.control); err != nil {
		return nil, err
	}
	go func() {
		exitedWithin(r.pidfd, -1)
		close(r.exited)
	}()
	return r.serve(), nil
}

// Door returns duplicates of the door of dev's helper, for a successor to
// Attach to, and of its pidfd (nil if unknown), for the successor to kill
// it should it hang; nils for a device without a helper.
func Door(dev Device) (door, pidfd *os.File, err error) {
	r, ok := dev.(*remote)
	if !ok {
		return nil, nil, nil
	}
	if door, err = dup(r.door.Fd(), "gpu-door"); err != nil || r.pidfd < 0 {
		return door, nil, err
	}
	if pidfd, err = dup(uintptr(r.pidfd), "gpu-helper-pidfd"); err != nil {
		door.Close()
		return nil, nil, err
	}
	return door, pidfd, nil
}

// dup returns a duplicate of fd, close-on-exec, named name.
func dup(fd uintptr, name string) (*os.File, error) {
	d, err := unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(d), name), nil
}

// remote is a Device served by a helper process.
type remote struct {
	log           *slog.Logger
	door          *os.File // the helper's door, for Door
	conn          *net.UnixConn
	proc          *os.Process // the helper, when this daemon started it; else nil
	pidfd         int         // the helper's: opened at its start, given to Attach or from its hello; -1 before
	out           *tail
	exited        chan struct{}    // closed once the helper has exited and its output is read
	state         *os.ProcessState // the helper's exit, set before exited is closed (proc only)
	name, backend string
	granularity   int64      // the helper's device's, from its hello
	slots         chan int64 // offsets of the free staging slots
	timeouts      timeouts   // set at start; tests shorten them

	stagingMu sync.RWMutex // read-held while a copy uses staging, write-held to unmap it
	staging   []byte       // the staging area, mapped shared; nil once unmapped

	mu      sync.Mutex // guards the fields below
	lastID  uint32
	pending map[uint32]chan reply // calls waiting for their reply, by id
	closing bool
	err     error         // why the helper is gone, once it is
	gone    chan struct{} // closed when err is set
}

// reply is what a call waits for: a message with its file descriptor, or
// the error that ended the helper.
type reply struct {
	m   *message
	fd  int
	err error
}

// newRemote opens a session through door, which it keeps: it sends the
// helper one end of a new socket pair and talks on the other.
func newRemote(door *os.File, log *slog.Logger) (*remote, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		door.Close()
		return nil, fmt.Errorf("%w: socketpair: %v", ErrUnavailable, err)
	}
	defer unix.Close(fds[1])
	ours := os.NewFile(uintptr(fds[0]), "gpu-socket")
	c, err := net.FileConn(ours)
	ours.Close()
	if err != nil {
		unix.Close(fds[1])
		door.Close()
		return nil, fmt.Errorf("%w: socket: %v", ErrUnavailable, err)
	}
	r := &remote{
		log:      log,
		door:     door,
		conn:     c.(*net.UnixConn),
		pidfd:    -1,
		out:      &tail{log: log},
		exited:   make(chan struct{}),
		slots:    make(chan int64, stagingSlots),
		timeouts: defaultTimeouts,
		pending:  make(map[uint32]chan reply),
		gone:     make(chan struct{}),
	}
	dc, err := net.FileConn(door)
	if err == nil {
		err = fdpass.Send(dc.(*net.UnixConn), []byte{1}, fds[1])
		dc.Close()
	}
	if err != nil {
		r.conn.Close()
		door.Close()
		return nil, fmt.Errorf("%w: the gpu helper's door: %v", ErrUnavailable, err)
	}
	return r, nil
}

// serve readies r once its hello is answered: its staging slots and its
// reader.
func (r *remote) serve() *remote {
	for i := range stagingSlots {
		r.slots <- int64(i) * stagingSlot
	}
	go r.readLoop(newReceiver(r.conn))
	return r
}

// release closes what a remote that never served holds.
func (r *remote) release() {
	r.conn.Close()
	r.door.Close()
	if r.staging != nil {
		unix.Munmap(r.staging)
	}
	if r.pidfd >= 0 {
		unix.Close(r.pidfd)
	}
}

func start(exe string, args []string, log *slog.Logger) (_ Device, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: socketpair: %v", ErrUnavailable, err)
	}
	theirs := os.NewFile(uintptr(fds[1]), "gpu-door")
	defer theirs.Close()
	r, err := newRemote(os.NewFile(uintptr(fds[0]), "gpu-door"), log)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, args...)
	cmd.ExtraFiles = []*os.File{theirs}
	cmd.Stdout, cmd.Stderr = r.out, r.out // cu's init failure goes to stdout
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		r.release()
		return nil, fmt.Errorf("%w: start gpu helper: %v", ErrUnavailable, err)
	}
	r.proc = cmd.Process
	// An unreaped child: its pid cannot have been reused yet.
	if fd, err := unix.PidfdOpen(r.proc.Pid, 0); err == nil {
		r.pidfd = fd // else the hello's
	}
	go func() {
		cmd.Wait()
		r.state = cmd.ProcessState
		close(r.exited)
	}()
	defer func() {
		if err != nil {
			r.kill()
			<-r.exited
			r.release()
		}
	}()
	theirs.Close()

	if err := r.hello(helloTimeout); err != nil {
		return nil, err
	}
	log.Debug("gpu helper started", "pid", r.proc.Pid, "device", r.name, "backend", r.backend)
	return r.serve(), nil
}

// hello makes and maps the staging area, a sealed memfd that the helper
// maps too, sends it to the helper and waits up to wait for the helper's
// name, backend and granularity, with its pidfd (helloPidfd).
func (r *remote) hello(wait time.Duration) error {
	size := int64(stagingSlot * stagingSlots)
	fd, err := sealedMemfd("tensorfs-gpu-staging", size)
	if err != nil {
		return fmt.Errorf("%w: staging area: %v", ErrUnavailable, err)
	}
	defer unix.Close(fd)
	if r.staging, err = unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err != nil {
		return fmt.Errorf("%w: mmap staging area: %v", ErrUnavailable, err)
	}
	if err := send(r.conn, &message{op: opHello, args: []int64{size}}, fd); err != nil {
		return r.exitError()
	}
	r.conn.SetReadDeadline(time.Now().Add(wait))
	m, pidfd, err := newReceiver(r.conn).receive()
	r.conn.SetReadDeadline(time.Time{})
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded):
		return fmt.Errorf("%w: gpu helper did not answer within %v", ErrUnavailable, wait)
	case errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET):
		return r.exitError()
	case err != nil:
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	if err := r.helloPidfd(pidfd); err != nil {
		return err
	}
	if m.err() != nil {
		return fmt.Errorf("%w: gpu helper: %v", ErrUnavailable, m.err())
	}
	name, backend, ok := strings.Cut(string(m.data), "\x00")
	if !ok || m.want(1) != nil || m.args[0] <= 0 || m.args[0]&(m.args[0]-1) != 0 {
		return fmt.Errorf("%w: %w: hello reply %v %q", ErrUnavailable, errProtocol, m.args, m.data)
	}
	r.name, r.backend, r.granularity = name, backend, m.args[0]
	return nil
}

// helloPidfd takes pidfd, the one the helper's hello carries, as the
// helper's, or closes it when r knows the helper's pidfd already (it
// started the helper, or was given it): it must then be of the same
// process, else the hello is not the helper's.
func (r *remote) helloPidfd(pidfd int) error {
	if pidfd < 0 {
		return fmt.Errorf("%w: %w: hello without the helper's pidfd", ErrUnavailable, errProtocol)
	}
	if r.pidfd < 0 {
		r.pidfd = pidfd
		return nil
	}
	defer unix.Close(pidfd)
	if got, want := pidOf(pidfd), pidOf(r.pidfd); got <= 0 || got != want {
		return fmt.Errorf("%w: %w: the hello came from pid %d, not from the helper, pid %d", ErrUnavailable, errProtocol, got, want)
	}
	return nil
}

// pidOf returns the pid of the process of pidfd, as /proc/self/fdinfo
// says: -1 once it has exited, 0 if unknown.
func pidOf(pidfd int) int {
	b, err := procfs.ReadFile(fmt.Sprintf("/proc/self/fdinfo/%d", pidfd))
	if err != nil {
		return 0
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "Pid:"); ok {
			pid, _ := strconv.Atoi(strings.TrimSpace(v))
			return pid
		}
	}
	return 0
}

// exitedWithin waits up to d (forever if d < 0) for the process of
// pidfd to exit, and reports whether it has.
func exitedWithin(pidfd int, d time.Duration) bool {
	ms := -1
	if d >= 0 {
		ms = int(d.Milliseconds())
	}
	for {
		n, err := unix.Poll([]unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}, ms)
		if err != unix.EINTR {
			return err == nil && n > 0
		}
	}
}

// killStuck kills the helper through its pidfd after this daemon's
// attach failed for why, and waits up to exitTimeout for it to exit, so
// that its device memory is free before a new helper starts; one log line
// says so. A helper that has exited already, or whose pidfd r lacks (a
// keeper from before pidfds), is left alone. Never by pid: it may be
// reused.
func (r *remote) killStuck(why error) {
	if r.pidfd < 0 || exitedWithin(r.pidfd, 0) {
		return
	}
	pid := pidOf(r.pidfd)
	err := unix.PidfdSendSignal(r.pidfd, unix.SIGKILL, nil, 0)
	exited := err == nil && exitedWithin(r.pidfd, exitTimeout)
	r.log.Error("the gpu helper failed this daemon's attach; killed it, so that a new one has its device memory", "pid", pid, "why", why, "exited", exited)
}

// pid returns the helper's pid, for the log.
func (r *remote) pid() int {
	if r.proc != nil {
		return r.proc.Pid
	}
	return pidOf(r.pidfd)
}

// exitError waits for the helper to exit, killing it if it takes too
// long, and says why it is gone. Of a helper this daemon did not start,
// it says only that.
func (r *remote) exitError() error {
	if r.proc == nil {
		return fmt.Errorf("%w: gpu helper gone", ErrUnavailable)
	}
	select {
	case <-r.exited:
	case <-time.After(exitTimeout):
		r.kill()
		<-r.exited
	}
	if line := r.out.last(); line != "" {
		return fmt.Errorf("%w: gpu helper exited (%v): %s", ErrUnavailable, r.state, line)
	}
	return fmt.Errorf("%w: gpu helper exited (%v)", ErrUnavailable, r.state)
}

// kill sends SIGKILL to the helper, unless it has exited already: to its
// process group (its own, from Start) when this daemon started it, else
// through its pidfd.
func (r *remote) kill() {
	select {
	case <-r.exited:
	default:
		if r.proc != nil {
			syscall.Kill(-r.proc.Pid, syscall.SIGKILL)
		} else {
			unix.PidfdSendSignal(r.pidfd, unix.SIGKILL, nil, 0)
		}
	}
}

// sessionEnded says why the helper ended this daemon's session: it
// exited, or it lives on for a successor that claimed it (Claim).
func (r *remote) sessionEnded() error {
	select {
	case <-r.exited:
		return r.exitError()
	case <-time.After(time.Second):
		return errSuperseded
	}
}

// errSuperseded is what calls get once a successor claimed the helper.
var errSuperseded = fmt.Errorf("%w: the gpu helper ended this daemon's session: a successor took the device over", ErrUnavailable)

// readLoop hands each reply to its call, until the connection ends.
func (r *remote) readLoop(rx *receiver) {
	for {
		m, fd, err := rx.receive()
		if err != nil {
			r.fail(err)
			return
		}
		r.mu.Lock()
		ch := r.pending[m.id]
		delete(r.pending, m.id)
		r.mu.Unlock()
		if ch == nil { // not a call of ours (or expire gave up on them all)
			if fd >= 0 {
				unix.Close(fd)
			}
			r.fail(fmt.Errorf("%w: reply to no call (id %d)", errProtocol, m.id))
			return
		}
		ch <- reply{m: m, fd: fd}
	}
}

// fail records why the helper is gone and fails every waiting call,
// unless expire did so first.
func (r *remote) fail(cause error) {
	r.mu.Lock()
	closing, gone := r.closing, r.err != nil
	r.mu.Unlock()
	if gone {
		return
	}
	var err error
	switch {
	case closing:
		err = errClosed
	case errors.Is(cause, io.EOF) || errors.Is(cause, syscall.ECONNRESET):
		err = r.sessionEnded()
	default:
		r.kill()
		err = fmt.Errorf("%w: %v", ErrUnavailable, cause)
	}
	pending, ok := r.giveUp(err, 0)
	if !ok {
		return
	}
	switch {
	case err == errSuperseded:
		r.log.Info("a successor took the gpu helper over", "err", err)
	case !closing:
		r.log.Warn("gpu helper gone; GPU segments are unavailable", "err", err)
	}
	answer(pending, err)
}

// giveUp makes err the answer to every later call, unless the helper was
// given up on already; with id > 0, only while call id is still waiting.
// It reports whether it did, and returns the calls waiting, for answer.
func (r *remote) giveUp(err error, id uint32) (pending map[uint32]chan reply, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, waiting := r.pending[id]; r.err != nil || id > 0 && !waiting {
		return nil, false
	}
	r.err = err
	pending = r.pending
	r.pending = nil
	close(r.gone)
	return pending, true
}

// answer fails the calls pending with err.
func answer(pending map[uint32]chan reply, err error) {
	for _, ch := range pending {
		ch <- reply{err: err}
	}
}

// expire gives up on a helper that left call m unanswered for d, its
// deadline: it kills the helper, so that no FUSE request waits on it any
// longer, and fails m, every call in flight and every later one with
// ErrUnavailable. Host segments are not concerned; GPU segments are off
// until the daemon starts again.
func (r *remote) expire(m *message, d time.Duration) {
	call := opNames[m.op]
	err := fmt.Errorf("%w: gpu helper did not answer %s within %v; killed it, GPU segments are off", ErrUnavailable, call, d)
	pending, ok := r.giveUp(err, m.id)
	if !ok {
		return // answered meanwhile, or given up on already
	}
	pid := r.pid() // before it exits
	r.kill()
	r.log.Error("gpu helper stalled; killed it, GPU segments are off", "call", call, "args", m.args, "waited", d, "pid", pid)
	answer(pending, err)
}

// call sends a request, with fd attached when fd >= 0, and waits for its
// reply until its deadline (timeouts). It returns the reply's file
// descriptor, or -1.
func (r *remote) call(m *message, fd int) (*message, int, error) {
	ch := make(chan reply, 1)
	r.mu.Lock()
	if r.err != nil {
		err := r.err
		r.mu.Unlock()
		return nil, -1, err
	}
	r.lastID++
	if r.lastID == 0 { // 0 means no call to giveUp
		r.lastID++
	}
	m.id = r.lastID
	r.pending[m.id] = ch
	r.mu.Unlock()

	if err := send(r.conn, m, fd); err != nil {
		r.mu.Lock()
		_, waiting := r.pending[m.id]
		delete(r.pending, m.id)
		r.mu.Unlock()
		switch {
		case !waiting: // the reader failed the call already
			return nil, -1, (<-ch).err
		case errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET):
			<-r.gone // the reader will tell why
			r.mu.Lock()
			defer r.mu.Unlock()
			return nil, -1, r.err
		case errors.Is(err, syscall.EBADF):
			return nil, -1, fmt.Errorf("%w: file descriptor %d: %v", ErrInvalid, fd, err)
		}
		return nil, -1, fmt.Errorf("send to gpu helper: %w", err)
	}
	d := r.timeouts.of(m)
	timer := time.NewTimer(d)
	var rep reply
	select {
	case rep = <-ch:
	case <-timer.C:
		r.expire(m, d)
		rep = <-ch // the reply that beat expire, or its error
	}
	timer.Stop()
	if rep.err != nil {
		return nil, -1, rep.err
	}
	if err := rep.m.err(); err != nil {
		if rep.fd >= 0 {
			unix.Close(rep.fd)
		}
		return nil, -1, err
	}
	return rep.m, rep.fd, nil
}

// callBlock is call for requests that name a block and return no file.
func (r *remote) callBlock(op uint8, b Block, args ...int64) (*message, error) {
	m, fd, err := r.call(&message{op: op, args: append([]int64{int64(b.ID), b.Size}, args...)}, -1)
	if fd >= 0 {
		unix.Close(fd)
	}
	return m, err
}

func (r *remote) Name() string    { return r.name }
func (r *remote) Backend() string { return r.backend }

// Granularity returns the helper's device's, as its hello said.
func (r *remote) Granularity() int64 { return r.granularity }

func (r *remote) Alloc(size int64) (Block, error) { return r.alloc(opAlloc, size) }

func (r *remote) AllocExportable(size int64) (Block, error) {
	return r.alloc(opAllocExportable, size)
}

func (r *remote) alloc(op uint8, size int64) (Block, error) {
	m, fd, err := r.call(&message{op: op, args: []int64{size}}, -1)
	if fd >= 0 {
		unix.Close(fd)
	}
	if err != nil {
		return Block{}, err
	}
	if err := m.want(2); err != nil {
		return Block{}, err
	}
	return Block{ID: uint64(m.args[0]), Size: m.args[1]}, nil
}

func (r *remote) Free(b Block) error {
	_, err := r.callBlock(opFree, b)
	return err
}

func (r *remote) CopyIn(b Block, off int64, src []byte) error {
	return r.viaStaging(opCopyIn, b, off, int64(len(src)), func(slot []byte, pos int64) {
		copy(slot, src[pos:])
	}, nil)
}

func (r *remote) CopyOut(b Block, off int64, dst []byte) error {
	return r.viaStaging(opCopyOut, b, off, int64(len(dst)), nil, func(slot []byte, pos int64) {
		copy(dst[pos:], slot)
	})
}

// viaStaging runs op over the n bytes of b at off, a staging slot at a
// time: in fills the slot with the source bytes at pos before the request,
// out takes the slot's bytes after it.
func (r *remote) viaStaging(op uint8, b Block, off, n int64, in, out func(slot []byte, pos int64)) error {
	r.stagingMu.RLock()
	defer r.stagingMu.RUnlock()
	if r.staging == nil {
		return errClosed
	}
	for pos := int64(0); ; {
		k := min(n-pos, stagingSlot)
		so := <-r.slots
		slot := r.staging[so : so+k]
		if in != nil {
			in(slot, pos)
		}
		_, err := r.callBlock(op, b, off+pos, so, k)
		if err == nil && out != nil {
			out(slot, pos)
		}
		r.slots <- so
		if err != nil {
			return err
		}
		if pos += k; pos >= n {
			return nil
		}
	}
}

func (r *remote) CopyFromFile(b Block, off int64, fd int, fileOff, n int64) error {
	return r.fileCopy(opCopyFromFile, b, off, fd, fileOff, n)
}

func (r *remote) CopyToFile(b Block, off int64, fd int, fileOff, n int64) error {
	return r.fileCopy(opCopyToFile, b, off, fd, fileOff, n)
}

func (r *remote) fileCopy(op uint8, b Block, off int64, fd int, fileOff, n int64) error {
	if fd < 0 {
		return fmt.Errorf("%w: file descriptor %d", ErrInvalid, fd)
	}
	so := <-r.slots // a copy holds a slot (see stagingSlots), not its bytes
	defer func() { r.slots <- so }()
	_, rfd, err := r.call(&message{op: op, args: []int64{int64(b.ID), b.Size, off, fileOff, n}}, fd)
	if rfd >= 0 {
		unix.Close(rfd)
	}
	return err
}

func (r *remote) IPC(b Block) (IPCInfo, error) {
	m, err := r.callBlock(opIPC, b)
	if err != nil {
		return IPCInfo{}, err
	}
	var info IPCInfo
	if len(m.data) != len(info.MemHandle)+len(info.EventHandle) {
		return IPCInfo{}, fmt.Errorf("%w: %d bytes of IPC handles", errProtocol, len(m.data))
	}
	copy(info.MemHandle[:], m.data)
	copy(info.EventHandle[:], m.data[len(info.MemHandle):])
	return info, nil
}

func (r *remote) Export(b Block) (*os.File, error) {
	_, fd, err := r.call(&message{op: opExport, args: []int64{int64(b.ID), b.Size}}, -1)
	if err != nil {
		return nil, err
	}
	if fd < 0 {
		return nil, fmt.Errorf("%w: export without a file", errProtocol)
	}
	return os.NewFile(uintptr(fd), "gpu-export"), nil
}

func (r *remote) Stats() Stats {
	m, fd, err := r.call(&message{op: opStats}, -1)
	if fd >= 0 {
		unix.Close(fd)
	}
	if err != nil || m.want(3) != nil {
		return Stats{}
	}
	return Stats{Blocks: int(m.args[0]), BlockBytes: m.args[1], DeviceBytes: m.args[2]}
}

// Close says goodbye and shuts the connection for writing, so that the
// helper answers what it has and ends the session; it exits (freeing the
// device) once no other daemon's session is left. A helper this daemon
// started gets exitTimeout to exit, and is killed after.
func (r *remote) Close() error {
	r.mu.Lock()
	if r.closing {
		r.mu.Unlock()
		return nil
	}
	r.closing = true
	r.mu.Unlock()
	send(r.conn, &message{op: opBye}, -1)
	r.conn.CloseWrite()
	var err error
	select {
	case <-r.gone: // every call has its answer
	case <-time.After(exitTimeout):
		r.kill()
		<-r.gone
		err = fmt.Errorf("gpu helper did not end the session within %v; killed", exitTimeout)
	}
	if r.proc != nil && err == nil {
		select {
		case <-r.exited:
		case <-time.After(exitTimeout):
			r.kill()
			<-r.exited
			err = fmt.Errorf("gpu helper did not exit within %v; killed", exitTimeout)
		}
	}
	r.conn.Close()
	r.door.Close()
	r.stagingMu.Lock()
	defer r.stagingMu.Unlock()
	unix.Munmap(r.staging)
	r.staging = nil
	return err
}

// Owned is a block of a helper's, as Claim lists it: its tag is what the
// daemon that made it said with Tag, nil before.
type Owned struct {
	Block      Block
	Exportable bool
	Tag        []byte
}

// Survivor is a Device whose blocks outlive its daemon (Start's, Attach's):
// a daemon tags each block with what it needs to find it again, and its
// successor claims them.
type Survivor interface {
	Device
	// Tag gives b a tag of at most 256 bytes, in place of its last.
	Tag(b Block, tag []byte) error
	// Claim has the helper refuse the calls of every other daemon's
	// session, once those in flight are answered, and lists its blocks
	// with their tags: from then on this daemon alone changes them. Should
	// this daemon's session end before Settle, the others are served again
	// (a predecessor whose successor failed to take the mount over).
	Claim() ([]Owned, error)
	// Settle ends the other daemons' sessions, once this one serves the
	// mount; their calls in flight are answered to nobody. The claim ends
	// with them, so that this daemon's successor can claim in turn.
	Settle() error
}

func (r *remote) Tag(b Block, tag []byte) error {
	m := &message{op: opTag, args: []int64{int64(b.ID), b.Size}, data: tag}
	_, fd, err := r.call(m, -1)
	if fd >= 0 {
		unix.Close(fd)
	}
	return err
}

func (r *remote) Settle() error {
	_, fd, err := r.call(&message{op: opSettle}, -1)
	if fd >= 0 {
		unix.Close(fd)
	}
	return err
}

func (r *remote) Claim() ([]Owned, error) {
	if _, fd, err := r.call(&message{op: opClaim}, -1); err != nil {
		return nil, err
	} else if fd >= 0 {
		unix.Close(fd)
	}
	var all []Owned
	for after := int64(0); ; {
		m, fd, err := r.call(&message{op: opBlocks, args: []int64{after}}, -1)
		if fd >= 0 {
			unix.Close(fd)
		}
		if err != nil {
			return nil, err
		}
		page, err := unmarshalOwned(m.data)
		if err != nil || len(page) == 0 {
			return all, err
		}
		all = append(all, page...)
		after = int64(page[len(page)-1].Block.ID)
	}
}

// tail is the helper's stdout and stderr: it logs each line and keeps the
// last one, the helper's last word on why it exits.
type tail struct {
	log *slog.Logger

	mu       sync.Mutex // guards partial and lastLine
	partial  []byte     // output after the last newline
	lastLine string
}

// maxLine bounds a line kept or logged.
const maxLine = 1 << 10

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.partial = append(t.partial, p...)
	for {
		i := bytes.IndexByte(t.partial, '\n')
		if i < 0 {
			break
		}
		t.line(t.partial[:i])
		t.partial = t.partial[i+1:]
	}
	if len(t.partial) > maxLine {
		t.line(t.partial)
		t.partial = nil
	}
	return len(p), nil
}

func (t *tail) line(b []byte) {
	s := strings.TrimSpace(string(b[:min(len(b), maxLine)]))
	if s != "" {
		t.log.Debug("gpu helper says", "line", s)
		t.lastLine = s
	}
}

// last returns the last non-empty line written, a final one without a
// newline included.
func (t *tail) last() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	if s := strings.TrimSpace(string(t.partial)); s != "" {
		return s
	}
	return t.lastLine
}
