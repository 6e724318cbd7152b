package lifecycle

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/fdpass"
	"tensorfs/fs"
)

// A keeper ("tensorfs mount -f") is the smallest process that outlives
// its daemon: it runs the daemon as its child ("mount --kept", its
// socket to the keeper on descriptor 3), holds the FUSE descriptor the
// daemon gives it and a journal of the daemon's handles and backing
// files, and when the daemon dies of anything but an unmount it starts a
// new one that takes the connection over (fs.Takeover.Crashed). It also
// runs restarts (tensorfs restart asks it on NAME.keeper): the new daemon
// takes the mount from the old one (handover socket) through it.
//
// On the daemon's socket, the daemon sends one-byte tags: msgHello
// (header, the FUSE descriptor) once it serves, msgRecord (fs.Record)
// for each change; a successor msgWant once it is ready to take the
// mount over, and msgGo once it can serve. The keeper answers msgWant
// with a takeover (send), and msgGo with msgGone once the predecessor is
// gone.
const (
	msgHello  = 'h'
	msgRecord = 'r'
	msgWant   = 'w'
	msgGo     = 'g'
	msgGone   = 'o'
)

// KeeperFd is the descriptor a kept daemon reaches its keeper on.
const KeeperFd = 3

// GPUDoorFd is the descriptor on which a successor gets the GPU helper's
// door from its keeper, when the keeper holds one: the successor attaches
// to the helper rather than start one (gpu.Attach, DESIGN.md §12).
// GPUPidfdFd is the helper's pidfd, which comes with the door, so that the
// successor can kill a helper that hangs.
const (
	GPUDoorFd  = BinaryFd + 1
	GPUPidfdFd = GPUDoorFd + 1
)

const (
	// startTries is how many new daemons in a row may be killed before
	// they serve, after a crash, before the keeper gives up: the mount
	// is then as after a crash.
	startTries = 5
	// startWait bounds a new daemon's start.
	startWait = time.Minute
)

// keeper holds a mount's connection and runs its daemons.
type keeper struct {
	mp   string
	args []string // "mount" arguments after "mount", -f included
	log  *slog.Logger

	mu sync.Mutex
	fd int // the FUSE connection, once a daemon sent it; -1 before
	// init and gen are the connection's INIT and the current daemon's
	// generation.
	init []byte
	gen  uint64
	// handles and backing are the current daemon's, as journaled;
	// orphans the descriptors of its orphans' backing files
	// (fs.Takeover.Orphans), each kept while a handle of it is open;
	// imports the descriptors of its imports (fs.Takeover.Imports), from
	// the import to its removal. Each is one the daemon holds too, charged
	// to a user in its descriptor budget (imports) or held by a handle
	// charged there (orphans): the keeper holds no more than that budget.
	handles map[uint64]fs.Handle
	backing map[uint64]int32
	orphans map[uint64]int
	imports map[fs.Import]int
	// lease is a cluster node's etcd lease, as journaled; listener its
	// piece server's socket, which the first daemon sent with its hello.
	lease    int64
	listener *os.File
	// door is the GPU helper's (gpu.Door), from the last hello that
	// carried one: each successor attaches to the helper through it
	// (GPUDoorFd), and the helper lives while it is held. gpuPidfd is the
	// helper's pidfd that came with it (GPUPidfdFd); nil if none did.
	door, gpuPidfd *os.File
	// unnamed are the other nodes the kernel holds that no name reaches
	// (fs.State.Unnamed).
	unnamed map[uint64]bool
}

// daemon is one daemon a keeper runs.
type daemon struct {
	cmd    *exec.Cmd
	c      *net.UnixConn
	exited chan struct{}
	err    error // cmd.Wait's, once exited
	hello  chan handoverHeader
	wants  chan struct{}
	goes   chan struct{}
	read   chan struct{} // closed once its messages are all read
	out    *tailWriter   // the end of its stderr, for errors
	mode   string        // what it said hello with
	binary *binary       // what it runs, which its successor after a crash runs too
}

// Keep runs the keeper of mp: a daemon of this executable with "mount"
// args (-f included), and its successors. ready is called with the first
// daemon's mode and pid once it serves. It returns once a daemon exits after an
// unmount (nil), or when no daemon serves the mount any more.
func Keep(mp string, args []string, log *slog.Logger, ready func(mode string, pid int)) error {
	self, err := selfBinary()
	if err != nil {
		return err
	}
	// The keeper holds a descriptor per import and orphan the daemon
	// holds, at most the daemon's budget: half the same limit.
	raiseFileLimit()
	k := &keeper{mp: mp, args: args, log: log, fd: -1, handles: map[uint64]fs.Handle{}, backing: map[uint64]int32{}, orphans: map[uint64]int{}, imports: map[fs.Import]int{}, unnamed: map[uint64]bool{}}
	d, err := k.start(self, nil)
	if err != nil {
		return err
	}
	ready(d.mode, d.cmd.Process.Pid)
	restarts := make(chan restartReq)
	stop, err := k.listen(restarts)
	if err != nil {
		d.cmd.Process.Kill()
		return fmt.Errorf("keeper socket: %w", err)
	}
	defer stop()
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	for {
		select {
		case s := <-sigs:
			d.cmd.Process.Signal(s) // the daemon unmounts
		case r := <-restarts:
			next, err := k.restart(d, r.binary)
			if err == nil {
				if d.binary != next.binary {
					d.binary.f.Close()
				}
				d = next
				r.ready <- fmt.Sprintf("ready pid=%d mode=%s mountpoint=%s", d.cmd.Process.Pid, d.mode, mp)
				continue
			}
			r.ready <- "error: " + err.Error()
			r.binary.f.Close()
			select {
			case <-d.exited:
				// It handed over to a daemon that then failed: as after
				// a crash, from what it handed over.
				if d, err = k.recover(d); err != nil {
					return k.gone(err)
				}
			default:
			}
		case <-d.exited:
			if d.err == nil {
				return nil // unmounted
			}
			if d, err = k.recover(d); err != nil {
				return k.gone(err)
			}
		}
	}
}

// gone logs that no daemon serves the mount any more, and why.
func (k *keeper) gone(err error) error {
	k.log.Error("no daemon serves the mount any more; it is as after a crash", "err", err)
	return err
}

// recover starts a daemon that takes the connection over from d, which
// died, with what d journaled; again if that one is killed before it
// serves, up to startTries times. One that fails by itself (an exit
// status: a broken binary, a bad flag) ends it.
func (k *keeper) recover(d *daemon) (*daemon, error) {
	for try := 1; ; try++ {
		k.log.Error("the daemon died; a new one takes the mount over", "pid", d.cmd.Process.Pid, "status", d.err)
		if !mountedAt(k.mp) {
			return nil, errors.New("the mount is gone")
		}
		next, err := k.start(d.binary, func() (*fs.Takeover, error) {
			t := k.takeover()
			t.Crashed = true
			return t, nil
		})
		if err == nil {
			k.log.Info("a new daemon serves the mount", "pid", next.cmd.Process.Pid)
			return next, nil
		}
		var exit *exec.ExitError
		if next == nil || !errors.As(next.err, &exit) || exit.Exited() || try == startTries {
			return nil, fmt.Errorf("a new daemon: %w", err)
		}
		d = next // killed before it served: once more
	}
}

// takeover is what a successor of the current daemon gets from the
// keeper: the connection and the journal.
func (k *keeper) takeover() *fs.Takeover {
	k.mu.Lock()
	defer k.mu.Unlock()
	t := &fs.Takeover{Fd: k.fd, Init: k.init, Gen: k.gen + 1, Lease: k.lease, Listener: k.listener}
	for _, h := range k.handles {
		t.State.Handles = append(t.State.Handles, h)
	}
	for node, id := range k.backing {
		t.State.Backing = append(t.State.Backing, fs.Backing{Node: node, ID: id})
	}
	t.State.Unnamed = slices.Collect(maps.Keys(k.unnamed))
	t.Orphans = maps.Clone(k.orphans) // still the keeper's
	t.Imports = maps.Clone(k.imports)
	return t
}

// restart has binary take the mount over from d, which serves it. d
// hands it over only once the new daemon is ready to take it: d holds
// requests off from then on.
func (k *keeper) restart(d *daemon, binary *binary) (*daemon, error) {
	var cancel func()
	var fd int = -1
	var handed fs.Takeover
	next, err := k.start(binary, func() (*fs.Takeover, error) {
		t, c, err := receiveMount(k.mp, d.cmd.Process.Pid)
		if err != nil {
			return nil, err
		}
		cancel, fd, handed = c, t.Fd, *t
		t.Listener = k.listener // the keeper's since the first hello
		handoff := t.Handoff
		t.Handoff = func() error {
			err := handoff()
			<-d.exited
			return err
		}
		return t, nil
	})
	if fd >= 0 {
		unix.Close(fd) // the keeper holds its own
	}
	closeTakeover(handed) // the keeper took copies, if the new daemon took them over
	if err != nil && cancel != nil {
		cancel()
	}
	return next, err
}

// start starts binary as a daemon, checked again (binary.check): a
// successor if fetch is not nil, which takes over what fetch returns once
// it asks (ready to serve), and whose predecessor the takeover's Handoff
// stops. It returns once the daemon serves, or with an error, and the
// daemon if it exited before it served.
func (k *keeper) start(binary *binary, fetch func() (*fs.Takeover, error)) (*daemon, error) {
	if err := binary.check(); err != nil {
		k.log.Error("a daemon's binary is refused", "err", err)
		return nil, err
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	child := os.NewFile(uintptr(pair[1]), "keeper")
	conn, err := net.FileConn(os.NewFile(uintptr(pair[0]), "daemon"))
	if err != nil {
		return nil, err
	}
	args := append([]string{"mount", "--kept"}, k.args...)
	if fetch != nil {
		args = append([]string{"mount", "--kept", "--takeover"}, k.args...)
	}
	cmd := binary.command(child, args...)
	k.mu.Lock()
	if fetch != nil && k.door != nil {
		cmd.ExtraFiles = append(cmd.ExtraFiles, k.door) // GPUDoorFd
		if k.gpuPidfd != nil {
			cmd.ExtraFiles = append(cmd.ExtraFiles, k.gpuPidfd) // GPUPidfdFd
		}
	}
	k.mu.Unlock()
	d := &daemon{cmd: cmd, c: conn.(*net.UnixConn), exited: make(chan struct{}), hello: make(chan handoverHeader, 1), wants: make(chan struct{}, 1), goes: make(chan struct{}, 1), read: make(chan struct{}), out: &tailWriter{}, binary: binary}
	d.cmd.Stderr = io.MultiWriter(os.Stderr, d.out)
	// A daemon dies with its keeper: the mount is then as after a crash.
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	err = d.cmd.Start()
	child.Close() // the daemon's alone: its exit ends d.c
	if err != nil {
		d.c.Close()
		return nil, err
	}
	go func() {
		d.err = d.cmd.Wait()
		close(d.exited)
	}()
	go k.read(d)
	var t *fs.Takeover
	timeout := time.After(startWait)
	for {
		select {
		case <-d.wants:
			var err error
			if t, err = fetch(); err != nil {
				d.cmd.Process.Kill()
				return nil, err
			}
			if send(d.c, *t) != nil {
				d.cmd.Process.Kill() // it died, or will: its exit says why
			}
		case <-d.goes:
			if t == nil {
				continue // no takeover asked for: nothing to hand off
			}
			if t.Handoff != nil {
				if err := t.Handoff(); err != nil {
					d.cmd.Process.Kill()
					return nil, err
				}
			}
			k.mu.Lock()
			k.gen, k.handles, k.backing = t.Gen, map[uint64]fs.Handle{}, map[uint64]int32{}
			for _, h := range t.State.Handles {
				k.handles[h.Fh] = h
			}
			for _, b := range t.State.Backing {
				k.backing[b.Node] = b.ID
			}
			// Copies first: after a crash, t's are the keeper's own.
			orphans, imports := dupFds(t.Orphans), dupFds(t.Imports)
			closeFds(k.orphans)
			closeFds(k.imports)
			k.orphans, k.imports = orphans, imports
			k.unnamed = map[uint64]bool{}
			for _, id := range t.State.Unnamed {
				k.unnamed[id] = true
			}
			k.mu.Unlock()
			fdpass.Send(d.c, []byte{msgGone})
		case h := <-d.hello:
			d.mode = h.Mode
			return d, nil
		case <-d.exited:
			<-d.read
			select {
			case h := <-d.hello: // it served, and died since: the caller sees it exited
				d.mode = h.Mode
				return d, nil
			default:
			}
			return d, fmt.Errorf("the daemon exited (%v) before it served: %s", d.err, strings.TrimSpace(d.out.String()))
		case <-timeout:
			d.cmd.Process.Kill()
			return nil, fmt.Errorf("the daemon did not serve within %v", startWait)
		}
	}
}

// read reads d's messages until it exits: its hello (the keeper keeps
// the first FUSE descriptor and INIT it gets), its journal, its go.
func (k *keeper) read(d *daemon) {
	defer close(d.read)
	defer d.c.Close()
	for {
		m, err := fdpass.Recv(d.c, chunk, 4)
		if err != nil || len(m.Data) == 0 {
			fdpass.Close(m.FDs)
			return
		}
		body := m.Data[1:]
		switch m.Data[0] {
		case msgHello:
			var h handoverHeader
			json.Unmarshal(body, &h)
			k.mu.Lock()
			if n := 1 + btoi(h.Listener); h.GPU && (len(m.FDs) == n+1 || len(m.FDs) == n+2) {
				k.holdGPU(m.FDs[n:])
				m.FDs = m.FDs[:n]
			}
			if k.fd < 0 && len(m.FDs) == 1+btoi(h.Listener) {
				k.fd, k.init = m.FDs[0], h.Init
				if h.Listener {
					k.listener = os.NewFile(uintptr(m.FDs[1]), "piece server")
				}
				m.FDs = nil
			}
			k.mu.Unlock()
			fdpass.Close(m.FDs)
			d.hello <- h
		case msgRecord:
			var r fs.Record
			if json.Unmarshal(body, &r) == nil {
				m.FDs = k.apply(r, m.FDs)
			}
			fdpass.Close(m.FDs)
		case msgWant:
			d.wants <- struct{}{}
		case msgGo:
			d.goes <- struct{}{}
		default:
			fdpass.Close(m.FDs)
		}
	}
}

// holdGPU holds fds, a GPU helper's door and, if given, its pidfd, in
// place of those held; mu is held.
func (k *keeper) holdGPU(fds []int) {
	for _, f := range []*os.File{k.door, k.gpuPidfd} {
		if f != nil {
			f.Close()
		}
	}
	k.door, k.gpuPidfd = os.NewFile(uintptr(fds[0]), "gpu door"), nil
	if len(fds) > 1 {
		k.gpuPidfd = os.NewFile(uintptr(fds[1]), "gpu helper pidfd")
	}
}

// apply applies a journal record, which came with fds, to the current
// daemon's state, and returns the descriptors it did not keep.
func (k *keeper) apply(r fs.Record, fds []int) []int {
	k.mu.Lock()
	defer k.mu.Unlock()
	switch {
	case r.Orphan != 0 && len(fds) == 1 && k.holds(r.Orphan):
		if old, ok := k.orphans[r.Orphan]; ok {
			unix.Close(old)
		}
		k.orphans[r.Orphan] = fds[0]
		return nil
	case r.Import != nil && len(fds) == 1:
		if old, ok := k.imports[*r.Import]; ok {
			unix.Close(old)
		}
		k.imports[*r.Import] = fds[0]
		return nil
	case r.Unimport != nil:
		if fd, ok := k.imports[*r.Unimport]; ok {
			unix.Close(fd)
			delete(k.imports, *r.Unimport)
		}
	case r.Open != nil:
		k.handles[r.Open.Fh] = *r.Open
	case r.Release != 0:
		node := k.handles[r.Release].Node
		delete(k.handles, r.Release)
		if fd, ok := k.orphans[node]; ok && !k.holds(node) {
			unix.Close(fd)
			delete(k.orphans, node)
		}
	case r.Backing != nil && r.Backing.ID != 0:
		k.backing[r.Backing.Node] = r.Backing.ID
	case r.Backing != nil:
		delete(k.backing, r.Backing.Node)
	case r.Lease != 0:
		k.lease = r.Lease
	case r.Unnamed != 0:
		k.unnamed[r.Unnamed] = true
	case r.Forgotten != 0:
		delete(k.unnamed, r.Forgotten)
	}
	return fds
}

// holds reports whether a handle of node is open; mu is held.
func (k *keeper) holds(node uint64) bool {
	for _, h := range k.handles {
		if h.Node == node {
			return true
		}
	}
	return false
}

// dupFds returns copies of the descriptors of fds.
func dupFds[K comparable](fds map[K]int) map[K]int {
	dups := map[K]int{}
	for k, fd := range fds {
		if dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0); err == nil {
			dups[k] = dup
		}
	}
	return dups
}

// restartReq is a restart asked on the keeper's socket.
type restartReq struct {
	binary *binary
	ready  chan string // the new daemon's ready line, or "error: ..."
}

// keeperPath is the socket tensorfs restart asks mp's keeper on.
func keeperPath(mp string) string { return alloc.StatePath(mp, ".keeper") }

// listen takes restarts on the keeper's socket, mode 0600, from its
// user only (SO_PEERCRED): a binary's path, answered with the new
// daemon's ready line or the error.
func (k *keeper) listen(restarts chan<- restartReq) (stop func(), err error) {
	p := keeperPath(k.mp)
	ln, err := listenPrivate(p)
	if err != nil {
		return nil, err
	}
	go func() {
		for {
			c, err := ln.AcceptUnix()
			if err != nil {
				return
			}
			k.serveRestart(c, restarts)
			c.Close()
		}
	}()
	return func() { ln.Close() }, nil
}

// serveRestart answers one restart request on c.
func (k *keeper) serveRestart(c *net.UnixConn, restarts chan<- restartReq) {
	cred, err := peerCred(c)
	if err != nil || int(cred.Uid) != os.Geteuid() {
		k.log.Warn("restart refused: the peer is not the keeper's user", "err", err)
		return
	}
	m, err := fdpass.Recv(c, 4096, 0)
	if err != nil {
		return
	}
	b, err := openBinary(string(m.Data))
	if err != nil {
		k.log.Error("restart refused; the daemon serves on", "err", err)
		fdpass.Send(c, []byte("error: "+err.Error()))
		return
	}
	r := restartReq{binary: b, ready: make(chan string, 1)}
	restarts <- r
	reply := <-r.ready
	if strings.HasPrefix(reply, "error: ") {
		k.log.Error("restart failed; the daemon serves on", "binary", b.path, "err", reply)
	}
	fdpass.Send(c, []byte(reply))
}

// Restart has mp's keeper start binary, which takes the live mount over
// from the daemon serving it, and returns the new daemon's ready line
// once the old one has exited. A binary that fails leaves the old one
// serving; the error quotes its log.
func Restart(mp, binary string) (ready string, err error) {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: keeperPath(mp), Net: "unixpacket"})
	if err != nil {
		return "", fmt.Errorf("no keeper serves %s: %w", mp, err)
	}
	defer c.Close()
	if err := fdpass.Send(c, []byte(binary)); err != nil {
		return "", err
	}
	m, err := fdpass.Recv(c, 64<<10, 0)
	if err != nil {
		return "", err
	}
	if reply, ok := strings.CutPrefix(string(m.Data), "error: "); ok {
		return "", errors.New(reply)
	}
	return string(m.Data), nil
}

// tailWriter keeps the last 4 KiB written to it.
type tailWriter struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *tailWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.b.Write(p)
	if n := w.b.Len(); n > 4096 {
		w.b.Next(n - 4096)
	}
	return len(p), nil
}

func (w *tailWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}
