package fs

// Mappings are references (DESIGN.md §4). In passthrough mode the kernel
// maps the backing file itself and releases the FUSE handle at close(),
// so a mapping that outlives its descriptor is known only to
// /proc/PID/maps, which shows it as the mount's file (the file the user
// opened), and a mapping of the backing file outside the mount as the
// backing file. The rule: each process counts its open handles, or 1 if
// it holds none but maps the segment's pages (however many regions);
// refcount is the sum over processes, holders lists each with its count.
// A process that maps and holds a handle counts its handles alone, as in
// classic mode, where a mapping through the mount keeps its handle open.

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/procfs"
)

// mapsTTL is how long after a scan of every process's mappings ends it
// answers refcount and holders for all segments (as long as it began late
// enough for the question). Scans cost in proportion to the machine's
// mappings, so this bounds their share of the daemon's time.
const mapsTTL = 100 * time.Millisecond

// anyAge accepts a scan however long ago it ended.
const anyAge = time.Duration(1<<63 - 1)

// epoch is when the daemon started; node.released counts from it.
var epoch = time.Now()

// fileID names a file as /proc/PID/maps does: device and inode.
type fileID struct{ dev, ino uint64 }

// mapTable indexes which processes map which files, on the devices that
// segments asked about. One scan of /proc runs at a time and answers
// every question it is recent enough for.
type mapTable struct {
	mu         sync.Mutex // protects what follows and serialises scans
	devs       map[uint64]bool
	start, end time.Time // of the last scan; zero: none is valid
	pids       map[fileID][]uint32
	// unseen says why the last scan could not read every process's
	// mappings (nil: it read them all). Its answers are then only what it
	// saw: no question is answered "unmapped" from it.
	unseen error
	// leased says why the last scan left out a process whose maps its
	// owner leases: a removal waits on it as on unseen, but a count of
	// holders leaves it out, as its owner chose (mappers, holdersOf).
	leased error
	// noQuery is set once the kernel turns PROCMAP_QUERY down.
	noQuery bool
	buf     []byte // one /proc/PID/maps
}

// mappedFile is a file whose mappings map a segment's pages, and the only
// uid whose processes count through it (anyUID: every process's).
type mappedFile struct {
	id  fileID
	uid uint32
}

// everyone makes mapped files of ids that every process's mappings count
// through.
func everyone(ids ...fileID) []mappedFile {
	files := make([]mappedFile, len(ids))
	for i, id := range ids {
		files[i] = mappedFile{id, anyUID}
	}
	return files
}

// mappers returns the processes, the daemon excepted, that map any of
// files (as its uid allows), from a scan that began at or after since and
// ended at most maxAge ago. When the scan could not read every process's
// mappings it also returns why (an error wrapping EAGAIN): the processes
// it found map files, and others may.
func (t *mapTable) mappers(files []mappedFile, since time.Time, maxAge time.Duration) (map[uint32]bool, error) {
	pids, unseen, leased := t.find(files, since, maxAge)
	return pids, cmp.Or(unseen, leased)
}

// holdersOf is mappers for a count of holders: a process whose owner
// leases its maps is left out (that owner hides only its own processes),
// and only what the scan could not see otherwise makes it no answer.
func (t *mapTable) holdersOf(files []mappedFile, since time.Time, maxAge time.Duration) (map[uint32]bool, error) {
	pids, unseen, _ := t.find(files, since, maxAge)
	return pids, unseen
}

// find is mappers, with the scan's unseen and leased apart.
func (t *mapTable) find(files []mappedFile, since time.Time, maxAge time.Duration) (pids map[uint32]bool, unseen, leased error) {
	pids = map[uint32]bool{}
	if len(files) == 0 {
		return pids, nil, nil
	}
	ids := make([]fileID, len(files))
	for i, f := range files {
		ids[i] = f.id
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.fresh(ids, since, maxAge)
	for _, f := range files {
		for _, pid := range t.pids[f.id] {
			if f.uid == anyUID || processUID(pid) == f.uid {
				pids[pid] = true
			}
		}
	}
	return pids, t.unseen, t.leased
}

// processUID returns the effective uid of process pid (the owner of its
// /proc directory); anyUID once it has exited.
func processUID(pid uint32) uint32 {
	var st unix.Stat_t
	if unix.Stat("/proc/"+strconv.Itoa(int(pid)), &st) != nil {
		return anyUID
	}
	return st.Uid
}

// mapsDev reports whether a process maps a file of device dev, or may:
// true when the scan could not read every process's mappings.
func (t *mapTable) mapsDev(dev uint64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.fresh([]fileID{{dev: dev}}, time.Time{}, anyAge)
	if t.unseen != nil || t.leased != nil {
		return true
	}
	for id := range t.pids {
		if id.dev == dev {
			return true
		}
	}
	return false
}

// fresh scans again, t.mu held, unless the last scan covers the devices
// of ids, began at or after since and ended at most maxAge ago.
func (t *mapTable) fresh(ids []fileID, since time.Time, maxAge time.Duration) {
	if t.devs == nil {
		t.devs = map[uint64]bool{}
	}
	for _, id := range ids {
		if !t.devs[id.dev] {
			t.devs[id.dev] = true
			t.start = time.Time{}
		}
	}
	if t.start.IsZero() || t.start.Before(since) || time.Since(t.end) > maxAge {
		t.scan()
	}
}

// scan indexes the mappings of every process but this one on t.devs.
// Processes that exited meanwhile (every thread: processMaps) are left out, and so are those whose
// maps the daemon may not read (leftOut). Any other failure (no
// descriptor left, a lease in the way, an error of the kernel) sets
// t.unseen: the scan saw only part of the machine.
func (t *mapTable) scan() {
	t.start = time.Now()
	defer func() { t.end = time.Now() }()
	t.pids = map[fileID][]uint32{}
	t.unseen, t.leased = nil, nil
	d, err := os.Open("/proc")
	var names []string
	if err == nil {
		names, err = d.Readdirnames(-1)
		d.Close()
	}
	if err != nil {
		t.unseen = fmt.Errorf("%w: cannot list the processes: %v", syscall.EAGAIN, err)
		return
	}
	self := os.Getpid()
	for _, name := range names {
		pid, err := strconv.Atoi(name)
		if err != nil || pid == self {
			continue
		}
		err = t.scanProcess(uint32(pid))
		switch {
		case err == nil || leftOut(err):
		case errors.Is(err, unix.EAGAIN): // a lease in the way (O_NONBLOCK)
			if t.leased == nil {
				t.leased = fmt.Errorf("%w: the owner of process %d leases its mappings", syscall.EAGAIN, pid)
			}
		case t.unseen == nil:
			t.unseen = fmt.Errorf("%w: cannot read the mappings of process %d: %v", syscall.EAGAIN, pid, err)
		}
	}
}

// leftOut reports whether err, from reading a process's mappings, says
// that the process has exited, or that the daemon may not read it: one
// that is not root may not read other users' processes (and serves no
// other user), and root, with CAP_SYS_PTRACE, may read every process a
// user can start (dumpable or not, in a user namespace of its own or
// not), so what it may not read is more privileged than the daemon.
func leftOut(err error) bool {
	for _, e := range []error{unix.ENOENT, unix.ESRCH, unix.EACCES, unix.EPERM} {
		if errors.Is(err, e) { // os wraps them (readdirent /proc/PID/task: ...)
			return true
		}
	}
	return false
}

// scanProcess adds the mappings of process pid on t.devs to t.pids.
func (t *mapTable) scanProcess(pid uint32) error {
	return processMaps(pid, func(path string) error { return t.scanMaps(pid, path) })
}

// scanMaps adds the mappings on t.devs that the maps file at path, of
// process pid or one of its threads, shows to t.pids; errNoMemory when
// the thread has no address space.
func (t *mapTable) scanMaps(pid uint32, path string) error {
	// O_NONBLOCK: a process's owner may lease its maps, and the scan must
	// not wait for the lease to break (procfs.ReadFile).
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	add := func(id fileID) {
		if !t.devs[id.dev] {
			return
		}
		// A process's mappings come together: one entry per file.
		if p := t.pids[id]; len(p) == 0 || p[len(p)-1] != pid {
			t.pids[id] = append(p, pid)
		}
	}
	if !t.noQuery {
		switch err = queryMappings(fd, add); err {
		case errNoQuery:
			t.noQuery = true
		case unix.ESRCH:
			return errNoMemory
		default:
			return err
		}
	}
	if err := t.read(fd); err != nil {
		return err
	}
	if len(t.buf) == 0 {
		return errNoMemory
	}
	forEachMapping(t.buf, add)
	return nil
}

// errNoMemory is what a reader of a thread's maps (processMaps) answers
// when the thread has no address space: it exited or is exiting (it let
// go of its address space), or is the kernel's.
var errNoMemory = errors.New("the thread has no address space")

// errNewThreads is processMaps' answer when threads started in a process
// whose leader exited while the daemon read its other threads.
var errNewThreads = errors.New("its leader thread exited, and threads started while the daemon read the others")

// processMaps calls read with the path of the maps of process pid: its
// leader thread's, and while read answers errNoMemory (the leader exited
// alone, a zombie whose maps are empty, and the address space is its
// other threads'), each other thread's. It returns read's first other
// answer; ESRCH when no thread had an address space (the process exited
// or is exiting, or is the kernel's: a thread that lost its address space
// never gets another), unless threads started meanwhile (a thread that
// has one may start them): then errNewThreads, a process not seen.
// The leader's pidfd, too, is readable only once every thread exited.
func processMaps(pid uint32, read func(path string) error) error {
	name := strconv.Itoa(int(pid))
	dir := "/proc/" + name
	if err := read(dir + "/maps"); err != errNoMemory {
		return err
	}
	// The kernel counts 2 links of /proc/PID/task and one per thread: 3
	// is the leader alone (a kernel thread, or a process that exited), at
	// the cost of a stat, not a listing.
	var st unix.Stat_t
	if err := unix.Stat(dir+"/task", &st); err != nil {
		return err
	}
	if st.Nlink == 3 {
		return unix.ESRCH
	}
	tids, err := threads(dir)
	if err != nil {
		return err
	}
	if len(tids) < 2 { // the leader alone, which starts no thread
		return unix.ESRCH
	}
	for tid := range tids {
		if tid == name {
			continue
		}
		err := read(dir + "/task/" + tid + "/maps")
		if err != errNoMemory && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ESRCH) {
			return err
		}
	}
	now, err := threads(dir)
	if err != nil {
		return err
	}
	for tid := range now {
		if !tids[tid] {
			return errNewThreads
		}
	}
	return unix.ESRCH
}

// threads returns the thread ids of the process whose /proc directory is
// dir.
func threads(dir string) (map[string]bool, error) {
	d, err := os.Open(dir + "/task")
	if err != nil {
		return nil, err
	}
	defer d.Close()
	names, err := d.Readdirnames(-1)
	if err != nil {
		return nil, err
	}
	tids := make(map[string]bool, len(names))
	for _, n := range names {
		tids[n] = true
	}
	return tids, nil
}

// procmapQuery is the kernel's struct procmap_query (linux/fs.h).
type procmapQuery struct {
	size, flags, addr, start, end, vmaFlags, pageSize, offset, inode uint64
	major, minor, nameSize, buildIDSize                              uint32
	nameAddr, buildIDAddr                                            uint64
}

const (
	procmapQueryIoctl     = 0xc0686611 // PROCMAP_QUERY: _IOWR('f', 17, struct procmap_query)
	procmapCoveringOrNext = 0x10
	procmapFileBacked     = 0x20
)

// errNoQuery is queryMappings' answer where the kernel has no
// PROCMAP_QUERY.
var errNoQuery = errors.New("no PROCMAP_QUERY")

// queryMappings calls fn with the file of every file-backed mapping of
// the process whose /proc/PID/maps is open at fd, asking the kernel one
// mapping at a time (PROCMAP_QUERY, Linux 6.11): no text to make and
// parse, anonymous mappings skipped. It returns errNoQuery where the
// kernel has no such request, ESRCH once the process exited, and the
// kernel's error when it could not answer.
func queryMappings(fd int, fn func(fileID)) error {
	var q procmapQuery
	for addr := uint64(0); ; addr = q.end {
		q = procmapQuery{size: uint64(unsafe.Sizeof(q)), flags: procmapCoveringOrNext | procmapFileBacked, addr: addr}
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), procmapQueryIoctl, uintptr(unsafe.Pointer(&q)))
		switch {
		case errno == 0:
			fn(fileID{unix.Mkdev(q.major, q.minor), q.inode})
		case (errno == unix.ENOTTY || errno == unix.EINVAL) && addr == 0:
			return errNoQuery
		case errno == unix.ENOENT: // no mapping past addr
			return nil
		default:
			return errno
		}
	}
}

// read reads the text of the /proc/PID/maps open at fd into t.buf.
func (t *mapTable) read(fd int) error {
	t.buf = t.buf[:0]
	for {
		t.buf = slices.Grow(t.buf, 64<<10)
		n, err := unix.Read(fd, t.buf[len(t.buf):cap(t.buf)])
		switch {
		case err == unix.EINTR:
		case err != nil:
			return err
		case n == 0:
			return nil
		default:
			t.buf = t.buf[:len(t.buf)+n]
		}
	}
}

// forEachMapping calls fn with the file of every file-backed line of a
// /proc/PID/maps text.
func forEachMapping(b []byte, fn func(fileID)) {
	for len(b) > 0 {
		line := b
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			line, b = b[:i], b[i+1:]
		} else {
			b = nil
		}
		if id, ok := parseMapsLine(line); ok {
			fn(id)
		}
	}
}

// parseMapsLine returns the file of one line of /proc/PID/maps,
// "START-END PERMS OFFSET MAJOR:MINOR INODE [PATH]" (hexadecimal device
// numbers, decimal inode); ok is false for an anonymous mapping (inode 0)
// and for a line of another form.
func parseMapsLine(line []byte) (id fileID, ok bool) {
	for range 3 { // the address range, permissions and offset
		i := bytes.IndexByte(line, ' ')
		if i < 0 {
			return id, false
		}
		line = line[i+1:]
	}
	dev, rest, _ := bytes.Cut(line, []byte{' '})
	ino, _, _ := bytes.Cut(rest, []byte{' '})
	major, minor, _ := bytes.Cut(dev, []byte{':'})
	ma, ok1 := parseUint(major, 16, 1<<32-1)
	mi, ok2 := parseUint(minor, 16, 1<<32-1)
	in, ok3 := parseUint(ino, 10, 1<<64-1)
	if !ok1 || !ok2 || !ok3 || in == 0 {
		return id, false
	}
	return fileID{unix.Mkdev(uint32(ma), uint32(mi)), in}, true
}

// parseUint parses lower-case digits of base 8, 10 or 16 into a value no
// greater than limit.
func parseUint(b []byte, base, limit uint64) (uint64, bool) {
	if len(b) == 0 {
		return 0, false
	}
	var v uint64
	for _, c := range b {
		var d uint64
		switch {
		case '0' <= c && c <= '9' && uint64(c-'0') < base:
			d = uint64(c - '0')
		case base == 16 && 'a' <= c && c <= 'f':
			d = uint64(c-'a') + 10
		default:
			return 0, false
		}
		if v > (limit-d)/base {
			return 0, false
		}
		v = v*base + d
	}
	return v, true
}

// mapped returns the files whose mappings map n's pages: n on this mount
// and on earlier passthrough mounts of the backing that live mappings
// outlived (a mapping through the mount shows as the mount's file), and
// the file its kind keeps its bytes in outside the mount (a mapping
// through the handle path or a descriptor the daemon handed out). A
// device segment's kind has no such file, and mmap of it is ENODEV.
func (n *segmentNode) mapped() []mappedFile {
	s := n.storage()
	ino := n.StableAttr().Ino
	files := everyone(fileID{n.fs.fuseDev.Load(), ino})
	for _, dev := range n.fs.oldDevs {
		files = append(files, mappedFile{fileID{dev, ino}, anyUID})
	}
	n.withMarker(func(m *alloc.Ref) error {
		if id, uid, ok := s.mapped(m); ok {
			files = append(files, mappedFile{id, uid})
		}
		return nil
	})
	return files
}

// since is when a scan must have begun to answer for n: after n's last
// handle release, the moment a mapping may have become its process's
// only reference.
func (n *segmentNode) since() time.Time {
	return epoch.Add(time.Duration(n.released.Load()))
}

// references returns the references each process holds to n: its open
// handles, or 1 for a process that holds none but maps n's pages. When
// the daemon could not read every process's mappings it returns why
// instead (an error wrapping EAGAIN): a count it could not see whole is
// no answer.
func (n *segmentNode) references() (map[uint32]int, error) {
	refs := n.openHandles()
	pids, err := n.fs.maps.holdersOf(n.mapped(), n.since(), mapsTTL)
	if err != nil {
		return nil, err
	}
	for pid := range pids {
		if refs[pid] == 0 {
			refs[pid] = 1
		}
	}
	return refs, nil
}

// watchMapped reports whether processes still map segment n, whose last
// handle uid released, or may (the daemon could not see them all), and if
// so waits for them in a watch charged to uid, which calls done after
// (watching: whether that watch could start). An open
// meanwhile stops the watch: acquire adds its handle, then unwatches.
func (fsys *filesystem) watchMapped(n *segmentNode, uid uint32, done func()) (mapped, watching bool) {
	ids, since := n.mapped(), n.since()
	if pids, err := fsys.maps.mappers(ids, since, mapsTTL); len(pids) == 0 && err == nil {
		return false, false
	}
	watching = fsys.watch(n.StableAttr().Ino, ids, since, uid, done)
	if len(n.openHandles()) > 0 {
		fsys.watches.unwatch(n.StableAttr().Ino)
	}
	return true, watching
}

// watchSet holds the watches: one goroutine per UNLINK segment that no
// handle holds and processes still map, waiting for the last mapping.
type watchSet struct {
	mu sync.Mutex // protects m and closed
	// m holds each watch's epoll instance, by the segment's inode.
	m      map[uint64]*os.File
	closed bool
	wg     sync.WaitGroup
}

// watch starts waiting for the last mapping of ids to go (awaitUnmapped),
// then calls done (which removes the UNLINK segment whose backing inode is
// ino, or gives back the inode of a segment whose names are gone); at
// most one watch per segment. Reopening or unlinking the segment stops it
// (unwatch). A watch holds its epoll instance, so it takes one of uid's
// descriptors (filesystem.handles) until it ends; past uid's share the
// segment stays until it is opened and closed again, or the next mount.
// The pidfds it waits on are the processes' owners' (pidfds). It reports
// whether a watch waits now.
func (fsys *filesystem) watch(ino uint64, ids []mappedFile, since time.Time, uid uint32, done func()) bool {
	w := &fsys.watches
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return false
	}
	if w.m[ino] != nil {
		return true // one watch waits already
	}
	if err := fsys.handles.Take(uid, 1); err != nil {
		fsys.log.Warn("cannot wait for the mappings of a segment; an UNLINK one stays until it is opened and closed again, or the next mount", "ino", ino, "err", err)
		return false
	}
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err == nil {
		if err = unix.SetNonblock(ep, true); err != nil { // so that Go's poller waits on it
			unix.Close(ep)
		}
	}
	if err != nil {
		fsys.handles.Give(uid, 1)
		fsys.log.Warn("cannot wait for the mappings of a segment; an UNLINK one stays until it is opened and closed again, or the next mount", "ino", ino, "err", err)
		return false
	}
	f := os.NewFile(uintptr(ep), "pidfds")
	if w.m == nil {
		w.m = map[uint64]*os.File{}
	}
	w.m[ino] = f
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		defer fsys.handles.Give(uid, 1)
		unmapped := fsys.awaitUnmapped(f, ids, since)
		if w.end(ino, f) && unmapped {
			done()
		}
	}()
	return true
}

// unwatch stops the watch of the segment whose inode is ino, if any.
func (w *watchSet) unwatch(ino uint64) {
	w.mu.Lock()
	f := w.m[ino]
	delete(w.m, ino)
	w.mu.Unlock()
	if f != nil {
		f.Close()
	}
}

// end forgets f, the watch of ino, and closes it; false when it was
// stopped already.
func (w *watchSet) end(ino uint64, f *os.File) bool {
	w.mu.Lock()
	ok := w.m[ino] == f
	if ok {
		delete(w.m, ino)
	}
	w.mu.Unlock()
	f.Close()
	return ok
}

// close stops every watch, waits for them to return, and starts no more.
func (w *watchSet) close() {
	w.mu.Lock()
	m := w.m
	w.m, w.closed = nil, true
	w.mu.Unlock()
	for _, f := range m {
		f.Close()
	}
	w.wg.Wait()
}

// awaitUnmapped waits until no process maps ids and reports true, or
// until ep, an epoll instance, is closed (false); its first check takes a
// scan begun at or after since. It waits on the mapping processes'
// pidfds (fsys.pidfds, shared with every other watch) for their exits,
// and for munmap, and for the exits of processes whose owners are at
// their bound of descriptors (polled: no pidfd), checks again after
// 10 ms, doubling up to 1 s. A check that could not see every process
// is no answer: it waits and checks again. A check takes any scan begun
// since the last one, however old, so that the watches of many segments
// share scans.
func (fsys *filesystem) awaitUnmapped(ep *os.File, ids []mappedFile, since time.Time) bool {
	rc, err := ep.SyscallConn()
	if err != nil {
		return false
	}
	w := pidWatch{fsys: fsys, rc: rc, fds: map[uint32]int{}, none: map[uint32]bool{}}
	defer w.releaseAll()
	events := make([]unix.EpollEvent, 8)
	delay := 10 * time.Millisecond
	for {
		pids, unseen := fsys.maps.mappers(ids, since, anyAge)
		if len(pids) == 0 && unseen == nil {
			return true
		}
		if !w.follow(pids) {
			return false
		}
		since = time.Now()
		if ep.SetReadDeadline(since.Add(delay)) != nil {
			return false
		}
		n := 0
		err := rc.Read(func(e uintptr) bool {
			n, _ = unix.EpollWait(int(e), events, 0)
			return n > 0
		})
		switch {
		case errors.Is(err, os.ErrDeadlineExceeded):
			delay = min(2*delay, time.Second)
			continue
		case err != nil:
			return false
		}
		since = time.Now() // processes exited: see them gone
		for _, ev := range events[:n] {
			w.exited(int(ev.Fd))
		}
	}
}

// unlinkBatch gathers the UNLINK segments whose last mapping went, so
// that one walk of the backing removes all that went meanwhile, not one
// walk each.
type unlinkBatch struct {
	mu      sync.Mutex // protects pending and walking
	pending map[uint64]bool
	walking bool
}

// removeUnlinked removes every name of the UNLINK segment whose backing
// inode is ino, found by a walk of the backing (the kernel may have
// forgotten the node, and after recovery there is none), and tells the
// kernel. A walk under way takes ino into its next round, so that
// segments whose mappings go together cost a walk or two, whatever their
// number (a walk each made it quadratic).
func (fsys *filesystem) removeUnlinked(ino uint64) {
	b := &fsys.unlinked
	b.mu.Lock()
	if b.pending == nil {
		b.pending = map[uint64]bool{}
	}
	b.pending[ino] = true
	if b.walking {
		b.mu.Unlock()
		return
	}
	b.walking = true
	for {
		inos := b.pending
		b.pending = map[uint64]bool{}
		if len(inos) == 0 {
			b.walking = false
			b.mu.Unlock()
			return
		}
		b.mu.Unlock()
		fsys.removeUnlinkedNames(inos)
		b.mu.Lock()
	}
}

// removeUnlinkedNames is one walk of removeUnlinked, for the segments
// whose inodes are inos.
func (fsys *filesystem) removeUnlinkedNames(inos map[uint64]bool) {
	alloc.Walk(fsys.store.RootFd, func(dirfd int, name, rel string, st *unix.Stat_t) error {
		if !inos[st.Ino] || st.Mode&syscall.S_IFMT != syscall.S_IFREG {
			return nil
		}
		var f alloc.Flags
		ferr := alloc.At(dirfd, name, st.Ino, func(p string) (err error) {
			f, err = alloc.ReadFlags(p)
			return err
		})
		if ferr != nil || f&alloc.Unlink == 0 {
			return nil
		}
		if !fsys.unlinkUnheld(dirfd, name, st) {
			return nil
		}
		fsys.notifyGone(rel, st.Ino)
		fsys.log.Info("removed UNLINK segment after its last mapping", "name", rel)
		return nil
	})
}

// unlinkUnheld removes name in dirfd, an UNLINK segment whose stat is st
// that nothing holds, and gives back what it held; an import's end waits
// out a handover (imports.handing). It reports whether it removed it.
func (fsys *filesystem) unlinkUnheld(dirfd int, name string, st *unix.Stat_t) bool {
	fsys.imports.handing.RLock()
	defer fsys.imports.handing.RUnlock()
	s, ino, last, err := fsys.lastLink(dirfd, name)
	if err != nil || unix.Unlinkat(dirfd, name, 0) != nil {
		return false
	}
	if last {
		fsys.inodes.gone(ino) // unmapped, and no handle: its watch ended
	} else {
		fsys.inodes.unlinked(ino, st.Uid)
	}
	if s != nil {
		s.release()
	}
	return true
}

// notifyGone drops the name path (relative to the root) of inode ino
// from go-fuse's tree and the kernel's cache, where they have it.
func (fsys *filesystem) notifyGone(path string, ino uint64) {
	dir := fsys.root.EmbeddedInode()
	for {
		part, rest, more := strings.Cut(path, "/")
		if !more {
			if ch := dir.GetChild(part); ch != nil && ch.StableAttr().Ino == ino {
				dir.RmChild(part)
				dir.NotifyDelete(part, ch)
			}
			return
		}
		if dir = dir.GetChild(part); dir == nil {
			return
		}
		path = rest
	}
}

// devsAttr, on the backing root, lists the devices of the passthrough
// mounts of the backing whose mappings may outlive them: such a mapping
// maps the backing file's pages, but /proc shows it as the mount's file,
// and a daemon that crashes leaves it behind.
const devsAttr = "trusted.tensorfs.mapdevs"

// keptFile is an UNLINK segment, of backing inode ino, kept while the
// files ids are mapped.
type keptFile struct {
	ino uint64
	ids []mappedFile
}

// Recovered is what recovery found mapped, for the mount.
type Recovered struct {
	// devs are the devices of earlier mounts that processes still map.
	devs []uint64
	// kept are the UNLINK segments kept because mapped.
	kept []keptFile
	// devices are the backing files of device segments (alloc.Recovery).
	devices []*os.File
	// pulled are the pulled segments (alloc.Recovery).
	pulled []alloc.PulledFile
	// imports are the imports' markers a successor keeps until its
	// predecessor's descriptors arrive, unlinked the UNLINK segments no
	// process maps that it keeps until it knows their handles
	// (alloc.Recovery).
	imports  []alloc.ImportMarker
	unlinked []uint64
}

// Recover prepares store's backing for a mount (alloc.Store.Recover),
// keeping the UNLINK segments that live processes still map, through
// the backing or an earlier passthrough mount of it, and all of them
// while it cannot read every process's mappings (the mount's watches
// remove them once they can).
// The device segments' backing files it found go to the mount, which
// restores them (or, without a GPU, keeps them unavailable). live is the
// device of the mount a successor takes over (0 for none): its mappings
// count although it is mounted, imports' markers are kept for the
// descriptors its predecessor hands over (adoptImports), and UNLINK
// segments for the handles it inherits (settleUnlinked).
func Recover(store *alloc.Store, live uint64) (segments, bytes int64, rec *Recovered, err error) {
	var t mapTable
	old := earlierDevs(store.RootFd, live)
	// A classic mount's device is in no record, and a mapping through it
	// (node IDs are backing inodes) counts while a successor takes it over.
	through := old
	if live != 0 && !slices.Contains(old, live) {
		through = append(slices.Clone(old), live)
	}
	rec = &Recovered{}
	found, err := store.Recover(func(st *unix.Stat_t) bool {
		ids := everyone(fileID{st.Dev, st.Ino})
		for _, dev := range through {
			ids = append(ids, mappedFile{fileID{dev, st.Ino}, anyUID})
		}
		if pids, err := t.mappers(ids, time.Time{}, anyAge); len(pids) == 0 && err == nil {
			return false
		}
		rec.kept = append(rec.kept, keptFile{st.Ino, ids})
		return true
	}, live != 0)
	if err != nil {
		return 0, 0, nil, err
	}
	for _, dev := range old {
		if t.mapsDev(dev) {
			rec.devs = append(rec.devs, dev)
		}
	}
	rec.devices = found.Devices
	rec.pulled = found.Pulled
	rec.imports, rec.unlinked = found.Imports, found.Unlinked
	return found.Segments, found.Bytes, rec, nil
}

// earlierDevs reads devsAttr from the backing root at rootFd, less the
// devices of mounted filesystems but live: those numbers were given again.
func earlierDevs(rootFd int, live uint64) []uint64 {
	buf := make([]byte, 1024)
	n, err := unix.Getxattr(alloc.FdPath(rootFd), devsAttr, buf)
	if err != nil {
		return nil
	}
	mounted := map[uint64]bool{}
	mounts, _ := mountinfo.GetMounts(nil)
	for _, m := range mounts {
		mounted[unix.Mkdev(uint32(m.Major), uint32(m.Minor))] = true
	}
	var devs []uint64
	for _, f := range strings.Fields(string(buf[:n])) {
		if dev, err := strconv.ParseUint(f, 10, 64); err == nil && (!mounted[dev] || dev == live) {
			devs = append(devs, dev)
		}
	}
	return devs
}

// afterMount records which devices map the backing for the next mount
// (devsAttr): those of earlier mounts still mapped and, in passthrough
// mode, this mount's. Then it waits for the last mapping of each UNLINK
// segment that recovery kept.
func (fsys *filesystem) afterMount(mountpoint string, rec *Recovered) {
	var st unix.Stat_t
	if err := unix.Stat(mountpoint, &st); err == nil {
		fsys.fuseDev.Store(st.Dev)
	}
	devs := slices.Clone(fsys.oldDevs)
	if fsys.passthrough.Load() {
		devs = append(devs, st.Dev)
	}
	var v []byte
	for _, dev := range devs {
		v = strconv.AppendUint(append(v, ' '), dev, 10)
	}
	p := alloc.FdPath(fsys.store.RootFd)
	if len(devs) == 0 {
		unix.Removexattr(p, devsAttr) // nothing to record: absent, or not root
	} else if err := unix.Setxattr(p, devsAttr, v, 0); err != nil {
		fsys.log.Warn("cannot record the mount's device: after a crash, the next mount will not see mappings made through this one", "err", err)
	}
	if rec == nil {
		return
	}
	now := time.Now()
	for _, k := range rec.kept {
		fsys.watch(k.ino, k.ids, now, 0, func() { fsys.removeUnlinked(k.ino) }) // the daemon's own: no user released these
	}
}

// writers names the processes, the daemon excepted, that may write the
// segment whose files are files (as mapped returns them) and whose
// backing file is open at fd: those that map it shared and writable, and
// those that hold a descriptor of the backing file open for writing
// (fdinfo's mount and inode). It reads /proc now, without waiting on a
// lease; a process it cannot read is left out, so it only names writers
// that a read lease (noWriter) has said exist.
func writers(files []mappedFile, fd int) []string {
	var self unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_INO|unix.STATX_MNT_ID, &self); err != nil {
		return nil
	}
	want := map[fileID]bool{}
	for _, f := range files {
		want[f.id] = true
	}
	names, _ := os.ReadDir("/proc")
	var found []string
	for _, e := range names {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		dir := "/proc/" + e.Name()
		writable := false
		processMaps(uint32(pid), func(path string) error {
			b, err := procfs.ReadFile(path)
			if err == nil && len(b) == 0 {
				return errNoMemory
			}
			writable = err == nil && mapsWritable(b, want)
			return err
		})
		if writable {
			found = append(found, fmt.Sprintf("pid %d (%s) maps it writable", pid, alloc.Escape(comm(pid))))
		}
		fds, _ := os.ReadDir(dir + "/fd")
		for _, fde := range fds {
			b, err := procfs.ReadFile(dir + "/fdinfo/" + fde.Name())
			if err == nil && fdinfoWrites(b, self.Mnt_id, self.Ino) {
				found = append(found, fmt.Sprintf("pid %d (%s) holds descriptor %s of it open for writing", pid, alloc.Escape(comm(pid)), fde.Name()))
				break
			}
		}
	}
	return found
}

// mapsWritable reports whether a /proc/PID/maps text maps one of want
// shared and writable (permissions "rw-s" or "-w-s").
func mapsWritable(b []byte, want map[fileID]bool) bool {
	for line := range bytes.Lines(b) {
		_, rest, _ := bytes.Cut(line, []byte{' '})
		if len(rest) < 4 || rest[1] != 'w' || rest[3] != 's' {
			continue
		}
		if id, ok := parseMapsLine(bytes.TrimSuffix(line, []byte{'\n'})); ok && want[id] {
			return true
		}
	}
	return false
}

// fdinfoWrites reports whether a /proc/PID/fdinfo/N text is of a
// descriptor of inode ino on mount mnt open for writing.
func fdinfoWrites(b []byte, mnt, ino uint64) bool {
	var flags, gotMnt, gotIno uint64
	var ok [3]bool
	for line := range bytes.Lines(b) {
		k, v, _ := bytes.Cut(bytes.TrimSpace(line), []byte{':'})
		v = bytes.TrimSpace(v)
		switch string(k) {
		case "flags":
			flags, ok[0] = parseUint(v, 8, 1<<32-1)
		case "mnt_id":
			gotMnt, ok[1] = parseUint(v, 10, 1<<64-1)
		case "ino":
			gotIno, ok[2] = parseUint(v, 10, 1<<64-1)
		}
	}
	return ok == [3]bool{true, true, true} && gotMnt == mnt && gotIno == ino && flags&unix.O_ACCMODE != unix.O_RDONLY
}
