package integration

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Unprivileged users of the attack tests. No account is needed: a child
// runs with these ids through SysProcAttr.Credential, no groups added.
const (
	userA = 1000
	userB = 1001
)

// asUser makes cmd run as uid (gid = uid, no supplementary groups).
func asUser(cmd *exec.Cmd, uid int) *exec.Cmd {
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid), Groups: []uint32{}},
	}
	return cmd
}

// runAs runs a command as uid in dir, bounded by commandTimeout, and
// returns its combined output and error.
func runAs(t *testing.T, uid int, dir, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), commandTimeout)
	defer cancel()
	cmd := asUser(exec.CommandContext(ctx, name, args...), uid)
	cmd.Dir = dir
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// pythonAs runs /usr/bin/python3 -c script as uid in dir; it fails the
// test unless the script exits 0, and returns its stdout and stderr.
func pythonAs(t *testing.T, uid int, dir, script string, args ...string) string {
	t.Helper()
	out, err := runAs(t, uid, dir, systemPython, append([]string{"-c", script}, args...)...)
	if err != nil {
		t.Fatalf("python as uid %d: %v\n%s", uid, err, out)
	}
	return out
}

// reachable lets every user search the directories above path that the
// tests made below the temporary directory's top ("/tmp"; t.TempDir's are
// 0700), so an unprivileged child can reach a mount below them; it lists
// nothing.
func reachable(t *testing.T, path string) {
	t.Helper()
	top := "/" + strings.SplitN(strings.TrimPrefix(filepath.Clean(os.TempDir()), "/"), "/", 2)[0]
	for d := filepath.Dir(path); strings.HasPrefix(d, top+"/"); d = filepath.Dir(d) {
		var st syscall.Stat_t
		if err := syscall.Stat(d, &st); err != nil {
			t.Fatal(err)
		}
		if st.Mode&0o111 != 0o111 {
			if err := os.Chmod(d, os.FileMode(st.Mode&0o777|0o111)); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// pyCommand returns a command running /usr/bin/python3 -c script args.
func pyCommand(script string, args ...string) *exec.Cmd {
	return exec.Command(systemPython, append([]string{"-c", script}, args...)...)
}

// runInGroups runs a command as uid with the supplementary groups given
// and returns its combined output and error.
func runInGroups(t *testing.T, uid int, groups []uint32, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), commandTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid), Groups: groups}}
	cmd.Dir = "/"
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// userDirs makes a directory for each of users A and B, owned by them.
func userDirs(t *testing.T, m *mount) {
	t.Helper()
	reachable(t, m.dir)
	for uid, dir := range map[int]string{userA: "a", userB: "b"} {
		if err := os.Mkdir(m.path(dir), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(m.path(dir), uid, uid); err != nil {
			t.Fatal(err)
		}
	}
}

// h4Background starts script as uid with args, returns the first line it
// prints, and ends it (closing its stdin) at cleanup.
func h4Background(t *testing.T, uid int, script string, args ...string) string {
	t.Helper()
	cmd := asUser(pyCommand(script, args...), uid)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close()
		cmd.Process.Kill()
		cmd.Wait()
	})
	line, _ := bufio.NewReader(stdout).ReadString('\n')
	return strings.TrimSpace(line)
}

// stickyDir makes dir world-writable and sticky (1777, as /tmp), for
// tests where several users make files side by side.
func stickyDir(t *testing.T, dir string) {
	t.Helper()
	if err := os.Mkdir(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o1777); err != nil { // past the umask
		t.Fatal(err)
	}
}
