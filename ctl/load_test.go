package ctl

import (
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"tensorfs/fdpass"
)

// loadBackend serves load from n memfds named seg000, seg001..., the odd
// ones without a descriptor, each name padded to pad bytes.
type loadBackend struct {
	*fakeBackend
	t      *testing.T
	n, pad int
	asked  []string // the "after" of each call
}

func (b *loadBackend) name(i int) string {
	return fmt.Sprintf("seg%03d", i) + strings.Repeat("x", b.pad)
}

func (b *loadBackend) Load(cred Cred, path string, write bool, after string, max int, _ *any) ([]Segment, []int, bool, error) {
	b.asked = append(b.asked, after)
	if path == "secret" {
		return nil, nil, false, syscall.EACCES
	}
	var segs []Segment
	var fds []int
	for i := 0; i < b.n; i++ {
		if b.name(i) <= after {
			continue
		}
		if len(segs) == max {
			return segs, fds, true, nil
		}
		segs = append(segs, Segment{Name: b.name(i), Size: 4, FD: 99, Dtype: "uint8", Shape: "[4]"})
		fd := -1
		if i%2 == 0 {
			f := memfd(b.t, fmt.Sprintf("%04d", i))
			var err error
			if fd, err = fdpass.Dup(f); err != nil {
				b.t.Fatal(err)
			}
			f.Close()
		}
		fds = append(fds, fd)
	}
	return segs, fds, false, nil
}

func TestLoad(t *testing.T) {
	for _, tc := range []struct {
		name    string
		n, pad  int
		perUID  int // descriptors per uid; 0: the default
		replies int
	}{
		{"one reply", 10, 0, 0, 1},
		{"253 descriptors a reply", 600, 0, 0, 3},
		{"descriptor limit", 30, 0, backendFDs + 8, 4},
		{"64 KiB a reply", 200, 1000, 0, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := &loadBackend{fakeBackend: newFakeBackend(t, nil), t: t, n: tc.n, pad: tc.pad}
			s, path := listen(t, Config{Backend: b, PerUID: Limits{FDs: tc.perUID}})
			c := dial(t, path)
			var got []Segment
			after, replies := "", 0
			for {
				segs, files, more, err := c.Load("model", false, after)
				if err != nil {
					t.Fatal(err)
				}
				replies++
				for _, s := range segs {
					i := len(got)
					if s.Name != b.name(i) || (s.FD >= 0) != (i%2 == 0) {
						t.Fatalf("segment %d: %+v", i, s)
					}
					if s.FD >= 0 {
						if data := contents(t, files[s.FD]); data != fmt.Sprintf("%04d", i) {
							t.Errorf("segment %d reads %q", i, data)
						}
					}
					got = append(got, s)
				}
				closeFiles(files)
				if !more {
					break
				}
				after = segs[len(segs)-1].Name
			}
			if len(got) != tc.n || replies != tc.replies {
				t.Errorf("%d segments in %d replies, want %d in %d", len(got), replies, tc.n, tc.replies)
			}
			// What each load counted is given back once it has replied: the
			// open connection alone stays counted.
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
				used := s.quota.held(0)
				if used == (Limits{Conns: 1}) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("after %d loads on an open connection: %+v counted, want the connection alone", replies, used)
				}
			}
		})
	}
}

func TestLoadRefusals(t *testing.T) {
	_, path := startServer(t, newFakeBackend(t, nil), 0)
	_, _, _, err := dial(t, path).Load("model", false, "")
	wantErrno(t, err, syscall.EOPNOTSUPP) // a backend without Load

	b := &loadBackend{fakeBackend: newFakeBackend(t, nil), t: t, n: 1}
	_, path = startServer(t, b, 0)
	c := dial(t, path)
	_, _, _, err = c.Load("secret", false, "")
	wantErrno(t, err, syscall.EACCES)
	for _, p := range []string{"", "/abs", "a/../b", ".."} {
		_, _, _, err = c.Load(p, false, "")
		wantErrno(t, err, syscall.EINVAL)
	}
	_, _, _, err = c.Load("m", false, "a\x00b")
	wantErrno(t, err, syscall.EINVAL)
	if segs, files, _, err := c.Load("./", false, ""); err != nil || len(segs) != 1 {
		t.Errorf("load of the root: %v %v", segs, err)
	} else {
		closeFiles(files)
	}
}
