// Package etcdtest runs etcd's embedded server, a single member speaking
// mutual TLS to its clients, for the cluster tests and the test bed. It
// is the same etcd release as the client the daemon links.
package etcdtest

import (
	"fmt"
	"net"
	"net/url"
	"path/filepath"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"

	"tensorfs/internal/testcerts"
)

// Server is a running (or stopped) single-member etcd.
type Server struct {
	// ClientURL is where clients reach it: https://ADDR.
	ClientURL string
	cfg       *embed.Config
	e         *embed.Etcd
}

// TLS names the PEM files etcd serves clients with: the cluster CA, whose
// certificates alone it accepts from clients, and its own certificate and
// key (which must name the address clients dial).
type TLS struct {
	CA, Cert, Key string
}

// Start runs etcd with its data in dir, serving clients at clientAddr and
// its (unused, single-member) peer port at peerAddr, both host:port. It
// logs to log (nothing if nil).
func Start(dir, clientAddr, peerAddr string, tls TLS, log *zap.Logger) (*Server, error) {
	curl, err := url.Parse("https://" + clientAddr)
	if err != nil {
		return nil, err
	}
	purl, err := url.Parse("http://" + peerAddr)
	if err != nil {
		return nil, err
	}
	cfg := embed.NewConfig()
	cfg.Name = "etcd"
	cfg.Dir = dir
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*curl}, []url.URL{*curl}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*purl}, []url.URL{*purl}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.ClientTLSInfo = transport.TLSInfo{CertFile: tls.Cert, KeyFile: tls.Key, TrustedCAFile: tls.CA, ClientCertAuth: true}
	if log == nil {
		log = zap.NewNop()
	}
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(log)
	cfg.UnsafeNoFsync = true // test data on tmpfs
	s := &Server{ClientURL: curl.String(), cfg: cfg}
	return s, s.start()
}

func (s *Server) start() error {
	e, err := embed.StartEtcd(s.cfg)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		e.Close()
		return fmt.Errorf("etcd: %w", err)
	case <-time.After(30 * time.Second):
		e.Close()
		return fmt.Errorf("etcd: not ready after 30s")
	}
	s.e = e
	return nil
}

// Stop stops etcd; its data stays for Restart.
func (s *Server) Stop() {
	if s.e != nil {
		s.e.Close()
		s.e = nil
	}
}

// Restart starts a stopped etcd again on the same data and addresses.
func (s *Server) Restart() error {
	s.Stop()
	return s.start()
}

// Err returns a channel that reports a fatal error of the running etcd.
func (s *Server) Err() <-chan error { return s.e.Err() }

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
