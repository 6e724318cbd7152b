package ctl

import (
	"errors"
	"path"
	"strings"
	"syscall"
	"testing"
)

func TestParseRequest(t *testing.T) {
	long := strings.Repeat("a", maxPath+1)
	for _, tc := range []struct {
		in    string
		nfds  int
		want  request
		errno syscall.Errno
	}{
		{in: `{"v":1,"op":"export","path":"a/b"}`, want: request{Op: opExport, Path: "a/b"}},
		{in: ` {"op":"export","v":1,"path":"a//./b/","write":true} `, want: request{Op: opExport, Path: "a/b", Write: true}},
		{in: `{"v":1,"op":"import","path":"x","dtype":"float32","shape":"[2, 3]"}`, nfds: 1, want: request{Op: opImport, Path: "x", Dtype: "float32", Shape: "[2, 3]"}},
		{in: `{"v":1,"op":"all_gather","group":"g","rank":3,"world":4}`, nfds: 1, want: request{Op: opAllGather, Group: "g", Rank: 3, World: 4}},
		{in: `{"v":1,"op":"broadcast","group":"g","rank":0,"world":3,"root":0}`, nfds: 1, want: request{Op: opBroadcast, Group: "g", World: 3}},
		{in: `{"v":1,"op":"broadcast","group":"g","rank":2,"world":3,"root":0}`, want: request{Op: opBroadcast, Group: "g", Rank: 2, World: 3}},
		{in: `{"v":1,"op":"all_gather","group":"g","rank":252,"world":253}`, nfds: 1, want: request{Op: opAllGather, Group: "g", Rank: 252, World: 253}},
		{in: `{"v":1,"op":"all_gather","group":"g","rank":0,"world":2,"open":true}`, nfds: 1, want: request{Op: opAllGather, Group: "g", World: 2, Open: true}},
		{in: `{"v":1,"op":"broadcast","group":"g","rank":1,"world":2,"root":0,"open":false}`, want: request{Op: opBroadcast, Group: "g", Rank: 1, World: 2}},
		{in: `{"v":1,"op":"purge"}`, want: request{Op: opPurge}},

		{in: ``, errno: syscall.EINVAL},
		{in: `[]`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","path":"a"`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","path":"a"}x`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","path":"a"}{}`, errno: syscall.EINVAL},
		{in: `{"v":1,"v":1,"op":"export","path":"a"}`, errno: syscall.EINVAL},
		{in: `{"op":"export","path":"a"}`, errno: syscall.EINVAL},
		{in: `{"v":"1","op":"export","path":"a"}`, errno: syscall.EINVAL},
		{in: `{"v":1.0,"op":"export","path":"a"}`, errno: syscall.EINVAL},
		{in: `{"v":2,"op":"export","path":"a"}`, errno: syscall.EPROTONOSUPPORT},
		{in: `{"v":2,"op":"whatever"}`, errno: syscall.EPROTONOSUPPORT},
		{in: `{"v":1,"op":"open","path":"a"}`, errno: syscall.EOPNOTSUPP},
		{in: `{"v":1,"op":null,"path":"a"}`, errno: syscall.EINVAL},
		{in: `{"v":1,"OP":"export","path":"a"}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","Path":"a"}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export"}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","path":null}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","path":"a","write":"yes"}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","path":"a","dtype":"float32"}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","path":"/a"}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","path":"a/../../b"}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","path":"a/.."}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","path":"."}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","path":""}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","path":"a\u0000b"}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","path":"` + long + `"}`, errno: syscall.ENAMETOOLONG},
		{in: `{"v":1,"op":"export","path":"a"}`, nfds: 1, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","path":"a"}`, nfds: -1, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"import","path":"a"}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"import","path":"a"}`, nfds: 2, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"all_gather","group":"g","rank":0,"world":2}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"purge","path":"a"}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"purge"}`, nfds: 1, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"all_gather","group":"g","rank":2,"world":2}`, nfds: 1, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"all_gather","group":"g","rank":-1,"world":2}`, nfds: 1, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"all_gather","group":"g","rank":0,"world":254}`, nfds: 1, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"all_gather","group":"g","rank":0,"world":0}`, nfds: 1, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"all_gather","group":"g","rank":0,"world":1e1}`, nfds: 1, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"all_gather","group":"g","rank":0,"world":99999999999999999999}`, nfds: 1, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"all_gather","group":"","rank":0,"world":1}`, nfds: 1, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"all_gather","group":"` + strings.Repeat("g", maxGroup+1) + `","rank":0,"world":1}`, nfds: 1, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"all_gather","group":"g","rank":0,"world":1,"root":0}`, nfds: 1, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"broadcast","group":"g","rank":0,"world":1}`, nfds: 1, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"broadcast","group":"g","rank":0,"world":2,"root":2}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"broadcast","group":"g","rank":1,"world":2,"root":0}`, nfds: 1, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"broadcast","group":"g","rank":0,"world":2,"root":0}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"all_gather","group":"g","rank":0,"world":2,"open":1}`, nfds: 1, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"all_gather","group":"g","rank":0,"world":2,"open":null}`, nfds: 1, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","path":"a","open":true}`, errno: syscall.EINVAL},
		{in: `{"v":1,"op":"export","path":"a","x":` + strings.Repeat(" ", maxMessage) + `1}`, errno: syscall.EMSGSIZE},
	} {
		got, err := parseRequest([]byte(tc.in), tc.nfds)
		name := tc.in
		if len(name) > 80 {
			name = name[:80] + "..."
		}
		if tc.errno != 0 {
			var pe *protoErr
			if !errors.As(err, &pe) || pe.errno != tc.errno {
				t.Errorf("parseRequest(%s, %d) = %+v, %v; want errno %v", name, tc.nfds, got, err, tc.errno)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("parseRequest(%s, %d) = %+v, %v; want %+v", name, tc.nfds, got, err, tc.want)
		}
	}
}

func TestParseReply(t *testing.T) {
	for _, tc := range []struct {
		in   string
		nfds int
		ok   bool
	}{
		{`{"v":1,"ok":true}`, 0, true},
		{`{"v":1,"ok":true,"fds":2}`, 2, true},
		{`{"v":1,"ok":false,"errno":1,"error":"no"}`, 0, true},
		{`{"v":1,"ok":true,"fds":2}`, 1, false},
		{`{"v":1,"ok":false,"error":"no"}`, 0, false},
		{`{"v":2,"ok":true}`, 0, false},
		{`{"v":1,`, 0, false},
	} {
		if _, err := parseReply([]byte(tc.in), tc.nfds); (err == nil) != tc.ok {
			t.Errorf("parseReply(%s, %d): %v", tc.in, tc.nfds, err)
		}
	}
}

func TestErrorReplyBounded(t *testing.T) {
	r := errorReply(syscall.EIO, strings.Repeat("é", maxErrorText))
	if len(r.Error) > maxErrorText || !strings.HasPrefix(r.Error, "éé") || strings.ContainsRune(r.Error, '\uFFFD') {
		t.Errorf("error text of %d bytes: %q...", len(r.Error), r.Error[:10])
	}
}

// badPath reports whether p is not a clean relative path inside the mount.
func badPath(p string) bool {
	return p == "" || len(p) > maxPath || path.Clean(p) != p || path.IsAbs(p) ||
		p == ".." || strings.HasPrefix(p, "../") || strings.ContainsRune(p, 0)
}

// FuzzParseRequest checks that parseRequest never panics, refuses with an
// errno, and that what it accepts is valid and survives a round trip
// through the client's encoding.
func FuzzParseRequest(f *testing.F) {
	f.Add([]byte(`{"v":1,"op":"export","path":"a/b","write":true}`), 0)
	f.Add([]byte(`{"v":1,"op":"all_gather","group":"g","rank":1,"world":2}`), 1)
	f.Fuzz(func(t *testing.T, b []byte, nfds int) {
		r, err := parseRequest(b, nfds)
		if err != nil {
			var pe *protoErr
			if !errors.As(err, &pe) || pe.errno == 0 {
				t.Fatalf("error without errno: %v", err)
			}
			return
		}
		if nfds != r.wantFDs() {
			t.Fatalf("accepted %d fds for %+v", nfds, r)
		}
		switch r.Op {
		case opExport, opImport:
			if p := r.Path; p == "." || badPath(p) {
				t.Fatalf("accepted path %q", p)
			}
		case opLoad:
			if p := r.Path; p != "." && badPath(p) {
				t.Fatalf("accepted directory %q", p)
			}
		case opPurge:
			if r != (request{Op: opPurge}) {
				t.Fatalf("accepted %+v", r)
			}
		case opAllGather, opBroadcast:
			if r.Group == "" || len(r.Group) > maxGroup || r.World < 1 || r.World > maxWorld ||
				r.Rank < 0 || r.Rank >= r.World || r.Root < 0 || r.Root >= r.World {
				t.Fatalf("accepted %+v", r)
			}
		default:
			t.Fatalf("accepted op %q", r.Op)
		}
		b2, err := r.marshal()
		if err != nil {
			t.Fatal(err)
		}
		r2, err := parseRequest(b2, nfds)
		if err != nil || r2 != r {
			t.Fatalf("round trip of %+v through %s: %+v, %v", r, b2, r2, err)
		}
	})
}
