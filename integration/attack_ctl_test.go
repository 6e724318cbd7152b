package integration

// Attacks on the control socket by unprivileged users (DESIGN.md §9):
// stealing another user's descriptor through a collective (H1), and
// starving the daemon of descriptors with parked collectives (H4), on
// --allow-other and private mounts. The attackers and victims are
// /usr/bin/python3 agents (ctlAgentScript) running as userA, userB or
// root.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// ctlAgentScript serves JSON commands, one a line on stdin, on
// connections to the socket argv[1], answering one JSON line each:
//
//	{"cmd":"send","conn":C,"req":R,"memfd":S}  send R (a memfd holding S
//	                                           attached if S is given) on
//	                                           connection C, made if new
//	{"cmd":"recv","conn":C,"timeout":T}        the reply on C: {"reply",
//	                                           "got":[{"ino","data"}]},
//	                                           {"waiting":true} after T s,
//	                                           {"closed":true} or {"errno"}
//	{"cmd":"close","conn":C}
//	{"cmd":"flood","n":N,"group":G}            N new connections, each
//	                                           parking an all_gather (rank 0
//	                                           of 2, group G-i) with a memfd;
//	                                           once a second passes quietly,
//	                                           how many are "parked" (no
//	                                           reply), "refused" (by errno
//	                                           and reason) or "unanswered"
//	                                           (closed without a reply)
//	{"cmd":"unflood"}                          close them
//
// It raises its soft RLIMIT_NOFILE to the hard limit first.
const ctlAgentScript = `
import array, json, os, resource, select, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
path = sys.argv[1]
conns, flood = {}, []

def connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    return s

def send(s, req, data):
    fds = []
    if data is not None:
        fds.append(os.memfd_create("agent"))
        os.write(fds[0], data.encode())
    try:
        s.sendmsg([json.dumps(dict(req, v=1)).encode()],
                  [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else [])
        return {"sent": True}
    except OSError as e:
        return {"errno": e.errno}
    finally:
        for fd in fds:
            os.close(fd)

def recv(s):
    try:
        data, anc, _, _ = s.recvmsg(65536, socket.CMSG_SPACE(253 * 4), socket.MSG_CMSG_CLOEXEC)
    except OSError as e:
        return {"errno": e.errno}
    got = [fd for level, typ, d in anc if (level, typ) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
           for fd in array.array("i", d[:len(d) - len(d) % 4])]
    out = {"got": []}
    for fd in got:
        out["got"].append({"ino": os.fstat(fd).st_ino, "data": os.pread(fd, 64, 0).decode("latin-1")})
        os.close(fd)
    if not data:
        out["closed"] = True
    else:
        out["reply"] = json.loads(data)
    return out

def do_flood(n, group):
    out = {"parked": 0, "refused": {}, "unanswered": 0}
    for i in range(n):
        try:
            s = connect()
        except OSError:
            out["unanswered"] += 1
            continue
        flood.append(s)
        send(s, {"op": "all_gather", "group": "%s-%d" % (group, i), "rank": 0, "world": 2}, "flood")
    p = select.poll()
    for s in flood:
        p.register(s, select.POLLIN)
    byfd = {s.fileno(): s for s in flood}
    waiting = len(flood)
    while waiting:
        ready = p.poll(1000)
        if not ready:
            break
        for fd, _ in ready:
            p.unregister(fd)
            waiting -= 1
            r = recv(byfd[fd])
            if "reply" in r:
                key = "%d %s" % (r["reply"].get("errno", 0), r["reply"].get("error", ""))
                out["refused"][key] = out["refused"].get(key, 0) + 1
            else:
                out["unanswered"] += 1
    out["parked"] = waiting
    return out

for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["cmd"]
    if op == "send":
        try:
            if cmd["conn"] not in conns:
                conns[cmd["conn"]] = connect()
            out = send(conns[cmd["conn"]], cmd["req"], cmd.get("memfd"))
        except OSError as e:
            out = {"errno": e.errno}
    elif op == "recv":
        s = conns[cmd["conn"]]
        out = recv(s) if select.select([s], [], [], cmd["timeout"])[0] else {"waiting": True}
    elif op == "close":
        conns.pop(cmd["conn"]).close()
        out = {}
    elif op == "flood":
        out = do_flood(cmd["n"], cmd["group"])
    elif op == "unflood":
        for s in flood:
            s.close()
        flood = []
        out = {}
    print(json.dumps(out), flush=True)
`

// ctlAgent is a ctlAgentScript child running as some uid.
type ctlAgent struct {
	*pyChild
	uid int
}

// ctlReply is an agent's answer.
type ctlReply struct {
	Sent    bool `json:"sent"`
	Waiting bool `json:"waiting"`
	Closed  bool `json:"closed"`
	Errno   int  `json:"errno"`
	Reply   *struct {
		OK    bool   `json:"ok"`
		Errno int    `json:"errno"`
		Error string `json:"error"`
	} `json:"reply"`
	Got []struct {
		Ino  uint64 `json:"ino"`
		Data string `json:"data"`
	} `json:"got"`
	// flood
	Parked     int            `json:"parked"`
	Refused    map[string]int `json:"refused"`
	Unanswered int            `json:"unanswered"`
}

// startCtlAgent starts an agent as uid on the control socket sock; the
// cleanup kills it.
func startCtlAgent(t *testing.T, uid int, sock string) *ctlAgent {
	t.Helper()
	requireTorchFreePython(t)
	c := startPythonAs(t, uid, fmt.Sprintf("agent uid %d", uid), ctlAgentScript, sock)
	return &ctlAgent{c, uid}
}

// do runs one agent command.
func (a *ctlAgent) do(t *testing.T, cmd map[string]any) ctlReply {
	t.Helper()
	b, err := json.Marshal(cmd)
	if err != nil {
		t.Fatal(err)
	}
	line := a.pyChild.do(t, string(b))
	var r ctlReply
	if err := json.Unmarshal([]byte(line), &r); err != nil {
		t.Fatalf("%s answered %q to %s: %v", a.name, line, b, err)
	}
	return r
}

// send sends req on conn with a memfd holding data attached ("" for none).
func (a *ctlAgent) send(t *testing.T, conn string, req map[string]any, data string) {
	t.Helper()
	cmd := map[string]any{"cmd": "send", "conn": conn, "req": req}
	if data != "" {
		cmd["memfd"] = data
	}
	if r := a.do(t, cmd); !r.Sent {
		t.Fatalf("uid %d: sending %v on %s: %+v", a.uid, req, conn, r)
	}
}

// recv returns conn's reply, or Waiting after timeout.
func (a *ctlAgent) recv(t *testing.T, conn string, timeout time.Duration) ctlReply {
	t.Helper()
	return a.do(t, map[string]any{"cmd": "recv", "conn": conn, "timeout": timeout.Seconds()})
}

// gather sends an all_gather of rank of world 2 in group with a memfd
// holding data.
func (a *ctlAgent) gather(t *testing.T, conn, group string, rank int, data string, open bool) {
	t.Helper()
	req := map[string]any{"op": "all_gather", "group": group, "rank": rank, "world": 2}
	if open {
		req["open"] = true
	}
	a.send(t, conn, req, data)
}

// close closes conn.
func (a *ctlAgent) close(t *testing.T, conn string) {
	t.Helper()
	a.do(t, map[string]any{"cmd": "close", "conn": conn})
}

// wantWaiting checks that conn has no reply yet.
func (a *ctlAgent) wantWaiting(t *testing.T, conn, what string) {
	t.Helper()
	if r := a.recv(t, conn, 300*time.Millisecond); !r.Waiting {
		t.Errorf("uid %d %s: %+v, want it still waiting", a.uid, what, r)
	}
}

// wantGot checks that conn's reply is a success carrying data, in order.
func (a *ctlAgent) wantGot(t *testing.T, conn, what string, data ...string) {
	t.Helper()
	r := a.recv(t, conn, xaDeadline)
	var got []string
	for _, g := range r.Got {
		got = append(got, g.Data)
	}
	if r.Reply == nil || !r.Reply.OK || strings.Join(got, "|") != strings.Join(data, "|") {
		t.Errorf("uid %d %s: %+v (descriptors holding %q), want %q", a.uid, what, r.Reply, got, data)
	}
}

// wantErrno checks that conn's reply is a refusal with errno.
func (a *ctlAgent) wantErrno(t *testing.T, conn, what string, errno syscall.Errno) {
	t.Helper()
	r := a.recv(t, conn, xaDeadline)
	if r.Reply == nil || r.Reply.OK || r.Reply.Errno != int(errno) || len(r.Got) != 0 {
		t.Errorf("uid %d %s: %+v, want errno %d (%v)", a.uid, what, r, int(errno), errno)
	}
}

// TestAttackCtl runs the control-socket attacks on --allow-other and
// private mounts, in both modes.
func TestAttackCtl(t *testing.T) {
	t.Parallel()
	for _, share := range []string{"allow-other", "private"} {
		t.Run(share, func(t *testing.T) {
			var args []string
			if share == "allow-other" {
				args = append(args, "--allow-other")
			}
			forEachMode(t, func(t *testing.T, m *mount) {
				reachable(t, m.dir)
				sock := controlSocket(t, m)
				t.Run("steal", func(t *testing.T) { attackSteal(t, m, sock, share == "private") })
				t.Run("flood", func(t *testing.T) { attackFlood(t, m, sock, share == "private") })
			}, args...)
		})
	}
}

// attackSteal (H1): user A parks rank 1 of group step7, then root joins
// step7 as rank 0 with its memfd. Root's rank must form a group of its
// own, which A never gets into; A's group completes with A's ranks only.
// An open group takes ranks of several uids that all ask for it. On a
// private mount other uids are refused outright (EACCES).
func attackSteal(t *testing.T, m *mount, sock string, private bool) {
	a := startCtlAgent(t, userA, sock)
	b := startCtlAgent(t, userB, sock)
	root := startCtlAgent(t, 0, sock)

	a.gather(t, "a1", "step7", 1, "A1", false)
	if private {
		a.wantErrno(t, "a1", "all_gather on a private mount", syscall.EACCES)
		if r := a.recv(t, "a1", xaDeadline); !r.Closed && r.Errno == 0 {
			t.Errorf("uid %d: the refused connection is still open: %+v", a.uid, r)
		}
		b.send(t, "b", map[string]any{"op": "broadcast", "group": "step7", "rank": 1, "world": 2, "root": 0}, "")
		b.wantErrno(t, "b", "broadcast on a private mount", syscall.EACCES)
		a.send(t, "a2", map[string]any{"op": "export", "path": "x"}, "")
		a.wantErrno(t, "a2", "export on a private mount", syscall.EACCES)
		a.gather(t, "a3", "o", 0, "A", true)
		a.wantErrno(t, "a3", "open all_gather on a private mount", syscall.EACCES)
	} else {
		a.wantWaiting(t, "a1", "rank 1 alone")
	}
	root.gather(t, "r0", "step7", 0, "root secret", false)
	root.wantWaiting(t, "r0", "rank 0 of step7 beside user A's rank 1")
	if !private {
		a.wantWaiting(t, "a1", "rank 1 after root's rank 0 joined step7")
		b.gather(t, "b0", "step7", 0, "B0", false)
		b.wantWaiting(t, "b0", "rank 0 of step7 beside user A's rank 1")
		a.gather(t, "a0", "step7", 0, "A0", false)
		a.wantGot(t, "a0", "rank 0 completing its group", "A0", "A1")
		a.wantGot(t, "a1", "rank 1 of its group", "A0", "A1")

		// Broadcast: A waits as a receiver; root's broadcast is its own.
		a.send(t, "a2", map[string]any{"op": "broadcast", "group": "bc", "rank": 1, "world": 2, "root": 0}, "")
		root.send(t, "r2", map[string]any{"op": "broadcast", "group": "bc", "rank": 0, "world": 2, "root": 0}, "root secret")
		a.wantWaiting(t, "a2", "broadcast receiver after root broadcast on its group's name")
		root.wantWaiting(t, "r2", "broadcast root beside user A's receiver")

		// An open group: A and B both ask for it.
		a.gather(t, "ao", "shared", 0, "A open", true)
		b.gather(t, "bmine", "shared", 1, "B own", false)
		a.wantWaiting(t, "ao", "open rank 0 beside B's own group of that name")
		b.gather(t, "bo", "shared", 1, "B open", true)
		a.wantGot(t, "ao", "open group rank 0", "A open", "B open")
		b.wantGot(t, "bo", "open group rank 1", "A open", "B open")
		b.wantWaiting(t, "bmine", "its own group of the open group's name")
	}
	root.gather(t, "r1", "step7", 1, "root 1", false)
	root.wantGot(t, "r0", "rank 0 of its own step7", "root secret", "root 1")
	root.wantGot(t, "r1", "rank 1 of its own step7", "root secret", "root 1")
}

var limitsLine = regexp.MustCompile(`ctl: listening.* conns_per_uid=(\d+) parked_per_uid=(\d+) .*conns=(\d+)`)

// attackFlood (H4): user A opens more connections than its limit, each
// parking an all_gather with a memfd. It gets EAGAIN beyond its limits
// (EACCES on a private mount), the daemon keeps more than half of its
// descriptors free, and root's cat, ls and create on the mount, root's and
// user B's requests, and A's connection from before all keep working.
func attackFlood(t *testing.T, m *mount, sock string, private bool) {
	sub := m.logMatch(t, "the ctl limits", limitsLine)
	conns, _ := strconv.Atoi(sub[1])
	parked, _ := strconv.Atoi(sub[2])
	if err := os.WriteFile(m.path("plain"), []byte("still here"), 0o644); err != nil {
		t.Fatal(err)
	}
	a := startCtlAgent(t, userA, sock)
	b := startCtlAgent(t, userB, sock)
	root := startCtlAgent(t, 0, sock)
	solo := map[string]any{"op": "all_gather", "group": "solo", "rank": 0, "world": 1}
	if !private {
		a.send(t, "before", solo, "A before")
		a.wantGot(t, "before", "all_gather of one before the flood", "A before")
	}

	n := conns + 100
	if private {
		n = 300
	}
	start := time.Now()
	r := a.do(t, map[string]any{"cmd": "flood", "n": n, "group": "flood"})
	t.Logf("flood of %d connections in %v: %d parked, refused %v, %d closed without a reply",
		n, time.Since(start).Round(time.Millisecond), r.Parked, r.Refused, r.Unanswered)
	count := func(errno syscall.Errno, text string) int {
		total := 0
		for k, v := range r.Refused {
			if strings.HasPrefix(k, strconv.Itoa(int(errno))+" ") && strings.Contains(k, text) {
				total += v
			}
		}
		return total
	}
	if private {
		if r.Parked != 0 || count(syscall.EACCES, "private") == 0 || count(syscall.EACCES, "private")+r.Unanswered != n {
			t.Errorf("flood of a private mount: %d parked, refused %v, %d closed; want all refused with EACCES or closed", r.Parked, r.Refused, r.Unanswered)
		}
		wantLog(t, m, fmt.Sprintf("uid=%d", userA), "the mount is private")
	} else {
		admitted := conns - 1 // "before" holds one
		wantParked := min(parked, admitted)
		byParked := count(syscall.EAGAIN, fmt.Sprintf("uid %d reached the limit of %d waiting collective requests per uid", userA, parked))
		byConns := count(syscall.EAGAIN, fmt.Sprintf("uid %d reached the limit of %d connections per uid", userA, conns))
		if r.Parked != wantParked || byParked != admitted-wantParked || byConns == 0 || byConns+r.Unanswered != n-admitted {
			t.Errorf("flood: %d parked, refused %v, %d closed; want %d parked, %d refused for waiting requests, the other %d refused for connections (EAGAIN) or closed",
				r.Parked, r.Refused, r.Unanswered, wantParked, admitted-wantParked, n-admitted)
		}
		wantLog(t, m, fmt.Sprintf("uid=%d", userA), fmt.Sprintf("limit of %d connections per uid", conns))
		wantLog(t, m, fmt.Sprintf("uid=%d", userA), fmt.Sprintf("limit of %d waiting collective requests per uid", parked))
	}

	// The daemon keeps more than half of its descriptors.
	if fds, limit := daemonFDs(t, m.pid); fds >= limit/2 {
		t.Errorf("the daemon holds %d descriptors during the flood, limit %d", fds, limit)
	}
	// Root's FUSE service.
	if out := run(t, "cat", m.path("plain")); out != "still here" {
		t.Errorf("root's cat during the flood: %q", out)
	}
	if out := run(t, "ls", m.dir); !strings.Contains(out, "plain") {
		t.Errorf("root's ls during the flood: %q", out)
	}
	run(t, "sh", "-c", "echo new > "+m.path("created-during-flood"))
	// Root's and other users' requests, and A's earlier connection.
	root.send(t, "r", solo, "root")
	root.wantGot(t, "r", "all_gather of one during the flood", "root")
	if private {
		b.send(t, "b", solo, "B")
		b.wantErrno(t, "b", "all_gather of one on a private mount", syscall.EACCES)
	} else {
		b.send(t, "b", solo, "B")
		b.wantGot(t, "b", "all_gather of one during A's flood", "B")
		a.send(t, "before", solo, "A again")
		a.wantGot(t, "before", "all_gather of one on its connection from before the flood", "A again")
	}

	// Once A lets go, it is served again.
	a.do(t, map[string]any{"cmd": "unflood"})
	if !private {
		eventually(t, "user A served again after its flood", func() (bool, string) {
			conn := fmt.Sprintf("after-%d", time.Now().UnixNano())
			sent := a.do(t, map[string]any{"cmd": "send", "conn": conn, "memfd": "A after",
				"req": map[string]any{"op": "all_gather", "group": conn, "rank": 0, "world": 2}})
			r := a.recv(t, conn, 300*time.Millisecond)
			a.close(t, conn)
			return sent.Sent && r.Waiting, fmt.Sprintf("%+v, %+v", sent, r)
		})
	}
}

// wantLog checks that a line of the daemon's log holds all of want.
func wantLog(t *testing.T, m *mount, want ...string) {
	t.Helper()
	has := func() bool {
		for _, line := range strings.Split(m.stderr.String(), "\n") {
			found := true
			for _, w := range want {
				found = found && strings.Contains(line, w)
			}
			if found {
				return true
			}
		}
		return false
	}
	// The daemon may log a refusal after its reply, and the harness
	// copies its stderr as it comes.
	for deadline := time.Now().Add(5 * time.Second); !has(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Errorf("no line of the daemon's log holds %q", want)
			return
		}
	}
}

// daemonFDs returns how many descriptors process pid holds, and its soft
// RLIMIT_NOFILE.
func daemonFDs(t *testing.T, pid int) (int, int) {
	t.Helper()
	n := openFDCount(t, pid)
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/limits", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); strings.HasPrefix(line, "Max open files") && len(f) > 3 {
			limit, err := strconv.Atoi(f[3])
			if err != nil {
				t.Fatalf("%q: %v", line, err)
			}
			return n, limit
		}
	}
	t.Fatalf("no Max open files in /proc/%d/limits", pid)
	return 0, 0
}

// openFDCount returns how many descriptors process pid holds: the size
// stat gives /proc/PID/fd (Linux 6.2 and later), one system call however
// many it holds, so that a sampler can afford to call it every
// millisecond; where that size is 0 (older kernels), the directory's
// entries counted.
func openFDCount(t *testing.T, pid int) int {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	var st syscall.Stat_t
	if err := syscall.Stat(dir, &st); err != nil {
		t.Fatal(err)
	}
	if st.Size > 0 {
		return int(st.Size)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// fdPeakUntil samples how many descriptors process pid holds every
// millisecond until done is closed, and returns the most it saw, at
// least from.
func fdPeakUntil(t *testing.T, pid, from int, done <-chan struct{}) int {
	t.Helper()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	peak := from
	for {
		select {
		case <-done:
			return peak
		case <-tick.C:
			peak = max(peak, openFDCount(t, pid))
		}
	}
}

// ctlLoadScript connects to the socket argv[1], loads the directory
// argv[2] and prints the reply as JSON, with "data": what each descriptor
// it got reads.
const ctlLoadScript = `
import array, json, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.sendmsg([json.dumps({"v": 1, "op": "load", "path": sys.argv[2]}).encode()])
data, anc, _, _ = s.recvmsg(65536, socket.CMSG_SPACE(253 * 4), socket.MSG_CMSG_CLOEXEC)
fds = [fd for level, typ, d in anc if (level, typ) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
       for fd in array.array("i", d[:len(d) - len(d) % 4])]
rep = json.loads(data)
rep["data"] = [os.pread(fd, 64, 0).decode() for fd in fds]
print(json.dumps(rep))
`

// TestAttackCtlGroups (F3): the socket checks a peer against the
// supplementary groups it connected with, as the kernel checks an open:
// a segment of mode 0640 in group G loads for userA with G among its
// groups and is refused (EACCES) to userA without G or with another group
// only.
func TestAttackCtlGroups(t *testing.T) {
	t.Parallel()
	requireTorchFreePython(t)
	const g = 2345
	m := mountFS(t, "passthrough", "--allow-other")
	reachable(t, m.dir)
	sock := controlSocket(t, m)
	if err := os.Mkdir(m.path("grp"), 0o755); err != nil {
		t.Fatal(err)
	}
	seg := m.path("grp/w")
	if err := os.WriteFile(seg, []byte("group only"), 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(seg, 0, g); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		groups []uint32
		errno  syscall.Errno
	}{
		{[]uint32{g}, 0},
		{[]uint32{17, g, 4000}, 0},
		{[]uint32{}, syscall.EACCES},
		{[]uint32{g + 1}, syscall.EACCES},
	} {
		run := func(name string, args ...string) (string, error) {
			ctx, cancel := context.WithTimeout(context.Background(), commandTimeout)
			defer cancel()
			cmd := exec.CommandContext(ctx, name, args...)
			cmd.Dir = "/"
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: userA, Gid: userA, Groups: c.groups}}
			out, err := cmd.Output()
			return string(out), err
		}
		// The kernel's verdict on open(2) through the mount, for reference.
		if _, err := run("cat", seg); (err == nil) != (c.errno == 0) {
			t.Fatalf("uid %d groups %v: cat %s: %v; the kernel disagrees with the case", userA, c.groups, seg, err)
		}
		out, err := run(systemPython, "-c", ctlLoadScript, sock, "grp")
		if err != nil {
			t.Fatalf("uid %d groups %v: load: %v\n%s", userA, c.groups, err, out)
		}
		var r struct {
			OK    bool     `json:"ok"`
			Errno int      `json:"errno"`
			Data  []string `json:"data"`
		}
		if err := json.Unmarshal([]byte(out), &r); err != nil {
			t.Fatalf("load printed %q: %v", out, err)
		}
		switch {
		case c.errno == 0 && (!r.OK || len(r.Data) != 1 || r.Data[0] != "group only"):
			t.Errorf("uid %d groups %v: load of grp: %s; want the segment", userA, c.groups, out)
		case c.errno != 0 && (r.OK || r.Errno != int(c.errno) || len(r.Data) != 0):
			t.Errorf("uid %d groups %v: load of grp: %s; want errno %d", userA, c.groups, out, int(c.errno))
		}
	}
}
