// Package testcerts issues a throwaway cluster CA and node certificates
// for tests, as PEM files in a directory (what scripts/cluster.sh does
// with openssl for the test bed).
package testcerts

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// CA is a certificate authority whose certificate is in File.
type CA struct {
	File string // PEM of the CA certificate
	dir  string
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// Files are the PEM files of one issued certificate.
type Files struct {
	CA, Cert, Key string
}

// NewCA makes a CA named name, writing its certificate to dir/name-ca.pem.
func NewCA(dir, name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name + " CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	ca := &CA{File: filepath.Join(dir, name+"-ca.pem"), dir: dir, cert: cert, key: key}
	return ca, writePEM(ca.File, "CERTIFICATE", der)
}

// Issue makes a certificate for a node or server called name, valid for
// client and server use, naming name as a DNS name and each of ips.
func (ca *CA) Issue(name string, ips ...net.IP) (Files, error) {
	return ca.IssueCN(name, name, ips...)
}

// IssueCN is Issue with cn as the subject's common name (a CA may give
// every node's certificate the same one, or none: a node's name is its
// certificate's DNS name).
func (ca *CA) IssueCN(cn, name string, ips ...net.IP) (Files, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return Files{}, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return Files{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: cn},
		DNSNames:     []string{name},
		IPAddresses:  ips,
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return Files{}, err
	}
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return Files{}, err
	}
	base := filepath.Join(ca.dir, fmt.Sprintf("%s-%s", filepath.Base(ca.File[:len(ca.File)-len("-ca.pem")]), name))
	f := Files{CA: ca.File, Cert: base + ".pem", Key: base + "-key.pem"}
	if err := writePEM(f.Cert, "CERTIFICATE", der); err != nil {
		return Files{}, err
	}
	return f, writePEM(f.Key, "PRIVATE KEY", kder)
}

func writePEM(path, typ string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}
