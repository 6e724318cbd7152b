package fs

import (
	"context"
	"os"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"tensorfs/ctl"
)

// requester is who a request is checked for: the kernel's credentials of
// a FUSE caller, or a control-socket peer's, taken when it connected.
type requester struct {
	Uid, Gid uint32
	Groups   []uint32
}

// peer is the requester of a control-socket request.
func peer(c ctl.Cred) requester { return requester{c.Uid, c.Gid, c.Groups} }

// fuseRequester is the requester of a FUSE request. FUSE names the
// caller's uid and gid; its supplementary groups are read from its
// thread, which waits in the request meanwhile, so that its id cannot be
// another's.
func fuseRequester(ctx context.Context) requester {
	c := caller(ctx)
	return requester{Uid: c.Uid, Gid: c.Gid, Groups: threadGroups(c.Pid)}
}

// threadGroups reads the supplementary groups of thread tid.
func threadGroups(tid uint32) []uint32 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(int(tid)) + "/status")
	if err != nil {
		return nil
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Groups:"); ok {
			var gs []uint32
			for _, f := range strings.Fields(v) {
				if g, err := strconv.ParseUint(f, 10, 32); err == nil {
					gs = append(gs, uint32(g))
				}
			}
			return gs
		}
	}
	return nil
}

// inGroup reports whether the requester's primary or supplementary
// groups include gid.
func (r *requester) inGroup(gid uint32) bool {
	return r.Gid == gid || slices.Contains(r.Groups, gid)
}

// permitted applies the mode bits of st to the requester as the kernel
// would for want (4 read, 2 write, 1 execute/search); root may do
// anything.
func (r *requester) permitted(st *unix.Stat_t, want uint32) bool {
	if r.Uid == 0 {
		return true
	}
	mode := st.Mode & 0o777
	switch {
	case r.Uid == st.Uid:
		mode >>= 6
	case r.inGroup(st.Gid):
		mode >>= 3
	}
	return mode&want == want
}
