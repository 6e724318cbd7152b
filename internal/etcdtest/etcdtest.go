// Package etcdtest runs etcd, a single member speaking mutual TLS to its
// clients, for the cluster tests and the test bed. It runs the etcd
// binary on PATH (Debian's etcd-server, 3.4, which scripts/test.sh
// installs) rather than etcd's embedded server, whose packages, compiled
// with -race for the tests alone, were a third of the test suite's
// compile; the daemon's client (etcd 3.7) speaks the same v3 API to it.
package etcdtest

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"tensorfs/internal/testcerts"
)

// readyLine is what etcd logs once it has a leader and serves its TLS
// clients (embed/serve.go, after ReadyNotify).
const readyLine = `"msg":"serving client traffic securely"`

// Server is a running (or stopped) single-member etcd.
type Server struct {
	// ClientURL is where clients reach it: https://ADDR.
	ClientURL string
	args      []string
	log       io.Writer
	cmd       *exec.Cmd
	errc      chan error    // receives the process's exit status, once
	done      chan struct{} // closed when the process has exited
}

// TLS names the PEM files etcd serves clients with: the cluster CA, whose
// certificates alone it accepts from clients, and its own certificate and
// key (which must name the address clients dial).
type TLS struct {
	CA, Cert, Key string
}

// Start runs etcd with its data in dir, serving clients at clientAddr and
// its (unused, single-member) peer port at peerAddr, both host:port. It
// copies etcd's log to log (nothing if nil).
func Start(dir, clientAddr, peerAddr string, tls TLS, log io.Writer) (*Server, error) {
	curl, purl := "https://"+clientAddr, "http://"+peerAddr
	if log == nil {
		log = io.Discard
	}
	s := &Server{ClientURL: curl, log: log, args: []string{
		"--name", "etcd", "--data-dir", dir,
		"--listen-client-urls", curl, "--advertise-client-urls", curl,
		"--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
		"--initial-cluster", "etcd=" + purl,
		"--cert-file", tls.Cert, "--key-file", tls.Key, "--trusted-ca-file", tls.CA, "--client-cert-auth",
		"--unsafe-no-fsync", // test data
		"--logger", "zap", "--log-outputs", "stderr",
	}}
	return s, s.start()
}

// start runs the etcd process and waits until it serves clients.
func (s *Server) start() error {
	bin, err := exec.LookPath("etcd")
	if err != nil {
		return fmt.Errorf("etcd: %w (install Debian's etcd-server, as scripts/test.sh does)", err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	cmd := exec.Command(bin, s.args...)
	cmd.Stdout, cmd.Stderr = w, w
	// etcd dies with the test (or test bed) that started it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	err = cmd.Start()
	w.Close()
	if err != nil {
		r.Close()
		return fmt.Errorf("etcd: %w", err)
	}
	s.cmd, s.errc, s.done = cmd, make(chan error, 1), make(chan struct{})
	ready, tail := make(chan struct{}), make(chan string, 1)
	go s.watch(r, ready, tail)
	select {
	case <-ready:
		return nil
	case <-s.done:
		s.cmd = nil
		return fmt.Errorf("etcd exited before it served: %v\n%s", <-s.errc, <-tail)
	case <-time.After(30 * time.Second):
		s.Stop()
		return fmt.Errorf("etcd: not ready after 30s\n%s", <-tail)
	}
}

// watch copies etcd's log from r to s.log, closes ready at readyLine,
// and once etcd has exited sends the log's last lines to tail and its
// exit status to s.errc, and closes s.done.
func (s *Server) watch(r *os.File, ready chan struct{}, tail chan<- string) {
	defer r.Close()
	var last []string
	sc := bufio.NewScanner(r)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		fmt.Fprintln(s.log, line)
		if last = append(last, line); len(last) > 20 {
			last = last[1:]
		}
		if ready != nil && strings.Contains(line, readyLine) {
			close(ready)
			ready = nil
		}
	}
	io.Copy(io.Discard, r) // a line past the scanner's buffer
	tail <- strings.Join(last, "\n")
	s.errc <- s.cmd.Wait()
	close(s.done)
}

// Stop stops etcd; its data stays for Restart.
func (s *Server) Stop() {
	if s.cmd != nil {
		s.cmd.Process.Signal(syscall.SIGTERM)
		<-s.done
		s.cmd = nil
	}
}

// Restart starts a stopped etcd again on the same data and addresses.
func (s *Server) Restart() error {
	s.Stop()
	return s.start()
}

// Err returns a channel that reports the running etcd's exit.
func (s *Server) Err() <-chan error { return s.errc }

// FreeAddr returns a loopback host:port no one listens on now.
func FreeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// StartWithCA makes a cluster CA in dir, issues etcd's certificate from
// it, and starts etcd with its data in dir/etcd on free ports of
// 127.0.0.1: what a test of the cluster needs first. The caller stops it.
func StartWithCA(dir string) (*Server, *testcerts.CA, error) {
	ca, err := testcerts.NewCA(dir, "cluster")
	if err != nil {
		return nil, nil, err
	}
	f, err := ca.Issue("etcd", net.IPv4(127, 0, 0, 1))
	if err != nil {
		return nil, nil, err
	}
	caddr, err := FreeAddr()
	if err != nil {
		return nil, nil, err
	}
	paddr, err := FreeAddr()
	if err != nil {
		return nil, nil, err
	}
	s, err := Start(filepath.Join(dir, "etcd"), caddr, paddr, TLS{CA: f.CA, Cert: f.Cert, Key: f.Key}, nil)
	return s, ca, err
}
