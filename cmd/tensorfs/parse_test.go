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
	got, err := mountOptions("rw,nofail,x-systemd.automount,capacity=8G,disk=/data/t,allow_other,no_passthrough,,defaults")
	want := []string{"--capacity", "8G", "--disk", "/data/t", "--allow-other", "--no-passthrough"}
	if err != nil || !slices.Equal(got, want) {
		t.Errorf("mountOptions = %q, %v; want %q", got, err, want)
	}
	for _, bad := range []string{"bogus", "capacity", "allow_other=1", "gpu"} {
		_, err := mountOptions(bad)
		if err == nil || !strings.Contains(err.Error(), "option") {
			t.Errorf("mountOptions(%q) = %v; want an error naming the option", bad, err)
		}
	}
}
