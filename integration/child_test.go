package integration

import (
	"bufio"
	"context"
	"io"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// pollTimeout bounds every poll-with-deadline of the tests.
const pollTimeout = 15 * time.Second

// eventually polls cond until it reports true or pollTimeout passes,
// then fails with cond's last explanation.
func eventually(t *testing.T, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(pollTimeout)
	delay := time.Millisecond
	for {
		ok, why := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not true after %v: %s", what, pollTimeout, why)
		}
		time.Sleep(delay)
		delay = min(2*delay, 100*time.Millisecond)
	}
}

// pyChild is a long-running python child that talks line by line over
// its stdin and stdout.
type pyChild struct {
	name   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string
	stderr *lockedBuffer
	done   chan struct{}
	err    error
}

// startPython starts /usr/bin/python3 -c script args... with pipes; the
// cleanup kills it if the test did not wait for it.
func startPython(t *testing.T, name, script string, args ...string) *pyChild {
	t.Helper()
	return startPythonAs(t, 0, name, script, args...)
}

// startPythonAs is startPython as uid, in "/"; uid 0 is the test's own
// user, in its working directory.
func startPythonAs(t *testing.T, uid int, name, script string, args ...string) *pyChild {
	t.Helper()
	python(t, "import mmap") // the harness's check for a usable python
	ctx, cancel := context.WithTimeout(context.Background(), commandTimeout)
	c := &pyChild{
		name:   name,
		cmd:    exec.CommandContext(ctx, systemPython, append([]string{"-u", "-c", script}, args...)...),
		lines:  make(chan string, 64),
		stderr: &lockedBuffer{},
		done:   make(chan struct{}),
	}
	if uid != 0 {
		asUser(c.cmd, uid)
		c.cmd.Dir = "/"
	}
	c.cmd.Stderr = c.stderr
	c.cmd.WaitDelay = 5 * time.Second
	var err error
	if c.stdin, err = c.cmd.StdinPipe(); err != nil {
		cancel()
		t.Fatal(err)
	}
	stdout, err := c.cmd.StdoutPipe()
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if err := c.cmd.Start(); err != nil {
		cancel()
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
		close(c.lines)
		c.err = c.cmd.Wait()
		cancel()
		close(c.done)
	}()
	t.Cleanup(func() {
		select {
		case <-c.done:
		default:
			c.cmd.Process.Kill()
			<-c.done
		}
	})
	return c
}

// expect reads the child's next line and fails unless it is want (or
// starts with want+" " when prefix; the rest is returned).
func (c *pyChild) expect(t *testing.T, want string) string {
	t.Helper()
	select {
	case line, ok := <-c.lines:
		if !ok {
			<-c.done
			t.Fatalf("%s exited (%v) before saying %q\nstderr:\n%s", c.name, c.err, want, c.stderr.String())
		}
		if line == want {
			return ""
		}
		if rest, ok := strings.CutPrefix(line, want+" "); ok {
			return rest
		}
		t.Fatalf("%s said %q, want %q\nstderr:\n%s", c.name, line, want, c.stderr.String())
	case <-time.After(commandTimeout):
		t.Fatalf("%s said nothing within %v, want %q\nstderr:\n%s", c.name, commandTimeout, want, c.stderr.String())
	}
	return ""
}

// send writes one line to the child's stdin.
func (c *pyChild) send(t *testing.T, line string) {
	t.Helper()
	if _, err := io.WriteString(c.stdin, line+"\n"); err != nil {
		t.Fatalf("telling %s %q: %v\nstderr:\n%s", c.name, line, err, c.stderr.String())
	}
}

// wait closes stdin and waits for a zero exit.
func (c *pyChild) wait(t *testing.T) {
	t.Helper()
	c.stdin.Close()
	for range c.lines {
	}
	<-c.done
	if c.err != nil {
		t.Fatalf("%s: %v\nstderr:\n%s", c.name, c.err, c.stderr.String())
	}
}

// do sends one line and returns the child's answer.
func (c *pyChild) do(t *testing.T, line string) string {
	t.Helper()
	if _, err := io.WriteString(c.stdin, line+"\n"); err != nil {
		t.Fatalf("telling %s %q: %v\nstderr:\n%s", c.name, line, err, c.stderr.String())
	}
	select {
	case ans, ok := <-c.lines:
		if !ok {
			<-c.done
			t.Fatalf("%s exited (%v) before answering %q\nstderr:\n%s", c.name, c.err, line, c.stderr.String())
		}
		return ans
	case <-time.After(commandTimeout):
		t.Fatalf("%s did not answer %q within %v\nstderr:\n%s", c.name, line, commandTimeout, c.stderr.String())
	}
	return ""
}

// next returns the child's next line.
func (c *pyChild) next(t *testing.T) string {
	t.Helper()
	select {
	case line, ok := <-c.lines:
		if !ok {
			<-c.done
			t.Fatalf("%s exited (%v) before saying anything more\nstderr:\n%s", c.name, c.err, c.stderr.String())
		}
		return line
	case <-time.After(commandTimeout):
		t.Fatalf("%s said nothing within %v\nstderr:\n%s", c.name, commandTimeout, c.stderr.String())
	}
	return ""
}
