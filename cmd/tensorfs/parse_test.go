package main

import (
	"slices"
	"strings"
	"testing"
)

func TestParseSize(t *testing.T) {
	for _, c := range []struct {
		in   string
		want int64
	}{
		{"", 0}, {"4096", 4096}, {"512M", 512 << 20}, {"8G", 8 << 30}, {"8g", 8 << 30},
		{"1T", 1 << 40}, {"64K", 64 << 10}, {"2GB", 2 << 30},
	} {
		got, err := parseSize(c.in)
		if err != nil || got != c.want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", c.in, got, err, c.want)
		}
	}
	for _, bad := range []string{"0", "-1G", "G", "8X", "1.5G", "99999999999T", "nonsense"} {
		if _, err := parseSize(bad); err == nil {
			t.Errorf("parseSize(%q) accepted", bad)
		}
	}
}

func TestMountOptions(t *testing.T) {
	got, err := mountOptions("rw,nofail,x-systemd.automount,capacity=8G,disk=/data/t,allow_other,no_passthrough,huge_pages,,defaults")
	want := []string{"--capacity", "8G", "--disk", "/data/t", "--allow-other", "--no-passthrough", "--huge-pages"}
	if err != nil || !slices.Equal(got, want) {
		t.Errorf("mountOptions = %q, %v; want %q", got, err, want)
	}
	got, err = mountOptions("cluster=https://10.0.0.1:2379,node=node1,cluster=https://10.0.0.2:2379,cluster_ca=/etc/t/ca.pem,cluster_cert=/etc/t/n.pem,cluster_key=/etc/t/n-key.pem")
	want = []string{"--node", "node1", "--cluster-ca", "/etc/t/ca.pem", "--cluster-cert", "/etc/t/n.pem", "--cluster-key", "/etc/t/n-key.pem",
		"--cluster", "https://10.0.0.1:2379,https://10.0.0.2:2379"}
	if err != nil || !slices.Equal(got, want) {
		t.Errorf("mountOptions(cluster) = %q, %v; want %q", got, err, want)
	}
	for _, bad := range []string{"bogus", "capacity", "allow_other=1", "huge_pages=1", "gpu", "cluster", "cluster_foo=1"} {
		_, err := mountOptions(bad)
		if err == nil || !strings.Contains(err.Error(), "option") {
			t.Errorf("mountOptions(%q) = %v; want an error naming the option", bad, err)
		}
	}
}
