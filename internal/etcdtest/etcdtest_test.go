package etcdtest

import (
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestStartFailsWithEtcdsReason: an etcd that cannot serve (its
// certificate is missing) fails Start at once, with etcd's own log lines
// in the error, rather than after the readiness timeout. (Start, Stop and
// Restart on good certificates are what the cluster and fs tests run.)
func TestStartFailsWithEtcdsReason(t *testing.T) {
	dir := t.TempDir()
	caddr, err := FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	paddr, err := FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing.pem")
	start := time.Now()
	s, err := Start(filepath.Join(dir, "etcd"), caddr, paddr, TLS{CA: missing, Cert: missing, Key: missing}, nil)
	if err == nil {
		s.Stop()
		t.Fatal("etcd started without its certificate")
	}
	t.Logf("Start: %v", err)
	if took := time.Since(start); took > 20*time.Second {
		t.Errorf("Start took %v to fail", took)
	}
	if !strings.Contains(err.Error(), "exited before it served") || !strings.Contains(err.Error(), "missing.pem") {
		t.Errorf("Start's error does not give etcd's reason: %v", err)
	}
}
