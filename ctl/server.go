package ctl

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"tensorfs/fdpass"
	"tensorfs/ledger"
)

// Cred is a peer's credentials as the kernel recorded them when it
// connected (SO_PEERCRED, SO_PEERGROUPS): later changes to the peer's
// credentials, its exit or the reuse of its pid change nothing.
type Cred struct {
	Pid      int32
	Uid, Gid uint32
	// Groups are the supplementary groups.
	Groups []uint32
}

// InGroup reports whether gid is the peer's primary group or one of its
// supplementary groups.
func (c Cred) InGroup(gid uint32) bool {
	return c.Gid == gid || slices.Contains(c.Groups, gid)
}

// Backend serves the segment operations (package fs implements it). Paths
// are relative to the mount root, cleaned, never escaping it (ctl rejects
// absolute paths, "..", empty and NUL-containing paths with EINVAL before
// calling the backend). The backend checks cred's permissions, as open(2)
// on the path would. Calls come concurrently, one goroutine per
// connection; a call may hold up to backendFDs (4) descriptors at once
// beyond its arguments, which ctl counts against the peer's limits.
type Backend interface {
	// Export opens the KEEPFD segment at path for the peer; write asks for
	// a read-write descriptor. ctl sends the file to the peer and then
	// closes it.
	Export(cred Cred, path string, write bool) (*os.File, error)
	// Import makes f the segment at path without copying (FROMFD), with
	// optional dtype and shape ("" = unset). f is whatever descriptor the
	// peer sent: the backend checks its type, and uses f.SyscallConn rather
	// than f.Fd, which would clear O_NONBLOCK on the peer's open file
	// description. ctl closes f when Import returns; a backend that keeps
	// the descriptor duplicates it.
	Import(cred Cred, path string, f *os.File, dtype, shape string) error
}

// A Loader is a Backend that also serves load: the segments under a
// directory, with a descriptor of each, in one reply.
type Loader interface {
	// Load returns up to max segments under the directory path (every
	// directory on the way searchable by cred, every directory listed
	// readable), in walk order, after the segment named after ("": from
	// the start), with a descriptor for each (-1 where none is handed
	// out; Segment.FD is ignored), and whether more follow. Each is
	// read-only, or read-write if write; the whole request fails if a
	// segment is not readable (or writable) by cred. ctl sends the
	// descriptors and then closes them. cursor is the connection's: what Load kept
	// there at the connection's last load (nil at first), for the next
	// request of the same load; Load replaces it, and it goes with the
	// connection.
	Load(cred Cred, path string, write bool, after string, max int, cursor *any) ([]Segment, []int, bool, error)
}

// A Publisher is a Backend that also serves publish, pull and unpublish: a daemon
// that may join a cluster (DESIGN.md §10).
type Publisher interface {
	// Publish makes the directory path a new version of itself
	// cluster-wide, checked for cred, and returns the version's ID.
	Publish(cred Cred, path string) (string, error)
	// Pull fetches every segment below the directory path that is not
	// complete on this node, checked for cred, and returns once all are
	// (or one failed) with the bytes fetched.
	Pull(cred Cred, path string) (int64, error)
	// Unpublish withdraws the published directory path from the
	// cluster, checked for cred (its publisher's uid or root).
	Unpublish(cred Cred, path string) error
}

// Config configures a Server.
type Config struct {
	// Path is where the socket is created.
	Path string
	// Backend serves export and import.
	Backend Backend
	// Errno maps a Backend error to the errno the peer gets; nil uses the
	// syscall.Errno in the error's chain, ENOENT for fs.ErrNotExist, EACCES
	// for fs.ErrPermission, EIO otherwise.
	Errno func(error) syscall.Errno
	// Log receives refusals and events; nil discards them.
	Log *slog.Logger
	// MaxGroupWait bounds how long a group may take to fill, from its first
	// request; 0 means 60s.
	MaxGroupWait time.Duration
	// Private serves only Owner and root: other uids are refused with
	// EACCES whatever they ask (a mount without --allow-other).
	Private bool
	// Owner is the daemon's uid: the one a private socket serves besides
	// root, and the one that may ask for a purge besides root.
	Owner uint32
	// Purge is called when the owner or root asks the daemon to purge its
	// backing when it exits (op purge); nil refuses the op (EOPNOTSUPP).
	// It records the wish and returns at once.
	Purge func() error
	// PerUID and Total limit what peers may hold in the daemon, each uid
	// and all together; zero fields of Total take the defaults (4096
	// connections, 2560 waiting requests, 8192 descriptors). Listen lowers
	// Total so that the socket's descriptors stay within half of
	// RLIMIT_NOFILE, the other half being FUSE's. Root is bound by Total
	// alone; other uids together by Total less an eighth kept for root, and
	// each by PerUID, which Listen lowers to (and whose zero fields take)
	// an eighth of that: at least eight users fit.
	PerUID, Total Limits
	// Ledger is the daemon's account of what requests hold (package
	// ledger), which gets the socket's rows; nil makes one of the
	// socket's own.
	Ledger *ledger.Ledger
	// Threads is the ledger's row of goroutines that may block in the
	// kernel for a user, which the closes of peers' descriptors take
	// from; nil makes one of the socket's own.
	Threads *ledger.Row
}

// Server is a listening control socket.
type Server struct {
	cfg    Config
	ln     *net.UnixListener
	ino    uint64 // of the socket file, to remove only our own
	dev    uint64
	groups *groups
	quota  *quota
	// turning counts connections being turned away (turnAway).
	turning atomic.Int32
	ctx     context.Context // cancelled by Close
	cancel  context.CancelFunc
	wg      sync.WaitGroup // the accept loop and the connections

	mu     sync.Mutex
	conns  map[*net.UnixConn]struct{}
	closed bool

	closeOnce sync.Once
	closeErr  error
}

// Listen creates the socket at cfg.Path, removing a stale socket file
// there first, and serves it in goroutines until Close.
func Listen(cfg Config) (*Server, error) {
	if cfg.Path == "" || cfg.Backend == nil {
		return nil, errors.New("ctl: Config needs Path and Backend")
	}
	if cfg.Errno == nil {
		cfg.Errno = defaultErrno
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.MaxGroupWait <= 0 {
		cfg.MaxGroupWait = 60 * time.Second
	}
	cfg.Total = fitTotal(cfg.Total.withDefaults(defaultTotal), fdBudget())
	cfg.PerUID = cfg.PerUID.withDefaults(perUIDCap(cfg.Total)).capped(perUIDCap(cfg.Total))
	if err := removeStale(cfg.Path); err != nil {
		return nil, err
	}
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: cfg.Path, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("ctl: %w", err)
	}
	ln.SetUnlinkOnClose(false) // Close removes the file only if it is still ours
	var st unix.Stat_t
	if err := unix.Stat(cfg.Path, &st); err != nil {
		ln.Close()
		return nil, fmt.Errorf("ctl: stat %s: %w", cfg.Path, err)
	}
	if err := os.Chmod(cfg.Path, 0o666); err != nil {
		ln.Close()
		os.Remove(cfg.Path)
		return nil, fmt.Errorf("ctl: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if cfg.Ledger == nil {
		cfg.Ledger = ledger.New()
	}
	q := newQuota(cfg.Ledger, cfg.Threads, cfg.PerUID, cfg.Total)
	s := &Server{
		cfg:    cfg,
		ln:     ln,
		dev:    st.Dev,
		ino:    st.Ino,
		groups: newGroups(cfg.MaxGroupWait, q),
		quota:  q,
		ctx:    ctx,
		cancel: cancel,
		conns:  make(map[*net.UnixConn]struct{}),
	}
	cfg.Log.Info("ctl: listening", "path", cfg.Path, "private", cfg.Private,
		"conns_per_uid", cfg.PerUID.Conns, "parked_per_uid", cfg.PerUID.Parked, "fds_per_uid", cfg.PerUID.FDs,
		"conns", cfg.Total.Conns, "parked", cfg.Total.Parked, "fds", cfg.Total.FDs,
		"conns_root_reserve", q.conns.Reserve(), "parked_root_reserve", q.parked.Reserve(), "fds_root_reserve", q.fds.Reserve())
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// removeStale removes a socket file at path that nobody listens on. Any
// other file, or a live socket, is an error.
func removeStale(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("ctl: %w", err)
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("ctl: %s exists and is not a socket", path)
	}
	c, err := net.Dial("unixpacket", path)
	if err == nil {
		c.Close()
		return fmt.Errorf("ctl: %s: %w", path, syscall.EADDRINUSE)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("ctl: %s is a socket in use: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("ctl: removing stale socket: %w", err)
	}
	return nil
}

// defaultErrno is Config.Errno's default.
func defaultErrno(err error) syscall.Errno {
	var errno syscall.Errno
	switch {
	case errors.As(err, &errno) && errno != 0:
		return errno
	case errors.Is(err, fs.ErrNotExist):
		return syscall.ENOENT
	case errors.Is(err, fs.ErrPermission):
		return syscall.EACCES
	}
	return syscall.EIO
}

// closingWait bounds how long Close waits for the descriptors peers sent
// to close (quota.release).
const closingWait = 2 * time.Second

// drainWait bounds how long Close lets the requests being served finish.
const drainWait = 2 * time.Second

// Close stops accepting and ends every connection: it shuts their
// reading down, so that an idle one ends at once (its client's next send
// fails, EPIPE: nothing was read, so the client may send it again to a
// successor), and the request being served, if any, is answered first.
// After drainWait it closes the connections still served (their clients
// see them end, as in a crash) and cancels their requests (waiting group
// members leave their groups). Then it waits for the closes of the
// descriptors peers sent at most closingWait, and removes the socket file
// if it is still this server's. It is safe to call more than once.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.closed = true
		for c := range s.conns {
			c.CloseRead()
		}
		s.mu.Unlock()
		s.closeErr = s.ln.Close()
		if !waitFor(&s.wg, drainWait) {
			// Closed before cancelled, so that what the cut-off
			// requests answer reaches no one: their clients see the
			// connection end, as in a crash, and may send them again.
			s.mu.Lock()
			for c := range s.conns {
				c.Close()
			}
			s.mu.Unlock()
			s.cancel()
			s.wg.Wait()
		}
		s.cancel()
		if !s.quota.waitClosing(closingWait) {
			s.cfg.Log.Warn("ctl: closing: descriptors that peers sent are still being closed (their filesystems do not answer); going on without them", "waited", closingWait)
		}
		var st unix.Stat_t
		if unix.Stat(s.cfg.Path, &st) == nil && st.Dev == s.dev && st.Ino == s.ino {
			if err := os.Remove(s.cfg.Path); err != nil && s.closeErr == nil {
				s.closeErr = err
			}
		}
	})
	return s.closeErr
}

// closing reports whether Close has begun.
func (s *Server) closing() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// waitFor waits for wg at most d, and reports whether it ended.
func waitFor(wg *sync.WaitGroup, d time.Duration) bool {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}

// accept accepts connections until Close, backing off while the process
// is out of descriptors.
func (s *Server) accept() {
	defer s.wg.Done()
	var backoff time.Duration
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			if s.ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			s.cfg.Log.Warn("ctl: accept", "err", err, "retry", backoff)
			select {
			case <-time.After(backoff):
			case <-s.ctx.Done():
				return
			}
			continue
		}
		backoff = 0
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			return
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.serve(c)
	}
}

// serve runs one connection: a reader goroutine receives messages, which
// this goroutine answers in order. The reader also notices the peer
// leaving while a group request waits.
func (s *Server) serve(c *net.UnixConn) {
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		c.Close()
	}()
	cred, err := peerCred(c)
	if err != nil {
		s.cfg.Log.Warn("ctl: peer credentials", "err", err)
		return
	}
	if err := s.admit(cred); err != nil {
		s.turnAway(c, cred, err)
		return
	}
	defer s.quota.give(cred.Uid, Limits{Conns: 1})
	ctx, cancel := context.WithCancel(s.ctx)
	defer cancel()
	msgs := make(chan message)
	go func() {
		defer close(msgs)
		defer func() {
			// The client left: what it waits for stops. A server that
			// is closing ended the reading itself: its request is
			// answered first (Close).
			if !s.closing() {
				cancel()
			}
		}()
		for {
			msg, err := recvMsg(c, maxRequestFDs)
			if err != nil {
				return
			}
			m := message{Msg: msg}
			if m.err = s.quota.adopt(cred.Uid, m.FDs); m.err != nil {
				m.FDs = nil // closed
			}
			select {
			case msgs <- m:
			case <-ctx.Done():
				s.quota.release(m.FDs...)
				return
			}
		}
	}()
	// The reader may be stuck closing descriptors over a limit (adopt):
	// the connection ends with ctx all the same.
	var cursor any // the backend's, between a load's requests
	for {
		select {
		case m, ok := <-msgs:
			if !ok {
				return
			}
			s.handle(ctx, c, cred, m, &cursor)
		case <-ctx.Done():
			return
		}
	}
}

// admit counts a new connection from cred, or refuses it: on a private
// socket, a uid other than the owner's or root's (EACCES); over a limit
// on connections, EAGAIN.
func (s *Server) admit(cred Cred) error {
	if s.cfg.Private && cred.Uid != 0 && cred.Uid != s.cfg.Owner {
		return protoErrorf(syscall.EACCES, "the mount is private to uid %d (mount with --allow-other to share it)", s.cfg.Owner)
	}
	return s.quota.take(cred.Uid, Limits{Conns: 1})
}

// turnAway answers the first request on a connection that admit refused
// with err, waiting for it at most a second, and then closes it. Beyond
// maxTurningAway connections at once it closes them without a reply.
func (s *Server) turnAway(c *net.UnixConn, cred Cred, err error) {
	s.logRefusal(cred, "connect", err)
	if s.turning.Add(1) > maxTurningAway {
		s.turning.Add(-1)
		return
	}
	defer s.turning.Add(-1)
	c.SetReadDeadline(time.Now().Add(time.Second))
	if _, rerr := recvMsg(c, 0); rerr == nil { // room for no descriptor: the kernel drops them
		s.reply(c, cred, "connect", errorReply(s.errnoOf(err), err.Error()), nil)
	}
}

// peerCred returns the credentials of c's peer as the kernel recorded
// them at connect.
func peerCred(c *net.UnixConn) (Cred, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return Cred{}, err
	}
	var cred Cred
	var credErr error
	if err := rc.Control(func(fd uintptr) {
		var uc *unix.Ucred
		if uc, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); credErr != nil {
			credErr = fmt.Errorf("SO_PEERCRED: %w", credErr)
			return
		}
		cred = Cred{Pid: uc.Pid, Uid: uc.Uid, Gid: uc.Gid}
		cred.Groups, credErr = peerGroups(int(fd))
	}); err != nil {
		return Cred{}, err
	}
	return cred, credErr
}

// peerGroups returns the supplementary groups of the peer of the socket
// fd (SO_PEERGROUPS), growing the buffer while the kernel answers ERANGE
// with the size it needs.
func peerGroups(fd int) ([]uint32, error) {
	buf := make([]uint32, 32)
	for {
		size := uint32(4 * len(buf))
		_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_PEERGROUPS,
			uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&size)), 0)
		switch {
		case errno == unix.ERANGE && int(size) > 4*len(buf):
			buf = make([]uint32, size/4)
		case errno != 0:
			return nil, fmt.Errorf("SO_PEERGROUPS: %w", errno)
		default:
			return buf[:size/4], nil
		}
	}
}

// handle answers one request message, taking ownership of its fds;
// cursor is the connection's load cursor (Loader).
func (s *Server) handle(ctx context.Context, c *net.UnixConn, cred Cred, m message, cursor *any) {
	req, err := s.decode(m)
	if err != nil {
		s.quota.release(m.FDs...)
		s.refuse(c, cred, req.Op, err)
		return
	}
	if req.Op == opExport || req.Op == opImport || req.Op == opPublish || req.Op == opPull || req.Op == opUnpublish {
		err := s.quota.take(cred.Uid, Limits{FDs: backendFDs})
		if err != nil {
			s.quota.release(m.FDs...)
			s.refuse(c, cred, req.Op, err)
			return
		}
		defer s.quota.give(cred.Uid, Limits{FDs: backendFDs})
	}
	switch req.Op {
	case opExport:
		f, err := s.cfg.Backend.Export(cred, req.Path, req.Write)
		if err != nil {
			s.refuse(c, cred, req.Op, err)
			return
		}
		fd, err := fdpass.Dup(f)
		f.Close()
		if err != nil {
			s.refuse(c, cred, req.Op, fmt.Errorf("backend's file: %w", err))
			return
		}
		s.reply(c, cred, req.Op, reply{V: version, OK: true, FDs: 1}, []int{fd})
		fdpass.Close([]int{fd})
	case opImport:
		f := os.NewFile(uintptr(m.FDs[0]), "ctl-import:"+req.Path)
		err := s.cfg.Backend.Import(cred, req.Path, f, req.Dtype, req.Shape)
		s.quota.releaseFile(m.FDs[0], f)
		if err != nil {
			s.refuse(c, cred, req.Op, err)
			return
		}
		s.reply(c, cred, req.Op, reply{V: version, OK: true}, nil)
	case opAllGather, opBroadcast:
		s.collective(ctx, c, cred, &req, m.FDs)
	case opLoad:
		s.load(c, cred, &req, cursor)
	case opPurge:
		s.purge(c, cred)
	case opPublish, opPull, opUnpublish:
		s.cluster(c, cred, &req)
	}
}

// cluster answers a publish, pull or unpublish request.
func (s *Server) cluster(c *net.UnixConn, cred Cred, req *request) {
	p, ok := s.cfg.Backend.(Publisher)
	if !ok {
		s.refuse(c, cred, req.Op, protoErrorf(syscall.EOPNOTSUPP, "this backend does not serve %s", req.Op))
		return
	}
	r := reply{V: version, OK: true}
	var err error
	switch req.Op {
	case opPublish:
		r.Version, err = p.Publish(cred, req.Path)
	case opPull:
		r.Bytes, err = p.Pull(cred, req.Path)
	default:
		err = p.Unpublish(cred, req.Path)
	}
	if err != nil {
		s.refuse(c, cred, req.Op, err)
		return
	}
	s.reply(c, cred, req.Op, r, nil)
}

// purge answers a purge request: the daemon's own user and root may ask
// it to purge its backing when it exits.
func (s *Server) purge(c *net.UnixConn, cred Cred) {
	var err error
	switch {
	case s.cfg.Purge == nil:
		err = protoErrorf(syscall.EOPNOTSUPP, "this daemon does not purge on request")
	case cred.Uid != 0 && cred.Uid != s.cfg.Owner:
		err = protoErrorf(syscall.EACCES, "only uid %d (the daemon's user) and root may purge its backing", s.cfg.Owner)
	default:
		err = s.cfg.Purge()
	}
	if err != nil {
		s.refuse(c, cred, opPurge, err)
		return
	}
	s.cfg.Log.Info("ctl: purge asked: the backing goes when the daemon exits", "pid", cred.Pid, "uid", cred.Uid)
	s.reply(c, cred, opPurge, reply{V: version, OK: true}, nil)
}

// load answers a load request: as many segments as one reply can carry
// (descriptors, bytes and the peer's descriptor limit allowing), "more"
// when the listing goes on. cursor is the connection's (Loader).
func (s *Server) load(c *net.UnixConn, cred Cred, req *request, cursor *any) {
	l, ok := s.cfg.Backend.(Loader)
	if !ok {
		s.refuse(c, cred, req.Op, protoErrorf(syscall.EOPNOTSUPP, "this backend does not serve load"))
		return
	}
	batch := max(1, min(maxWorld, s.cfg.PerUID.FDs-backendFDs))
	if err := s.quota.take(cred.Uid, Limits{FDs: batch + backendFDs}); err != nil {
		s.refuse(c, cred, req.Op, err)
		return
	}
	defer s.quota.give(cred.Uid, Limits{FDs: batch + backendFDs})
	segs, held, more, err := l.Load(cred, req.Path, req.Write, req.After, batch, cursor)
	defer fdpass.Close(held) // after the reply: the backend's descriptors, not copies
	var fds []int
	for i, fd := range held {
		segs[i].FD = -1
		if fd >= 0 {
			segs[i].FD = len(fds)
			fds = append(fds, fd)
		}
	}
	if err != nil {
		s.refuse(c, cred, req.Op, err)
		return
	}
	r := reply{V: version, OK: true, Segments: segs, More: more}
	for {
		r.FDs = len(fds)
		b, err := json.Marshal(r)
		if err == nil && len(b) > maxMessage && len(r.Segments) > 1 {
			// Too long: leave the last segment to the next request.
			last := r.Segments[len(r.Segments)-1]
			r.Segments, r.More = r.Segments[:len(r.Segments)-1], true
			if last.FD >= 0 {
				fds = fds[:last.FD]
			}
			continue
		}
		if err != nil || len(b) > maxMessage {
			s.refuse(c, cred, req.Op, protoErrorf(syscall.EMSGSIZE, "segment %q does not fit in a reply", r.Segments[0].Name))
			return
		}
		break
	}
	s.reply(c, cred, req.Op, r, fds)
}

// decode checks a message's flags and parses it.
func (s *Server) decode(m message) (request, error) {
	switch {
	case m.err != nil:
		return request{}, m.err
	case m.Truncated:
		return request{}, protoErrorf(syscall.EMSGSIZE, "request exceeds %d bytes", maxMessage)
	case m.FDsTruncated:
		return request{}, protoErrorf(syscall.EINVAL, "more than %d descriptors attached", maxRequestFDs)
	}
	return parseRequest(m.Data, len(m.FDs))
}

// collective runs an all_gather or broadcast request: it joins the group
// with fds (one or none) and waits for the group to complete, time out or
// the connection to close.
func (s *Server) collective(ctx context.Context, c *net.UnixConn, cred Cred, req *request, fds []int) {
	fd := -1
	if len(fds) == 1 {
		fd = fds[0]
		if err := sharable(fd); err != nil {
			s.quota.release(fd)
			s.refuse(c, cred, req.Op, err)
			return
		}
	}
	g, mem, err := s.groups.join(cred, req, fd)
	if err != nil {
		s.refuse(c, cred, req.Op, err)
		return
	}
	var o outcome
	select {
	case o = <-mem.done:
	case <-ctx.Done():
		if s.groups.leave(g, mem) {
			s.cfg.Log.Debug("ctl: left group", "group", req.Group, "rank", req.Rank, "pid", cred.Pid)
			return
		}
		o = <-mem.done
	}
	if o.err != nil {
		s.refuse(c, cred, req.Op, o.err)
		return
	}
	s.reply(c, cred, req.Op, reply{V: version, OK: true, FDs: len(o.fds)}, o.fds)
	o.shared.release()
}

// sharable refuses (EINVAL) a descriptor for a collective that is no
// memory to map: an O_PATH descriptor, a directory, a FIFO, a socket or a
// block device. Regular files (a memfd, a segment), character devices and
// anonymous inodes (CUDA's exported allocations, dma-bufs: what PyTorch's
// symmetric memory sends) travel. The daemon closes what it holds on a
// goroutine of its own (quota.release), so no kind can wedge a group. The
// type is read without asking the file's filesystem (AT_STATX_DONT_SYNC):
// a FUSE server of the peer's could leave the question unanswered.
func sharable(fd int) error {
	var stx unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH|unix.AT_STATX_DONT_SYNC, unix.STATX_TYPE, &stx); err != nil {
		return protoErrorf(syscall.EINVAL, "the descriptor sent cannot be examined: %v", err)
	}
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err != nil {
		return protoErrorf(syscall.EINVAL, "the descriptor sent cannot be examined: %v", err)
	}
	kind := ""
	switch t := uint32(stx.Mode) & unix.S_IFMT; {
	case fl&unix.O_PATH != 0:
		kind = "an O_PATH descriptor"
	case t == unix.S_IFIFO:
		kind = "a FIFO"
	case t == unix.S_IFSOCK:
		kind = "a socket"
	case t == unix.S_IFBLK:
		kind = "a block device"
	case t == unix.S_IFDIR:
		kind = "a directory"
	}
	if kind != "" {
		return protoErrorf(syscall.EINVAL, "all_gather and broadcast share memory to map (regular files, memfds, device memory handles), not %s", kind)
	}
	return nil
}

// refuse sends the error reply for err and logs the refusal.
func (s *Server) refuse(c *net.UnixConn, cred Cred, op string, err error) {
	s.logRefusal(cred, op, err)
	s.reply(c, cred, op, errorReply(s.errnoOf(err), err.Error()), nil)
}

// logRefusal logs why a request from cred was refused.
func (s *Server) logRefusal(cred Cred, op string, err error) {
	if s.errnoOf(err) == syscall.ENOENT {
		return // absence is an answer, not a refusal (as on the FUSE side)
	}
	s.cfg.Log.Info("ctl: refused", "op", op, "pid", cred.Pid, "uid", cred.Uid, "errno", s.errnoOf(err), "reason", err.Error())
}

// errnoOf is the errno a peer gets for err.
func (s *Server) errnoOf(err error) syscall.Errno {
	var pe *protoErr
	if errors.As(err, &pe) {
		return pe.errno
	}
	if errno := s.cfg.Errno(err); errno != 0 {
		return errno
	}
	return syscall.EIO
}

// reply sends r with fds attached; a peer that went away is only logged.
func (s *Server) reply(c *net.UnixConn, cred Cred, op string, r reply, fds []int) {
	if err := sendReply(c, r, fds); err != nil {
		s.cfg.Log.Debug("ctl: reply", "op", op, "pid", cred.Pid, "err", err)
	}
}
