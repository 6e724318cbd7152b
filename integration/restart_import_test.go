package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// restartImportScript imports a new memfd named argv[3] holding argv[4]
// over the control socket argv[1] at argv[2], with a dtype and a shape,
// and prints the reply; the memfd's last descriptor outside the daemon
// goes with it.
const restartImportScript = `
import array, json, os, socket, sys
sock, dest, name, data = sys.argv[1:5]
fd = os.memfd_create(name)
os.write(fd, data.encode())
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sock)
s.sendmsg([json.dumps({"v": 1, "op": "import", "path": dest, "dtype": "uint8", "shape": "[%d]" % len(data)}).encode()],
          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
print(s.recv(65536).decode())
`

// TestRestartKeepsImports: uid userA imports memfds, whose bytes are the
// daemon's descriptors alone once its importer exits; across restarts and
// crashes each keeps its name, its bytes, its flags and attributes, and
// its descriptor stays charged to userA (one each). An import made by a
// daemon that took the mount over survives the next crash too. Once
// userA removes them, the charge is given back and the keeper holds no
// descriptor of them, after a crash as well.
func TestRestartKeepsImports(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		reachable(t, m.dir)
		stickyDir(t, m.path("shared"))
		sock := controlSocket(t, m)
		data := map[string]string{}
		imp := func(name string) {
			t.Helper()
			data[name] = "tensor bytes of " + name
			out := pythonAs(t, userA, "/", restartImportScript, sock, "shared/"+name, "tensorfs-restart-"+name, data[name])
			if !strings.Contains(strings.ReplaceAll(out, " ", ""), `"ok":true`) {
				t.Fatalf("uid %d's import of %s: %s", userA, name, out)
			}
		}
		charged := func() int64 { return ledgerHeld(t, m, "descriptors", userA) }
		check := func(when string) {
			t.Helper()
			for name, want := range data {
				p := m.path("shared/" + name)
				if out, err := runAs(t, userA, "/", "cat", p); err != nil || out != want {
					t.Errorf("%s: uid %d reads %s: %q %v, want %q", when, userA, name, out, err, want)
				}
				if v, err := getxattr(p, xaDtype); err != nil || string(v) != "uint8" {
					t.Errorf("%s: %s's %s = %q %v, want uint8", when, name, xaDtype, v, err)
				}
				if v, err := getxattr(p, xaFlags); err != nil || !strings.Contains(string(v), "FROMFD") {
					t.Errorf("%s: %s's %s = %q %v, want FROMFD among them", when, name, xaFlags, v, err)
				}
			}
			eventually(t, when+": one descriptor per import charged", func() (bool, string) {
				n := charged() // cat's handles go with their RELEASE
				return n == int64(len(data)), fmt.Sprintf("uid %d is charged %d descriptors, want %d", userA, n, len(data))
			})
		}
		imp("a")
		check("after the import")
		m.restart(t, "")
		check("after a restart")
		imp("b") // made by a successor: journaled by it
		m.crash(t)
		check("after a crash")
		m.restart(t, "")
		check("after a crash and a restart")
		if out, err := runAs(t, userA, "/", "rm", m.path("shared/a"), m.path("shared/b")); err != nil {
			t.Fatalf("uid %d removes its imports: %v\n%s", userA, err, out)
		}
		data = map[string]string{}
		m.crash(t)
		check("after the imports' removal and a crash")
		for _, name := range []string{"a", "b"} {
			if _, err := os.Lstat(m.path("shared/" + name)); err == nil {
				t.Errorf("%s removed before a crash is back after it", name)
			}
		}
		if fds := keeperMemfds(t, m, "tensorfs-restart-"); len(fds) > 0 {
			t.Errorf("the keeper holds descriptors of removed imports: %v", fds)
		}
	}, "--allow-other")
}

// keeperMemfds lists the descriptors of m's keeper that are memfds whose
// names start with prefix.
func keeperMemfds(t *testing.T, m *mount, prefix string) []string {
	t.Helper()
	return procMemfds(t, m.cmd.Process.Pid, prefix)
}

// procMemfds lists the descriptors of process pid that are memfds whose
// names start with prefix.
func procMemfds(t *testing.T, pid int, prefix string) []string {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && strings.HasPrefix(l, "/memfd:"+prefix) {
			out = append(out, e.Name()+" -> "+l)
		}
	}
	return out
}
