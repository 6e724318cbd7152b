package ctl

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"tensorfs/fdpass"
)

// Client is a connection to the control socket. Its methods may be called
// from several goroutines; requests are sent one at a time.
type Client struct {
	conn *net.UnixConn
	mu   sync.Mutex // one request/reply at a time
}

// Dial connects to the control socket at path.
func Dial(path string) (*Client, error) {
	conn, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("ctl: %w", err)
	}
	return &Client{conn: conn}, nil
}

// DialServing connects to the control socket at path of a daemon that
// serves, dialing again every 50 ms, for wait at most, while the dial
// fails and alive (if not nil) holds: a successor (a restart's, a
// crash's) serves the mount and writes its pid file a moment before its
// control socket listens.
func DialServing(path string, wait time.Duration, alive func() bool) (*Client, error) {
	deadline := time.Now().Add(wait)
	for {
		c, err := Dial(path)
		if err == nil || time.Now().After(deadline) || alive != nil && !alive() {
			return c, err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// ServingPid returns the pid of the daemon that answers on the control
// socket at path (dialed as DialServing does, for wait at most), 0 if none
// does.
func ServingPid(path string, wait time.Duration) int {
	c, err := DialServing(path, wait, nil)
	if err != nil {
		return 0
	}
	defer c.Close()
	cred, err := c.Peer()
	if err != nil {
		return 0
	}
	return int(cred.Pid)
}

// Close closes the connection. A group request waiting on it leaves its
// group.
func (c *Client) Close() error { return c.conn.Close() }

// Export returns the segment at path (relative to the mount root),
// read-write if write is set.
func (c *Client) Export(path string, write bool) (*os.File, error) {
	_, files, err := c.roundTrip(&request{Op: opExport, Path: path, Write: write}, nil, 1)
	if err != nil {
		return nil, err
	}
	return files[0], nil
}

// Import makes f the segment at path without copying, with dtype and shape
// if they are not "". f stays open and remains the caller's.
func (c *Client) Import(path string, f *os.File, dtype, shape string) error {
	_, _, err := c.roundTrip(&request{Op: opImport, Path: path, Dtype: dtype, Shape: shape}, f, 0)
	return err
}

// Load returns the segments under the directory path (relative to the
// mount root, "." for the root) that follow the segment named after ("" to
// start), each with its file where the daemon hands one out (Segment.FD is
// the index into files, -1 for none), and whether more follow: ask again
// with after set to the last name. Files are read-only unless write.
func (c *Client) Load(path string, write bool, after string) ([]Segment, []*os.File, bool, error) {
	rep, files, err := c.roundTrip(&request{Op: opLoad, Path: path, Write: write, After: after}, nil, -1)
	if err != nil {
		return nil, nil, false, err
	}
	for _, s := range rep.Segments {
		if s.FD >= len(files) {
			closeFiles(files)
			return nil, nil, false, fmt.Errorf("ctl load: segment %q names descriptor %d of %d", s.Name, s.FD, len(files))
		}
	}
	return rep.Segments, files, rep.More, nil
}

// Purge asks the daemon to purge its backing when it exits (once the
// mount is unmounted and its last user gone). Only the daemon's user and
// root may ask; others get EACCES.
func (c *Client) Purge() error {
	_, _, err := c.roundTrip(&request{Op: opPurge}, nil, 0)
	return err
}

// Publish makes the directory path (relative to the mount root) a new
// version of itself cluster-wide and returns the version's ID.
func (c *Client) Publish(path string) (string, error) {
	rep, _, err := c.roundTrip(&request{Op: opPublish, Path: path}, nil, 0)
	return rep.Version, err
}

// Pull fetches every segment below the directory path (relative to the
// mount root) that is not complete on this node, and returns once all are,
// with the bytes fetched.
func (c *Client) Pull(path string) (int64, error) {
	rep, _, err := c.roundTrip(&request{Op: opPull, Path: path}, nil, 0)
	return rep.Bytes, err
}

// ErrDaemonGone is returned when the daemon closed the connection
// without a reply: it exited, or was killed, while the request ran.
var ErrDaemonGone = errors.New("connection closed by the daemon")

// Unpublish withdraws the published directory path (relative to the
// mount root) from the cluster: every node removes it.
func (c *Client) Unpublish(path string) error {
	_, _, err := c.roundTrip(&request{Op: opUnpublish, Path: path}, nil, 0)
	return err
}

// Peer returns the credentials of the daemon at the other end, as the
// kernel recorded them when it made the socket.
func (c *Client) Peer() (Cred, error) {
	return peerCred(c.conn)
}

// A GroupOption modifies an AllGather or Broadcast request.
type GroupOption func(*request)

// OpenGroup joins the group of that name that is open to every uid,
// rather than the caller's uid's own. Every rank must ask for it.
func OpenGroup() GroupOption { return func(r *request) { r.Open = true } }

// AllGather sends f as rank of a group of world ranks and returns the
// world files of all ranks, ordered by rank, once all have joined.
func (c *Client) AllGather(group string, rank, world int, f *os.File, opts ...GroupOption) ([]*os.File, error) {
	r := &request{Op: opAllGather, Group: group, Rank: rank, World: world}
	for _, o := range opts {
		o(r)
	}
	_, files, err := c.roundTrip(r, f, world)
	return files, err
}

// Broadcast joins a broadcast from root among world ranks. At root it sends
// f and returns nil once all ranks have joined; elsewhere f is ignored and
// it returns root's file.
func (c *Client) Broadcast(group string, rank, world, root int, f *os.File, opts ...GroupOption) (*os.File, error) {
	r := &request{Op: opBroadcast, Group: group, Rank: rank, World: world, Root: root}
	for _, o := range opts {
		o(r)
	}
	if rank == root {
		_, _, err := c.roundTrip(r, f, 0)
		return nil, err
	}
	_, files, err := c.roundTrip(r, nil, 1)
	if err != nil {
		return nil, err
	}
	return files[0], nil
}

// roundTrip sends r with f's descriptor attached (none if f is nil) and
// returns a successful reply and its want files (any number if want < 0).
func (c *Client) roundTrip(r *request, f *os.File, want int) (reply, []*os.File, error) {
	b, err := r.marshal()
	if err != nil {
		return reply{}, nil, fmt.Errorf("ctl %s: %w", r.Op, err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var fds []int
	if f != nil {
		fd, err := fdpass.Dup(f)
		if err != nil {
			return reply{}, nil, fmt.Errorf("ctl %s: %w", r.Op, err)
		}
		defer fdpass.Close([]int{fd})
		fds = []int{fd}
	}
	if err := fdpass.Send(c.conn, b, fds...); err != nil {
		return reply{}, nil, fmt.Errorf("ctl %s: %w", r.Op, err)
	}
	m, err := recvMsg(c.conn, maxWorld)
	if errors.Is(err, io.EOF) {
		err = ErrDaemonGone
	}
	if err != nil {
		return reply{}, nil, fmt.Errorf("ctl %s: %w", r.Op, err)
	}
	rep, err := checkReply(m)
	if err != nil {
		fdpass.Close(m.FDs)
		return reply{}, nil, fmt.Errorf("ctl %s: %w", r.Op, err)
	}
	if !rep.OK {
		return reply{}, nil, &RemoteError{Op: r.Op, Errno: syscall.Errno(rep.Errno), Msg: rep.Error}
	}
	if want >= 0 && len(m.FDs) != want {
		fdpass.Close(m.FDs)
		return reply{}, nil, fmt.Errorf("ctl %s: reply has %d descriptors, want %d", r.Op, len(m.FDs), want)
	}
	files := make([]*os.File, len(m.FDs))
	for i, fd := range m.FDs {
		name := r.Path
		switch r.Op {
		case opAllGather:
			name = fmt.Sprintf("%s[%d]", r.Group, i)
		case opBroadcast:
			name = fmt.Sprintf("%s[%d]", r.Group, r.Root)
		}
		files[i] = os.NewFile(uintptr(fd), "tensorfs-ctl:"+name)
	}
	return rep, files, nil
}

// checkReply validates a received reply message.
func checkReply(m fdpass.Msg) (reply, error) {
	switch {
	case m.FDsTruncated:
		return reply{}, errors.New("reply's descriptors truncated (out of descriptors?)")
	case m.Truncated:
		return reply{}, errors.New("reply truncated")
	}
	return parseReply(m.Data, len(m.FDs))
}

// closeFiles closes files.
func closeFiles(files []*os.File) {
	for _, f := range files {
		f.Close()
	}
}
