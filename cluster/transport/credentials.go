package transport

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
)

// Credentials are what makes a node a member of a cluster: the cluster's
// CA and this node's certificate and key, issued by that CA. The same
// credentials reach etcd and the peers; both sides of every connection
// must show a certificate of the cluster (mutual TLS).
type Credentials struct {
	CA   *x509.CertPool  // the cluster CA: the only root trusted
	Cert tls.Certificate // this node's certificate chain and key
}

// LoadCredentials reads the cluster CA, the node's certificate and its key
// from PEM files (--cluster-ca, --cluster-cert, --cluster-key).
func LoadCredentials(caFile, certFile, keyFile string) (*Credentials, error) {
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("cluster CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("cluster CA %s: no PEM certificate in it", caFile)
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("cluster certificate %s, key %s: %w", certFile, keyFile, err)
	}
	c := &Credentials{CA: pool, Cert: cert}
	if _, err := c.leaf(); err != nil {
		return nil, err
	}
	return c, nil
}

// leaf parses this node's own certificate and checks it chains to the CA.
func (c *Credentials) leaf() (*x509.Certificate, error) {
	if len(c.Cert.Certificate) == 0 {
		return nil, fmt.Errorf("cluster certificate: empty chain")
	}
	leaf, err := x509.ParseCertificate(c.Cert.Certificate[0])
	if err != nil {
		return nil, fmt.Errorf("cluster certificate: %w", err)
	}
	inter := x509.NewCertPool()
	for _, der := range c.Cert.Certificate[1:] {
		if ic, err := x509.ParseCertificate(der); err == nil {
			inter.AddCert(ic)
		}
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: c.CA, Intermediates: inter,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth}}); err != nil {
		return nil, fmt.Errorf("cluster certificate %q is not one of the cluster CA's for client and server use: %w", leaf.Subject, err)
	}
	return leaf, nil
}

// CheckName reports an error unless this node's certificate names node:
// peers verify a node's name against its certificate, so a certificate
// that does not carry it would be refused by every peer.
func (c *Credentials) CheckName(node string) error {
	leaf, err := c.leaf()
	if err != nil {
		return err
	}
	if err := leaf.VerifyHostname(node); err != nil {
		return fmt.Errorf("cluster certificate does not name node %q (its names: %v): issue one with %q as a DNS name", node, leaf.DNSNames, node)
	}
	return nil
}

// ServerConfig is the TLS configuration of a piece server: it shows the
// node's certificate and accepts only clients with a certificate of the
// cluster CA.
func (c *Credentials) ServerConfig() *tls.Config {
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{c.Cert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    c.CA,
	}
}

// ClientConfig is the TLS configuration to reach a server whose
// certificate must carry serverName (a node name, or etcd's host name or
// address when serverName is ""; gRPC then takes it from the address
// dialled). The client shows the node's own certificate.
func (c *Credentials) ClientConfig(serverName string) *tls.Config {
	return &tls.Config{
		MinVersion:   tls.VersionTLS12, // etcd's server may stop at 1.2
		Certificates: []tls.Certificate{c.Cert},
		RootCAs:      c.CA,
		ServerName:   serverName,
	}
}
