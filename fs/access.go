package fs

import (
	"context"
	"fmt"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/ctl"
	"tensorfs/procfs"
)

// fuseRequester is who a FUSE request is checked for. FUSE names the
// caller's uid and gid; its supplementary groups are read from its
// thread, which waits in the request meanwhile, so that its id cannot be
// another's.
func fuseRequester(ctx context.Context) ctl.Cred {
	c := caller(ctx)
	who := ctl.Cred{Pid: int32(c.Pid), Uid: c.Uid, Gid: c.Gid}
	if st, err := procfs.ReadStatus(int(c.Pid)); err == nil {
		who.Groups = st.Groups
	}
	return who
}

// permitted applies the mode bits of st to who as the kernel would for
// want (4 read, 2 write, 1 execute/search); root may do anything.
func permitted(who *ctl.Cred, st *unix.Stat_t, want uint32) bool {
	if who.Uid == 0 {
		return true
	}
	mode := st.Mode & 0o777
	switch {
	case who.Uid == st.Uid:
		mode >>= 6
	case who.InGroup(st.Gid):
		mode >>= 3
	}
	return mode&want == want
}

// mayRemove says why who may not remove (or rename) the object st from
// the directory dir, as the kernel judges it: write and search permission
// on dir, and in a sticky directory, ownership of the object or of dir
// (root may). nil if who may.
func mayRemove(who *ctl.Cred, dir, st *unix.Stat_t) error {
	switch {
	case !permitted(who, dir, 2|1):
		return fmt.Errorf("%w: no write and search permission on its directory", syscall.EACCES)
	case dir.Mode&unix.S_ISVTX != 0 && who.Uid != 0 && who.Uid != st.Uid && who.Uid != dir.Uid:
		return fmt.Errorf("%w: its directory is sticky, and neither it nor the directory is uid %d's", syscall.EPERM, who.Uid)
	}
	return nil
}
