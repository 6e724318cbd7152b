package lifecycle

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"

	"tensorfs/alloc"
)

// Start starts a daemon for mp in a new session: this executable run with
// argv, its command line in the foreground ("mount -f ..."), its stderr
// appended to the mountpoint's log. It returns the daemon's ready line
// ("ready pid=... mode=... mountpoint=...") once the daemon prints it,
// and the log's path; a daemon that exits first is an error quoting the
// end of its log.
func Start(mp string, argv []string) (ready, logPath string, err error) {
	logPath = alloc.StatePath(mp, ".log")
	if err := alloc.MakeStateDir(); err != nil {
		return "", logPath, err
	}
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err == nil {
		err = logf.Chmod(0o600) // a log from an earlier version may be 0644
	}
	if err != nil {
		return "", logPath, err
	}
	defer logf.Close()
	cmd := exec.Command(selfExe, argv...) // this very inode, not its path
	if self, err := os.Executable(); err == nil {
		cmd.Args[0] = self // as the mount helper too: a daemon's name (isDaemon)
	}
	cmd.Stderr = logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return "", logPath, err
	}
	if err := cmd.Start(); err != nil {
		return "", logPath, fmt.Errorf("start daemon: %w", err)
	}
	line, _ := bufio.NewReader(out).ReadString('\n')
	if !strings.HasPrefix(line, "ready ") {
		cmd.Wait()
		return "", logPath, fmt.Errorf("the daemon failed; its log %s says:\n%s", logPath, tail(logPath, 5))
	}
	return strings.TrimSpace(line), logPath, nil
}

// tail returns the last n lines of a file.
func tail(path string, n int) string {
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
