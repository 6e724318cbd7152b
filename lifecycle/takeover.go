package lifecycle

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/fdpass"
	"tensorfs/fs"
)

// A daemon hands its mount to a successor (tensorfs restart) on a socket
// in the state directory, mode 0600, and to no peer but its keeper (its
// parent, of its user: SO_PEERCRED); the keeper takes it only from its
// daemon. The FUSE descriptor goes with the first message, the
// state (fs.State, JSON) follows in chunks, then the orphans' descriptors
// (fs.Takeover.Orphans), up to maxFds a message with their node IDs,
// then the imports' (fs.Takeover.Imports) with their ids and senders;
// the successor answers "go"
// once it can serve, and the daemon exits at once, leaving the mount,
// the backing and the pid file to it.

// handoverPath is the socket mp's daemon hands its mount over on.
func handoverPath(mp string) string { return alloc.StatePath(mp, ".handover") }

// handoverHeader is the first message of a handover.
type handoverHeader struct {
	Init    []byte `json:"init"`
	Gen     uint64 `json:"gen"`
	Crashed bool   `json:"crashed,omitempty"`
	// Size is the state's, in bytes.
	Size int `json:"size"`
	// Orphans is how many orphans' descriptors follow the state.
	Orphans int `json:"orphans,omitempty"`
	// Imports is how many imports' descriptors follow the orphans'.
	Imports int `json:"imports,omitempty"`
	// Lease is a cluster node's etcd lease; Listener says that its piece
	// server's socket follows the FUSE descriptor (a keeper's takeover,
	// or a daemon's hello).
	Lease    int64 `json:"lease,omitempty"`
	Listener bool  `json:"listener,omitempty"`
	// Mode is the daemon's ("passthrough" or "classic"), in a daemon's
	// hello to its keeper; GPU says that its GPU helper's door follows
	// the other descriptors (gpu.Door), then the helper's pidfd if the
	// daemon has it, which the keeper holds and gives each successor on
	// GPUDoorFd and GPUPidfdFd.
	Mode string `json:"mode,omitempty"`
	GPU  bool   `json:"gpu,omitempty"`
}

const (
	// chunk is the most bytes of state one message carries: well under
	// a socket's send buffer.
	chunk = 64 << 10
	// maxState bounds the state a successor takes (some 100 bytes per
	// node the kernel knows and per handle).
	maxState = 1 << 30
	// handoffWait bounds how long a successor waits for its predecessor
	// to exit.
	handoffWait = 10 * time.Second
	// maxFds is the most descriptors one message carries (the kernel's
	// SCM_MAX_FD is 253).
	maxFds = 250
)

// listenPrivate listens on a new socket at p, mode 0600 (not through the
// umask: a daemon's is 0, and another thread may create a file meanwhile).
// Its peers are checked as well (peerCred).
func listenPrivate(p string) (*net.UnixListener, error) {
	os.Remove(p)
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: p, Net: "unixpacket"})
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(p, 0o600); err != nil {
		ln.Close()
		return nil, err
	}
	return ln, nil
}

// peerCred returns the credentials of c's peer.
func peerCred(c *net.UnixConn) (*unix.Ucred, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var credErr error
	if err := rc.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, credErr
}

// listenHandover hands srv's mount at mp to its keeper when it asks, and
// exits the process once the successor says "go". The returned function
// stops listening.
func listenHandover(mp string, srv *fs.Server, log *slog.Logger) (stop func(), err error) {
	p := handoverPath(mp)
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
			if err := handOver(c, srv, log); err != nil {
				log.Warn("handover refused or failed; serving on", "err", err)
			}
			c.Close()
		}
	}()
	return func() { ln.Close() }, nil
}

// handOver sends srv's mount on c and exits once the successor says
// "go"; it returns if the peer is not this daemon's keeper (its parent,
// of its user) or does not take the mount.
func handOver(c *net.UnixConn, srv *fs.Server, log *slog.Logger) error {
	cred, err := peerCred(c)
	if err != nil {
		return err
	}
	if int(cred.Uid) != os.Geteuid() || int(cred.Pid) != os.Getppid() {
		return fmt.Errorf("peer pid %d uid %d is not this daemon's keeper", cred.Pid, cred.Uid)
	}
	t, resume, err := srv.Handover()
	if err != nil {
		return err
	}
	if err := send(c, t); err != nil {
		closeTakeover(t)
		resume()
		return err
	}
	m, err := fdpass.Recv(c, 16, 0)
	if err != nil || string(m.Data) != "go" {
		closeTakeover(t)
		resume()
		return fmt.Errorf("the successor (pid %d) did not take the mount: %v", cred.Pid, err)
	}
	log.Info("handed the mount over; exiting", "to", cred.Pid)
	// Nothing of the mount is closed: it is the successor's now. The
	// requests held off since Handover die with this daemon, and the
	// kernel sends them to the successor.
	os.Exit(0)
	return nil
}

// send sends t on c: the header with the FUSE descriptor, then the state
// in chunks, then the orphans' and the imports' descriptors. The
// descriptors stay the caller's.
func send(c *net.UnixConn, t fs.Takeover) error {
	state, err := json.Marshal(t.State)
	if err != nil {
		return err
	}
	hdr, _ := json.Marshal(handoverHeader{Init: t.Init, Gen: t.Gen, Crashed: t.Crashed, Size: len(state), Orphans: len(t.Orphans), Imports: len(t.Imports),
		Lease: t.Lease, Listener: t.Listener != nil})
	fds := []int{t.Fd}
	if t.Listener != nil {
		fds = append(fds, rawFd(t.Listener))
	}
	if err := fdpass.Send(c, hdr, fds...); err != nil {
		return err
	}
	for len(state) > 0 {
		n := min(chunk, len(state))
		if err := fdpass.Send(c, state[:n]); err != nil {
			return err
		}
		state = state[n:]
	}
	if err := sendFds(c, t.Orphans); err != nil {
		return err
	}
	return sendFds(c, t.Imports)
}

// sendFds sends the descriptors of fds on c, up to maxFds a message with
// their keys (JSON).
func sendFds[K comparable](c *net.UnixConn, fds map[K]int) error {
	var keys []K
	var all []int
	for k, fd := range fds {
		keys, all = append(keys, k), append(all, fd)
	}
	for len(keys) > 0 {
		n := min(maxFds, len(keys))
		b, _ := json.Marshal(keys[:n])
		if err := fdpass.Send(c, b, all[:n]...); err != nil {
			return err
		}
		keys, all = keys[n:], all[n:]
	}
	return nil
}

// closeTakeover closes the orphans' and imports' descriptors of t.
func closeTakeover(t fs.Takeover) {
	closeFds(t.Orphans)
	closeFds(t.Imports)
}

// closeFds closes the descriptors of fds.
func closeFds[K comparable](fds map[K]int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// receiveMount takes mp's mount over from pid, the daemon that serves
// it, of this process's user. Handoff, in the result, tells it to go and
// waits until it has; until then, cancel lets it serve on.
func receiveMount(mp string, pid int) (t *fs.Takeover, cancel func(), err error) {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: handoverPath(mp), Net: "unixpacket"})
	if err != nil {
		return nil, nil, fmt.Errorf("the daemon (pid %d) does not hand its mount over: %w", pid, err)
	}
	if t, err = receive(c, pid); err != nil {
		c.Close()
		return nil, nil, err
	}
	t.Handoff = func() error {
		defer c.Close()
		if err := fdpass.Send(c, []byte("go")); err != nil {
			return err
		}
		// Once it has exited, its descriptors (the control socket's
		// too) are closed.
		if !waitExit(pid, handoffWait) {
			return fmt.Errorf("the predecessor (pid %d) did not exit within %v", pid, handoffWait)
		}
		return nil
	}
	return t, func() { c.Close() }, nil
}

// receiveFromKeeper asks the keeper (this process's parent) on c for the
// mount, and reads the takeover it sends; its Handoff says "go" to the keeper and waits for
// its predecessor to be gone.
func receiveFromKeeper(c *net.UnixConn) (*fs.Takeover, error) {
	if err := fdpass.Send(c, []byte{msgWant}); err != nil {
		return nil, err
	}
	t, err := receive(c, os.Getppid())
	if err != nil {
		return nil, err
	}
	t.Handoff = func() error {
		if err := fdpass.Send(c, []byte{msgGo}); err != nil {
			return err
		}
		m, err := fdpass.Recv(c, 16, 0)
		if err != nil || string(m.Data) != string(msgGone) {
			return fmt.Errorf("the keeper did not let the predecessor go: %v", err)
		}
		return nil
	}
	return t, nil
}

// journalTo returns a journal that sends each record to the keeper on c,
// an orphan's or an import's with its descriptor, which it closes then.
func journalTo(c *net.UnixConn) func(fs.Record) {
	return func(r fs.Record) {
		b, _ := json.Marshal(r)
		if !r.HasFd() {
			fdpass.Send(c, append([]byte{msgRecord}, b...))
			return
		}
		fdpass.Send(c, append([]byte{msgRecord}, b...), r.Fd)
		unix.Close(r.Fd)
	}
}

// hello tells the keeper on c that srv serves: its mode, and the
// connection with its INIT, a cluster node's piece server's socket, and
// the GPU helper's door and pidfd (nil for none), which the keeper holds.
func hello(c *net.UnixConn, srv *fs.Server, door, pidfd *os.File) error {
	fd, err := fs.ConnectionFd()
	if err != nil {
		return err
	}
	l, err := srv.ClusterListener()
	if err != nil {
		return err
	}
	fds := []int{fd}
	if l != nil {
		defer l.Close()
		fds = append(fds, rawFd(l))
	}
	if door != nil {
		fds = append(fds, int(door.Fd()))
		if pidfd != nil {
			fds = append(fds, int(pidfd.Fd()))
		}
	}
	b, _ := json.Marshal(handoverHeader{Init: fs.InitBytes(srv.Server), Mode: srv.Mode(), Listener: l != nil, GPU: door != nil})
	return fdpass.Send(c, append([]byte{msgHello}, b...), fds...)
}

// receive reads a handover from c, whose peer must be pid of this
// process's user.
func receive(c *net.UnixConn, pid int) (*fs.Takeover, error) {
	cred, err := peerCred(c)
	if err != nil {
		return nil, err
	}
	if int(cred.Pid) != pid || int(cred.Uid) != os.Geteuid() {
		return nil, fmt.Errorf("the handover socket is pid %d uid %d's, not the daemon's (pid %d)", cred.Pid, cred.Uid, pid)
	}
	m, err := fdpass.Recv(c, chunk, 2)
	if err != nil {
		return nil, err
	}
	var h handoverHeader
	if err := json.Unmarshal(m.Data, &h); err != nil || len(m.FDs) != 1+btoi(h.Listener) || h.Size < 0 || h.Size > maxState {
		fdpass.Close(m.FDs)
		return nil, fmt.Errorf("a malformed handover (%d descriptors, %d bytes of state): %v", len(m.FDs), h.Size, err)
	}
	t := &fs.Takeover{Fd: m.FDs[0], Init: h.Init, Gen: h.Gen, Crashed: h.Crashed, Lease: h.Lease}
	if h.Listener {
		t.Listener = os.NewFile(uintptr(m.FDs[1]), "piece server")
	}
	if err := receiveState(c, h, t); err != nil {
		unix.Close(t.Fd)
		if t.Listener != nil {
			t.Listener.Close()
		}
		return nil, fmt.Errorf("a malformed handover: %v", err)
	}
	return t, nil
}

// receiveState reads the state and the descriptors that follow header h
// on c into t.
func receiveState(c *net.UnixConn, h handoverHeader, t *fs.Takeover) error {
	state := make([]byte, 0, h.Size)
	for len(state) < h.Size {
		m, err := fdpass.Recv(c, chunk, 0)
		if err == nil && len(state)+len(m.Data) > h.Size {
			err = fmt.Errorf("%d bytes past its size", len(state)+len(m.Data)-h.Size)
		}
		if err != nil {
			return fmt.Errorf("after %d bytes: %v", len(state), err)
		}
		state = append(state, m.Data...)
	}
	if err := json.Unmarshal(state, &t.State); err != nil {
		return err
	}
	var err error
	if t.Orphans, err = receiveFds[uint64](c, h.Orphans); err != nil {
		return err
	}
	if t.Imports, err = receiveFds[fs.Import](c, h.Imports); err != nil {
		closeFds(t.Orphans)
	}
	return err
}

// rawFd returns f's descriptor as it is: os.File.Fd would make it
// blocking, and a socket's duplicates share that with the daemon's
// listener.
func rawFd(f *os.File) int {
	fd := -1
	if rc, err := f.SyscallConn(); err == nil {
		rc.Control(func(u uintptr) { fd = int(u) })
	}
	return fd
}

// btoi is 1 for true, 0 for false.
func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// receiveFds reads n descriptors from c, with their keys (sendFds).
func receiveFds[K comparable](c *net.UnixConn, n int) (map[K]int, error) {
	fds := map[K]int{}
	for got := 0; got < n; {
		m, err := fdpass.Recv(c, chunk, maxFds)
		var keys []K
		if err == nil {
			err = json.Unmarshal(m.Data, &keys)
		}
		if err == nil && (len(keys) != len(m.FDs) || len(keys) == 0 || got+len(keys) > n) {
			err = fmt.Errorf("%d keys with %d descriptors, %d of %d read", len(keys), len(m.FDs), got, n)
		}
		if err != nil {
			fdpass.Close(m.FDs)
			closeFds(fds)
			return nil, err
		}
		for i, k := range keys {
			if old, ok := fds[k]; ok {
				unix.Close(old)
			}
			fds[k] = m.FDs[i]
		}
		got += len(keys)
	}
	return fds, nil
}
