package integration

// A differential POSIX oracle: random sequences of namespace and metadata
// operations, issued by callers with different credentials
// (posix_oracle_worker_test.go), run on a plain tmpfs and on tensorfs
// side by side. After every step the errno and output of the operation
// and what each tree shows through plain lstat (the listing, type, mode,
// owner, group, size, link count, device, link target, user.* attributes;
// times by their order) must agree at once. A sequence that differs is
// shrunk by delta debugging and printed with its seed.
//
// Budget: in CI each mode runs sequences of TENSORFS_ORACLE_OPS (default
// 100) operations for oracleBudget; the seeds are the UTC date
// (YYYYMMDD*1000) plus 0, 1, 2..., printed, so a failure replays the same
// day and the next day tries others. TENSORFS_ORACLE_SEED=N runs that one
// sequence instead, as long as asked (make oracle SEED=N OPS=M).

import (
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

const (
	oracleWorkerEnv = "TENSORFS_ORACLE_WORKER" // the worker's credentials, JSON
	oracleBudget    = 30 * time.Second         // per mode, in CI
	oracleShrink    = 3 * time.Minute          // at most, to shrink one failure
	oracleSlots     = 3                        // open descriptors per caller
	utimeNow        = -1                       // oracleOp.Atime/Mtime: UTIME_NOW
	utimeOmit       = -2                       // oracleOp.Atime/Mtime: UTIME_OMIT
)

// intendedDiffs are the differences from tmpfs that tensorfs means to
// have, by name, and how the oracle leaves them out; nothing else is.
var intendedDiffs = map[string]string{
	"virtual-xattrs": "user.tensorfs.* are the daemon's own virtual attributes (DESIGN.md §4), " +
		"listed and served by it, never stored: left out of every listxattr on both trees",
	"setid-dropped-at-open": "a passthrough write never reaches the daemon, so a caller other than " +
		"root loses the set-id bits a write would clear when it opens a segment for writing, " +
		"not at the write (DESIGN.md §9): the oracle clears them on tmpfs at that open too",
	"symlink-atime": "the kernel keeps symbolic links' targets (EnableSymlinkCaching, fs/mount.go: " +
		"links never change), so reading one neither reaches the daemon nor touches its atime, as " +
		"tmpfs does: no link's atime is compared",
	"dir-atime": "not a difference of tensorfs: the oracle lists every directory at every step, " +
		"and whether that listing moves a directory's atime (relatime, coarse clock) depends on " +
		"timing: no directory's atime is compared",
	"classic-read-atime": "in classic mode the kernel answers reads from its page cache, and FUSE " +
		"leaves atime to the daemon (its inodes are S_NOATIME): a read the cache answers, one at " +
		"the end of the file included, leaves atime as it was. Serving every read from the daemon " +
		"would give up the page cache; in classic mode no regular file's atime is compared after a read",
	"no-tensorfs-flags": "EXCLUSIVE, NOCREATE, published segments and the checks of " +
		"user.tensorfs.* and user.tensor.* values differ by design (§3, §4, §10): the oracle's " +
		"trees set no flags and its operations name no such attribute",
}

// oracleCred is a caller's credentials, set once by its worker.
type oracleCred struct {
	Name             string
	Ruid, Euid, Suid int
	Rgid, Egid, Sgid int
	Groups           []int
	Umask            int
}

// oracleCallers: root; two users sharing group 3000; a user with
// supplementary groups; a setuid program (real ids differ from the
// effective ones); a pjdfstest-like caller (real root, effective user).
var oracleCallers = []oracleCred{
	{Name: "root", Umask: 0o022},
	{Name: "alice", Ruid: 1000, Euid: 1000, Suid: 1000, Rgid: 3000, Egid: 3000, Sgid: 3000, Umask: 0o002},
	{Name: "bob", Ruid: 1001, Euid: 1001, Suid: 1001, Rgid: 3000, Egid: 3000, Sgid: 3000, Umask: 0o022},
	{Name: "carol", Ruid: 1002, Euid: 1002, Suid: 1002, Rgid: 1002, Egid: 1002, Sgid: 1002, Groups: []int{3000, 3001}, Umask: 0o027},
	{Name: "setuid", Ruid: 1003, Euid: 1001, Suid: 1003, Rgid: 1003, Egid: 3001, Sgid: 1003, Umask: 0},
	{Name: "pjd", Ruid: 0, Euid: 1004, Suid: 0, Rgid: 0, Egid: 3001, Sgid: 0, Groups: []int{3001, 3000}, Umask: 0},
}

// oracleTree is the initial tree, below the top "t" (0777, root's): a
// setgid directory of group 3000 (g), a sticky 1777 one (s), a private
// one (h), files of several owners, set-id files, links, a FIFO.
var oracleTree = []struct {
	path       string
	kind       byte // d, f, l (symlink), p (FIFO)
	mode       uint32
	uid, gid   int
	data       string // a file's bytes, a link's target
	xattr, val string
}{
	{"t", 'd', 0o777, 0, 0, "", "", ""},
	{"t/f", 'f', 0o644, 0, 0, "hello\n", "user.a", "1"},
	{"t/l", 'l', 0, 0, 0, "f", "", ""},
	{"t/g", 'd', 0o2775, 1000, 3000, "", "user.b", "dir"},
	{"t/g/f", 'f', 0o664, 1000, 3000, "group data\n", "", ""},
	{"t/g/x", 'f', 0o6775, 1001, 3000, "#!/bin/sh\n", "", ""},
	{"t/g/sub", 'd', 0o2770, 1002, 3000, "", "", ""},
	{"t/s", 'd', 0o1777, 0, 0, "", "", ""},
	{"t/s/f", 'f', 0o644, 1000, 3000, "alice\n", "user.a", "alice"},
	{"t/s/b", 'f', 0o666, 1001, 1001, "", "", ""},
	{"t/s/l", 'l', 0, 1000, 3000, "../g/f", "", ""},
	{"t/h", 'd', 0o750, 1002, 3001, "", "", ""},
	{"t/h/f", 'f', 0o2640, 1002, 3001, "carol\n", "", ""},
	{"t/h/a", 'p', 0o660, 1002, 3001, "", "", ""},
}

// TestPosixOracle replays oracleFound, then runs random sequences on a
// tmpfs and on tensorfs, in both modes at once, mounted with
// --allow-other, until its budget is spent, and fails on the first step
// where they differ, with the sequence shrunk.
func TestPosixOracle(t *testing.T) {
	t.Parallel()
	ops := 100
	if s := os.Getenv("TENSORFS_ORACLE_OPS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("TENSORFS_ORACLE_OPS=%q: want a positive number", s)
		}
		ops = n
	}
	seed, one := int64(0), false
	if s := os.Getenv("TENSORFS_ORACLE_SEED"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("TENSORFS_ORACLE_SEED=%q: want a number", s)
		}
		seed, one = n, true
	} else {
		day, _ := strconv.ParseInt(time.Now().UTC().Format("20060102"), 10, 64)
		seed = day * 1000
	}
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		o := newOracle(t, m)
		deadline := time.Now().Add(oracleBudget)
		if !one {
			for _, f := range oracleFound {
				if d := o.replay(genOracleOps(f.seed, f.ops)); d != nil {
					t.Errorf("seed %d (%s) differs again after step %d: %s: %s", f.seed, f.what, d.step, d.kind, d.text)
				}
			}
		}
		n := 0
		for s := seed; n == 0 || !one && time.Now().Before(deadline); s++ {
			seq := genOracleOps(s, ops)
			if d := o.replay(seq); d != nil {
				o.report(s, seq, d)
				return
			}
			n++
		}
		t.Logf("%s: %d sequences of %d operations agree with tmpfs, seeds %d to %d",
			m.mode, n, ops, seed, seed+int64(n)-1)
	}, "--allow-other")
}

// oracleFound are sequences that found a difference the oracle no longer
// shows, with what it was: TestPosixOracle replays each first, in both
// modes, on every run.
var oracleFound = []struct {
	seed int64
	ops  int
	what string
}{
	{1, 167, "a writer of the file's group by a supplementary group lost set-group-ID at open"},
	{2, 167, "a segment created for writing kept the set-id bits its writer clears (O_CREAT, O_TMPFILE)"},
	{8, 132, "utimensat(UTIME_NOW) set mtime from the daemon's clock, after the ctime it made"},
	{13, 300, "chown(f, -1, -1) by another user did not move ctime (a SETATTR of nothing changed nothing)"},
}

// oracle holds a tmpfs and a tensorfs mount and the callers' workers.
type oracle struct {
	t       *testing.T
	mode    string
	ref     string // the tmpfs mountpoint
	mnt     string // the tensorfs mountpoint
	callers []*callerProc
	trees   int // trees made so far: each replay makes its own
}

// newOracle mounts a tmpfs with the tensorfs mount's nosuid, nodev and
// noexec, makes both reachable by every caller, and starts the workers.
func newOracle(t *testing.T, m *mount) *oracle {
	t.Helper()
	ref := filepath.Join(t.TempDir(), "ref")
	if err := os.Mkdir(ref, 0o755); err != nil {
		t.Fatal(err)
	}
	opts := []string{"size=64m", "mode=0755"}
	for _, e := range readMountinfo() {
		if e.mountPoint != m.dir {
			continue
		}
		for _, o := range strings.Split(e.options, ",") {
			if o == "nosuid" || o == "nodev" || o == "noexec" {
				opts = append(opts, o)
			}
		}
	}
	run(t, "mount", "-t", "tmpfs", "-o", strings.Join(opts, ","), "oracle", ref)
	t.Cleanup(func() { lazyUnmount(ref) })
	reachable(t, ref)
	reachable(t, m.dir)
	return &oracle{t: t, mode: m.mode, ref: ref, mnt: m.dir, callers: startCallers(t)}
}

// oracleDiff is the first difference a replay met.
type oracleDiff struct {
	step int    // index of the operation after which it showed
	kind string // what differs ("errno of open", "mode", ...): a shrink keeps it
	text string // both sides, readable
}

// replay runs ops on fresh trees in both mounts and returns the first
// difference, or nil.
func (o *oracle) replay(ops []oracleOp) *oracleDiff {
	t := o.t
	o.trees++
	wrap := [2]string{
		filepath.Join(o.ref, fmt.Sprintf("o%d", o.trees)),
		filepath.Join(o.mnt, fmt.Sprintf("o%d", o.trees)),
	}
	for _, w := range wrap {
		makeOracleTree(t, w)
	}
	defer func() {
		o.closeSlots(wrap)
		for _, w := range wrap {
			if err := os.RemoveAll(w); err != nil {
				t.Fatalf("removing %s: %v", w, err)
			}
		}
	}()
	tops := [2]string{filepath.Join(wrap[0], "t"), filepath.Join(wrap[1], "t")}
	prev := [2]map[string]oracleEntry{snapshot(t, wrap[0]), snapshot(t, wrap[1])}
	if d := compareTrees(prev, prev, false); d != nil {
		d.step = -1
		return d
	}
	for i, op := range ops {
		nextTick()
		r := o.callers[op.Caller].call(t, oracleRequest{Tops: tops, Op: op})
		if r.FixPath != "" {
			if err := unix.Chmod(r.FixPath, r.FixMode); err != nil {
				t.Fatalf("chmod %s (setid-dropped-at-open): %v", r.FixPath, err)
			}
		}
		if r.Errno[0] != r.Errno[1] {
			return &oracleDiff{step: i, kind: "errno of " + op.Op,
				text: fmt.Sprintf("tmpfs: %s, tensorfs: %s", errnoName(r.Errno[0]), errnoName(r.Errno[1]))}
		}
		if r.Out[0] != r.Out[1] {
			return &oracleDiff{step: i, kind: "output of " + op.Op,
				text: fmt.Sprintf("tmpfs: %q, tensorfs: %q", r.Out[0], r.Out[1])}
		}
		cur := [2]map[string]oracleEntry{snapshot(t, wrap[0]), snapshot(t, wrap[1])}
		// intendedDiffs "classic-read-atime"
		if d := compareTrees(prev, cur, o.mode == "classic" && op.Op == "read"); d != nil {
			d.step = i
			return d
		}
		prev = cur
	}
	return nil
}

// closeSlots closes every descriptor the workers hold.
func (o *oracle) closeSlots(wrap [2]string) {
	for c, p := range o.callers {
		for s := range oracleSlots {
			p.call(o.t, oracleRequest{Tops: wrap, Op: oracleOp{Caller: c, Op: "close", Slot: s}})
		}
	}
}

// errnoName spells an errno for a report: "0" or "EACCES (permission denied)".
func errnoName(e int) string {
	if e == 0 {
		return "0"
	}
	return fmt.Sprintf("%s (%v)", unix.ErrnoName(unix.Errno(e)), unix.Errno(e))
}

// makeOracleTree makes wrap (0755, root's) and oracleTree below it.
func makeOracleTree(t *testing.T, wrap string) {
	t.Helper()
	if err := os.Mkdir(wrap, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, e := range oracleTree {
		p := filepath.Join(wrap, e.path)
		var err error
		switch e.kind {
		case 'd':
			err = unix.Mkdir(p, 0)
		case 'f':
			err = os.WriteFile(p, []byte(e.data), 0)
		case 'l':
			err = unix.Symlink(e.data, p)
		case 'p':
			err = unix.Mknod(p, unix.S_IFIFO, 0)
		}
		if err == nil {
			err = unix.Lchown(p, e.uid, e.gid)
		}
		if err == nil && e.kind != 'l' {
			err = unix.Chmod(p, e.mode)
		}
		if err == nil && e.xattr != "" {
			err = unix.Lsetxattr(p, e.xattr, []byte(e.val), 0)
		}
		if err != nil {
			t.Fatalf("making %s: %v", p, err)
		}
	}
}

// oracleEntry is what lstat and friends show of one name.
type oracleEntry struct {
	ino          uint64
	mode         uint32 // type and permission bits
	uid, gid     uint32
	size         int64
	nlink        uint64
	rdev         uint64
	link         string // a symlink's target
	xattrs       string // user.* names and values
	atime, mtime int64  // ns
	ctime        int64  // ns
}

// snapshot walks wrap through the mount (plain lstat, llistxattr,
// lgetxattr, readlink: what the kernel serves, caches included) and
// returns every name by its path relative to wrap.
func snapshot(t *testing.T, wrap string) map[string]oracleEntry {
	t.Helper()
	out := map[string]oracleEntry{}
	var walk func(rel string)
	walk = func(rel string) {
		p := filepath.Join(wrap, rel)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			t.Fatalf("lstat %s: %v", p, err)
		}
		e := oracleEntry{ino: st.Ino, mode: st.Mode, uid: st.Uid, gid: st.Gid, size: st.Size, nlink: st.Nlink,
			rdev: st.Rdev, atime: st.Atim.Nano(), mtime: st.Mtim.Nano(), ctime: st.Ctim.Nano()}
		if st.Mode&unix.S_IFMT == unix.S_IFLNK {
			target, err := os.Readlink(p)
			if err != nil {
				t.Fatalf("readlink %s: %v", p, err)
			}
			e.link = target
		}
		names, err := userXattrs(p)
		if err != nil {
			t.Fatalf("llistxattr %s: %v", p, err)
		}
		for _, name := range names {
			v, err := lgetxattr(p, name)
			if err != nil {
				t.Fatalf("lgetxattr %s %s: %v", p, name, err)
			}
			e.xattrs += fmt.Sprintf("%s=%q ", name, v)
		}
		out[rel] = e
		if st.Mode&unix.S_IFMT != unix.S_IFDIR {
			return
		}
		ents, err := os.ReadDir(p)
		if err != nil {
			t.Fatalf("readdir %s: %v", p, err)
		}
		for _, d := range ents {
			walk(filepath.Join(rel, d.Name()))
		}
	}
	walk(".")
	return out
}

// lgetxattr reads a whole attribute of p itself (a link's own).
func lgetxattr(p, name string) ([]byte, error) {
	buf := make([]byte, 64<<10)
	n, err := unix.Lgetxattr(p, name, buf)
	if err != nil {
		return nil, err
	}
	return buf[:n], nil
}

// describe formats what is compared of e, times apart.
func (e oracleEntry) describe() []string {
	return []string{
		fmt.Sprintf("type %#o", e.mode&unix.S_IFMT),
		fmt.Sprintf("mode %#o", e.mode&0o7777),
		fmt.Sprintf("uid %d", e.uid),
		fmt.Sprintf("gid %d", e.gid),
		fmt.Sprintf("size %d", e.size),
		fmt.Sprintf("nlink %d", e.nlink),
		fmt.Sprintf("rdev %#x", e.rdev),
		fmt.Sprintf("link %q", e.link),
		fmt.Sprintf("xattrs %s", e.xattrs),
	}
}

// timeOrder describes e's times by their order: each against the same
// object's (prev) in the previous step (new, earlier, same, later; a regular
// file's atime not when noFileAtime), and whether
// mtime is after ctime. Whether mtime equals ctime or is before it is
// not compared: with multigrain timestamps it depends on whether anyone
// read the times between two changes, and the daemon reads them.
func timeOrder(prev *oracleEntry, e oracleEntry, noFileAtime bool) string {
	rel := func(a, b int64) string {
		switch {
		case a < b:
			return "earlier"
		case a > b:
			return "later"
		}
		return "same"
	}
	after := fmt.Sprintf("mtime after ctime %v", e.mtime > e.ctime)
	if prev == nil {
		return "new, " + after
	}
	atime := rel(e.atime, prev.atime)
	switch e.mode & unix.S_IFMT {
	case unix.S_IFLNK: // intendedDiffs "symlink-atime"
		atime = "not compared"
	case unix.S_IFDIR: // intendedDiffs "dir-atime"
		atime = "not compared"
	case unix.S_IFREG:
		if noFileAtime {
			atime = "not compared"
		}
	}
	return fmt.Sprintf("atime %s, mtime %s, ctime %s than the step before; %s",
		atime, rel(e.mtime, prev.mtime), rel(e.ctime, prev.ctime), after)
}

// compareTrees returns the first difference between the tmpfs tree and
// the tensorfs tree in cur, times by their order against prev (regular
// files' atimes not when noFileAtime).
func compareTrees(prev, cur [2]map[string]oracleEntry, noFileAtime bool) *oracleDiff {
	var paths []string
	for p := range cur[0] {
		paths = append(paths, p)
	}
	for p := range cur[1] {
		if _, ok := cur[0][p]; !ok {
			paths = append(paths, p)
		}
	}
	slices.Sort(paths)
	for _, p := range paths {
		a, aok := cur[0][p]
		b, bok := cur[1][p]
		if !aok || !bok {
			return &oracleDiff{kind: "presence", text: fmt.Sprintf("%s: on tmpfs %v, on tensorfs %v", p, aok, bok)}
		}
		da, db := a.describe(), b.describe()
		for i := range da {
			if da[i] != db[i] {
				kind, _, _ := strings.Cut(da[i], " ")
				return &oracleDiff{kind: kind, text: fmt.Sprintf("%s: tmpfs %s, tensorfs %s", p, da[i], db[i])}
			}
		}
		pa, pb := sameObject(prev[0], a), sameObject(prev[1], b)
		if ta, tb := timeOrder(pa, a, noFileAtime), timeOrder(pb, b, noFileAtime); ta != tb {
			return &oracleDiff{kind: "times", text: fmt.Sprintf("%s: tmpfs %s; tensorfs %s", p, ta, tb)}
		}
	}
	return nil
}

// sameObject returns the entry of tree that is e's object (its inode),
// or nil: a rename moves an object's times with it.
func sameObject(tree map[string]oracleEntry, e oracleEntry) *oracleEntry {
	for _, p := range tree {
		if p.ino == e.ino {
			return &p
		}
	}
	return nil
}

// nextTick waits for the coarse clock, which gives atimes (and times
// nobody read since they last changed) their value, to move on: a time
// a step sets is then later than every one before it, on both trees.
func nextTick() {
	var start, now unix.Timespec
	unix.ClockGettime(unix.CLOCK_REALTIME_COARSE, &start)
	for now = start; now == start; unix.ClockGettime(unix.CLOCK_REALTIME_COARSE, &now) {
		time.Sleep(100 * time.Microsecond)
	}
}

// report shrinks the failing sequence ops (seed) and fails the test with
// the minimal sequence, the difference and how to run it again.
func (o *oracle) report(seed int64, ops []oracleOp, d *oracleDiff) {
	t := o.t
	t.Logf("seed %d: %s differs after step %d (%s); shrinking", seed, d.kind, d.step, d.text)
	kept, md := o.shrink(ops[:d.step+1], d)
	var b strings.Builder
	for i, op := range kept {
		fmt.Fprintf(&b, "  %2d  %s\n", i, op)
	}
	t.Errorf("POSIX oracle, %s mode, seed %d: %s differs from tmpfs after step %d of this sequence (%d of %d operations kept):\n%s"+
		"  after step %d: %s\nrun it again: make oracle SEED=%d OPS=%d (or TENSORFS_ORACLE_SEED=%d TENSORFS_ORACLE_OPS=%d "+
		"go test -count=1 -run 'TestPosixOracle/%s' ./integration/)",
		o.mode, seed, md.kind, md.step, len(kept), len(ops), b.String(), md.step, md.text,
		seed, len(ops), seed, len(ops), o.mode)
}

// shrink drops operations from ops while the same kind of difference
// persists (delta debugging, ddmin), for at most oracleShrink, and
// returns the smallest sequence found and its difference.
func (o *oracle) shrink(ops []oracleOp, d *oracleDiff) ([]oracleOp, *oracleDiff) {
	deadline := time.Now().Add(oracleShrink)
	fails := func(cand []oracleOp) *oracleDiff {
		if nd := o.replay(cand); nd != nil && nd.kind == d.kind {
			return nd
		}
		return nil
	}
	n := 2
	for len(ops) >= 2 && time.Now().Before(deadline) {
		chunk := (len(ops) + n - 1) / n
		reduced := false
		for start := 0; start < len(ops) && time.Now().Before(deadline); start += chunk {
			cand := slices.Concat(ops[:start], ops[min(start+chunk, len(ops)):])
			if nd := fails(cand); nd != nil {
				ops, d = cand[:nd.step+1], nd
				n = max(n-1, 2)
				reduced = true
				break
			}
		}
		if !reduced {
			if n >= len(ops) {
				break
			}
			n = min(2*n, len(ops))
		}
	}
	return ops, d
}

// Pools the generator draws from: a few names in a small tree, so that
// operations collide.
var (
	oracleDirs    = []string{"", "g", "s", "h", "sub", "g/sub", "s/sub", "a"}
	oracleNames   = []string{"a", "b", "f", "x", "l", "sub"}
	oracleTargets = []string{"f", "a", "b", "sub", "sub/a", "l", "../f", "../t/g", "x/.."}
	oracleModes   = []uint32{0, 0o644, 0o600, 0o755, 0o777, 0o666, 0o2775, 0o2755, 0o2644, 0o4755, 0o6777, 0o1777, 0o3775, 0o640, 0o7777}
	oracleUids    = []int{-1, 0, 1000, 1001, 1002, 1004, 65534}
	oracleGids    = []int{-1, 0, 3000, 3001, 1002, 1004, 65534}
	oracleSizes   = []int64{0, 1, 5, 100, 4096, 5000, 65539}
	oracleTimes   = []int64{utimeNow, utimeNow, utimeOmit, 1_000_000_000_123_456_789, 1_500_000_000_000_000_000, 2_000_000_000_999_999_999}
	oracleXNames  = []string{"user.a", "user.b", "user.c"}
	oracleXValues = []string{"", "1", "two", strings.Repeat("x", 100)}
)

// oracleWeights: how often each operation is drawn.
var oracleWeights = []struct {
	op string
	w  int
}{
	{"open", 14}, {"tmpfile", 3}, {"close", 4}, {"read", 4}, {"write", 6}, {"ftruncate", 3},
	{"fallocate", 2}, {"fchmod", 2}, {"linkat", 3}, {"mkdir", 6}, {"mknod", 3}, {"symlink", 4},
	{"link", 4}, {"rename", 8}, {"unlink", 6}, {"rmdir", 3}, {"chmod", 7}, {"chown", 6},
	{"truncate", 4}, {"utimens", 4}, {"setxattr", 5}, {"getxattr", 3}, {"listxattr", 2},
	{"removexattr", 3},
}

// genOracleOps returns the n operations of seed's sequence.
func genOracleOps(seed int64, n int) []oracleOp {
	r := rand.New(rand.NewSource(seed))
	total := 0
	for _, w := range oracleWeights {
		total += w.w
	}
	ops := make([]oracleOp, n)
	for i := range ops {
		k := r.Intn(total)
		name := ""
		for _, w := range oracleWeights {
			if k < w.w {
				name = w.op
				break
			}
			k -= w.w
		}
		ops[i] = genOracleOp(r, name)
	}
	return ops
}

// genOracleOp draws the arguments of one operation called name.
func genOracleOp(r *rand.Rand, name string) oracleOp {
	pick := func(n int) int { return r.Intn(n) }
	chance := func(p float64) bool { return r.Float64() < p }
	path := func() string {
		return filepath.Join(oracleDirs[pick(len(oracleDirs))], oracleNames[pick(len(oracleNames))])
	}
	mode := func() uint32 {
		if chance(0.2) {
			return uint32(pick(0o10000))
		}
		return oracleModes[pick(len(oracleModes))]
	}
	op := oracleOp{Caller: pick(len(oracleCallers)), Op: name, Slot: pick(oracleSlots)}
	switch name {
	case "open":
		op.Path, op.Mode = path(), mode()
		op.Flags = []int{unix.O_RDONLY, unix.O_WRONLY, unix.O_RDWR}[pick(3)]
		for _, f := range []struct {
			flag int
			p    float64
		}{{unix.O_CREAT, 0.5}, {unix.O_EXCL, 0.2}, {unix.O_TRUNC, 0.2}, {unix.O_APPEND, 0.15},
			{unix.O_DIRECTORY, 0.1}, {unix.O_NOFOLLOW, 0.15}} {
			if chance(f.p) {
				op.Flags |= f.flag
			}
		}
	case "tmpfile":
		op.Path, op.Mode = oracleDirs[pick(len(oracleDirs))], mode()
		op.Flags = []int{unix.O_WRONLY, unix.O_RDWR, unix.O_RDWR | unix.O_EXCL}[pick(3)]
	case "read":
		op.Size, op.Off = int64(1+pick(64)), int64(pick(100))
		if chance(0.5) {
			op.Off = -1
		}
	case "write":
		op.Data, op.Off = strings.Repeat(string(rune('a'+pick(26))), 1+pick(20)), int64(pick(5000))
		if chance(0.5) {
			op.Off = -1
		}
	case "ftruncate":
		op.Size = oracleSizes[pick(len(oracleSizes))]
	case "truncate":
		op.Path, op.Size = path(), oracleSizes[pick(len(oracleSizes))]
	case "fallocate":
		op.Flags = []int{0, unix.FALLOC_FL_KEEP_SIZE, unix.FALLOC_FL_PUNCH_HOLE | unix.FALLOC_FL_KEEP_SIZE, unix.FALLOC_FL_ZERO_RANGE}[pick(4)]
		op.Off, op.Size = int64(pick(5000)), int64(1+pick(70000))
	case "fchmod":
		op.Mode = mode()
	case "linkat", "unlink", "rmdir", "listxattr":
		op.Path = path()
	case "mkdir", "chmod":
		op.Path, op.Mode = path(), mode()
	case "mknod":
		op.Path = path()
		kinds := []uint32{unix.S_IFIFO, unix.S_IFSOCK, unix.S_IFCHR, unix.S_IFREG}
		op.Mode = kinds[pick(len(kinds))] | mode()
		if op.Mode&unix.S_IFMT == unix.S_IFCHR {
			op.Dev = unix.Mkdev(1, 3)
		}
	case "symlink":
		op.Path, op.Data = path(), oracleTargets[pick(len(oracleTargets))]
	case "link":
		op.Path, op.Path2 = path(), path()
	case "rename":
		op.Path, op.Path2 = path(), path()
		op.Flags = []int{0, 0, 0, unix.RENAME_NOREPLACE, unix.RENAME_EXCHANGE}[pick(5)]
	case "chown":
		op.Path, op.Uid, op.Gid = path(), oracleUids[pick(len(oracleUids))], oracleGids[pick(len(oracleGids))]
		if chance(0.3) {
			op.Flags = unix.AT_SYMLINK_NOFOLLOW
		}
	case "utimens":
		op.Path = path()
		op.Atime, op.Mtime = oracleTimes[pick(len(oracleTimes))], oracleTimes[pick(len(oracleTimes))]
		if chance(0.3) {
			op.Flags = unix.AT_SYMLINK_NOFOLLOW
		}
	case "setxattr":
		op.Path, op.Name, op.Data = path(), oracleXNames[pick(len(oracleXNames))], oracleXValues[pick(len(oracleXValues))]
		op.Flags = []int{0, 0, unix.XATTR_CREATE, unix.XATTR_REPLACE}[pick(4)]
		if chance(0.3) {
			op.Flags |= oracleNofollow
		}
	case "getxattr", "removexattr":
		op.Path, op.Name = path(), oracleXNames[pick(len(oracleXNames))]
	}
	return op
}

// String writes op as a call a reader can follow: "alice: open(g/a, O_WRONLY|O_CREAT, 0644) -> slot 1".
func (op oracleOp) String() string {
	who := oracleCallers[op.Caller].Name + ": "
	slot := fmt.Sprintf("slot %d", op.Slot)
	mode := fmt.Sprintf("%#o", op.Mode)
	switch op.Op {
	case "open", "tmpfile":
		return fmt.Sprintf("%s%s(%s, %s, %s) -> %s", who, op.Op, op.Path, openFlagNames(op.Flags), mode, slot)
	case "close":
		return who + "close(" + slot + ")"
	case "read", "write":
		return fmt.Sprintf("%s%s(%s, off %d, %d bytes %q)", who, op.Op, slot, op.Off, op.Size, op.Data)
	case "ftruncate":
		return fmt.Sprintf("%sftruncate(%s, %d)", who, slot, op.Size)
	case "fallocate":
		return fmt.Sprintf("%sfallocate(%s, mode %#x, off %d, len %d)", who, slot, op.Flags, op.Off, op.Size)
	case "fchmod":
		return fmt.Sprintf("%sfchmod(%s, %s)", who, slot, mode)
	case "linkat":
		return fmt.Sprintf("%slinkat(/proc/self/fd of %s, %s, AT_SYMLINK_FOLLOW)", who, slot, op.Path)
	case "mknod":
		return fmt.Sprintf("%smknod(%s, %s, dev %#x)", who, op.Path, mode, op.Dev)
	case "symlink":
		return fmt.Sprintf("%ssymlink(%q, %s)", who, op.Data, op.Path)
	case "link", "rename":
		return fmt.Sprintf("%s%s(%s, %s, flags %#x)", who, op.Op, op.Path, op.Path2, op.Flags)
	case "chown":
		return fmt.Sprintf("%schown(%s, %d, %d, flags %#x)", who, op.Path, op.Uid, op.Gid, op.Flags)
	case "truncate":
		return fmt.Sprintf("%struncate(%s, %d)", who, op.Path, op.Size)
	case "utimens":
		return fmt.Sprintf("%sutimensat(%s, atime %s, mtime %s, flags %#x)", who, op.Path, utimeName(op.Atime), utimeName(op.Mtime), op.Flags)
	case "setxattr":
		return fmt.Sprintf("%ssetxattr(%s, %s, %q, flags %#x)", who, op.Path, op.Name, op.Data, op.Flags)
	case "getxattr", "removexattr":
		return fmt.Sprintf("%s%s(%s, %s)", who, op.Op, op.Path, op.Name)
	}
	return fmt.Sprintf("%s%s(%s, %s)", who, op.Op, op.Path, mode) // mkdir, chmod, unlink, rmdir, listxattr
}

// utimeName spells an oracleOp time.
func utimeName(ns int64) string {
	switch ns {
	case utimeNow:
		return "UTIME_NOW"
	case utimeOmit:
		return "UTIME_OMIT"
	}
	return time.Unix(0, ns).UTC().Format(time.RFC3339Nano)
}

// openFlagNames spells open flags: "O_WRONLY|O_CREAT".
func openFlagNames(flags int) string {
	names := []string{[]string{"O_RDONLY", "O_WRONLY", "O_RDWR", "O_ACCMODE"}[flags&unix.O_ACCMODE]}
	for _, f := range []struct {
		flag int
		name string
	}{{unix.O_CREAT, "O_CREAT"}, {unix.O_EXCL, "O_EXCL"}, {unix.O_TRUNC, "O_TRUNC"}, {unix.O_APPEND, "O_APPEND"},
		{unix.O_DIRECTORY, "O_DIRECTORY"}, {unix.O_NOFOLLOW, "O_NOFOLLOW"}} {
		if flags&f.flag != 0 {
			names = append(names, f.name)
		}
	}
	return strings.Join(names, "|")
}
