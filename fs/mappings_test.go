package fs

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// mapperEnv makes the test binary a mapper child (mapperMain) instead.
const mapperEnv = "TENSORFS_TEST_MAPPER"

// leaderExitsEnv makes a mapper child end its leader thread alone once it
// has mapped its files: its other threads keep the mappings.
const leaderExitsEnv = "TENSORFS_TEST_MAPPER_LEADER_EXITS"

// init keeps the main goroutine of a mapper child whose leader exits on
// the leader thread, so that the thread it ends is the leader.
func init() {
	if os.Getenv(leaderExitsEnv) != "" {
		runtime.LockOSThread()
	}
}

func TestMain(m *testing.M) {
	if path := os.Getenv(mapperEnv); path != "" {
		mapperMain(path)
		return
	}
	os.Exit(m.Run())
}

// mapperMain maps the files at paths (a list separated by ':'), closes
// their descriptors and says "mapped" (with leaderExitsEnv, once its
// leader thread is a zombie); then each line on stdin unmaps them
// ("unmapped") until EOF.
func mapperMain(paths string) {
	var maps [][]byte
	for _, path := range filepath.SplitList(paths) {
		fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			panic(err)
		}
		b, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			panic(err)
		}
		unix.Close(fd)
		maps = append(maps, b)
	}
	if os.Getenv(leaderExitsEnv) == "" {
		serveMapper(maps)
		return
	}
	go func() {
		for !strings.Contains(readProc("/proc/self/stat"), ") Z ") {
			time.Sleep(time.Millisecond)
		}
		serveMapper(maps)
		os.Exit(0)
	}()
	syscall.Syscall(unix.SYS_EXIT, 0, 0, 0) // this thread only: the leader (init)
}

// serveMapper says "mapped", then unmaps maps at each line on stdin
// ("unmapped") until EOF.
func serveMapper(maps [][]byte) {
	fmt.Println("mapped")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		for _, b := range maps {
			unix.Munmap(b)
		}
		fmt.Println("unmapped")
	}
}

// readProc returns the text of a file of /proc ("" when unreadable).
func readProc(path string) string {
	b, _ := os.ReadFile(path)
	return string(b)
}

// mapper is a child process that maps a file.
type mapper struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Scanner
}

// startMapper starts a child that maps the files at path (several
// separated by ':') with their descriptors closed, with env added to its
// environment; the cleanup ends it.
func startMapper(t *testing.T, path string, env ...string) *mapper {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(append(os.Environ(), mapperEnv+"="+path), env...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	m := &mapper{cmd: cmd, stdin: stdin, out: bufio.NewScanner(stdout)}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	m.expect(t, "mapped")
	return m
}

func (m *mapper) expect(t *testing.T, want string) {
	t.Helper()
	if !m.out.Scan() || m.out.Text() != want {
		t.Fatalf("mapper said %q (%v), want %q", m.out.Text(), m.out.Err(), want)
	}
}

// unmap makes the child unmap the file and stay alive.
func (m *mapper) unmap(t *testing.T) {
	t.Helper()
	io.WriteString(m.stdin, "unmap\n")
	m.expect(t, "unmapped")
}

// mappedTestFile makes a 4 KiB file and returns its path and identity.
func mappedTestFile(t *testing.T) (string, fileID) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "seg")
	if err := os.WriteFile(path, make([]byte, 4096), 0o600); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return path, fileID{st.Dev, st.Ino}
}

func TestParseMapsLine(t *testing.T) {
	for _, c := range []struct {
		line string
		id   fileID
		ok   bool
	}{
		{"7f3a1c000000-7f3a1c200000 rw-s 00000000 00:1a 4242                       /run/tensorfs/b/seg", fileID{unix.Mkdev(0, 0x1a), 4242}, true},
		{"7f3a1c000000-7f3a1c200000 r--s 00001000 103:02 12 /path with spaces (deleted)", fileID{unix.Mkdev(0x103, 2), 12}, true},
		{"55d0c0a00000-55d0c0a21000 rw-p 00000000 fd:01 18446744073709551615 /x", fileID{unix.Mkdev(0xfd, 1), 1<<64 - 1}, true},
		{"7ffd6a9e0000-7ffd6aa01000 rw-p 00000000 00:00 0                          [stack]", fileID{}, false},
		{"7f3a1c000000-7f3a1c200000 rw-p 00000000 00:00 0", fileID{}, false},
		{"7f3a1c000000-7f3a1c200000 rw-s 00000000 00:1a 18446744073709551616 /overflow", fileID{}, false},
		{"7f3a1c000000-7f3a1c200000 rw-s 00000000 0g:1a 12 /bad-hex", fileID{}, false},
		{"7f3a1c000000-7f3a1c200000 rw-s 00000000 001a 12 /no-colon", fileID{}, false},
		{"7f3a1c000000-7f3a1c200000 rw-s 00000000 00:1a", fileID{}, false},
		{"", fileID{}, false},
	} {
		id, ok := parseMapsLine([]byte(c.line))
		if id != c.id || ok != c.ok {
			t.Errorf("parseMapsLine(%q) = %v, %v; want %v, %v", c.line, id, ok, c.id, c.ok)
		}
	}
	var got []fileID
	forEachMapping([]byte("a b c 00:1a 7 /x\na b c 00:00 0\n\na b c 00:1b 8"), func(id fileID) { got = append(got, id) })
	if want := []fileID{{unix.Mkdev(0, 0x1a), 7}, {unix.Mkdev(0, 0x1b), 8}}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("forEachMapping found %v, want %v", got, want)
	}
}

// TestWriterLines: a maps text names a writer only for a shared writable
// mapping of a file asked for; an fdinfo text only for a descriptor open
// for writing of that mount and inode (octal flags).
func TestWriterLines(t *testing.T) {
	want := map[fileID]bool{{unix.Mkdev(0, 0x1a), 7}: true}
	for maps, writes := range map[string]bool{
		"a rw-s 0 00:1a 7 /seg\n":                        true,
		"a -w-s 0 00:1a 7 /seg":                          true,
		"a r--s 0 00:1a 7 /seg\na rw-p 0 00:1a 7 /seg\n": false,
		"a rw-s 0 00:1a 8 /other\na rw-s 0 00:1b 7 /x":   false,
		"": false,
	} {
		if got := mapsWritable([]byte(maps), want); got != writes {
			t.Errorf("mapsWritable(%q) = %v, want %v", maps, got, writes)
		}
	}
	for info, writes := range map[string]bool{
		"pos:\t0\nflags:\t0100002\nmnt_id:\t42\nino:\t7\n": true,
		"pos:\t0\nflags:\t0100001\nmnt_id:\t42\nino:\t7\n": true,
		"pos:\t0\nflags:\t0100000\nmnt_id:\t42\nino:\t7\n": false,
		"pos:\t0\nflags:\t0100002\nmnt_id:\t43\nino:\t7\n": false,
		"pos:\t0\nflags:\t0100002\nmnt_id:\t42\nino:\t8\n": false,
		"pos:\t0\nflags:\t0100002\nmnt_id:\t42\n":          false,
		"flags:\t0100089\nmnt_id:\t42\nino:\t7\n":          false,
	} {
		if got := fdinfoWrites([]byte(info), 42, 7); got != writes {
			t.Errorf("fdinfoWrites(%q) = %v, want %v", info, got, writes)
		}
	}
}

// FuzzParseMapsLine: any line parses without panic, and a line in the
// kernel's format gives back the device and inode written into it.
func FuzzParseMapsLine(f *testing.F) {
	f.Add([]byte("7f3a1c000000-7f3a1c200000 rw-s 00000000 00:1a 4242   /seg"), uint32(0), uint32(0x1a), uint64(4242))
	f.Add([]byte("a b c 103:02 0"), uint32(0x103), uint32(2), uint64(1<<64-1))
	f.Fuzz(func(t *testing.T, line []byte, major, minor uint32, ino uint64) {
		parseMapsLine(line)
		forEachMapping(line, func(fileID) {})
		l := fmt.Sprintf("7f00-7f01 rw-s 00000000 %02x:%02x %d %s", major, minor, ino, line)
		id, ok := parseMapsLine([]byte(l))
		if want := (fileID{unix.Mkdev(major, minor), ino}); ok != (ino != 0) || ok && id != want {
			t.Errorf("parseMapsLine(%q) = %v, %v; want %v, %v", l, id, ok, want, ino != 0)
		}
	})
}

// TestMappers: a scan finds a child that maps a file with its descriptor
// closed, not once it unmapped, and never this process; through
// PROCMAP_QUERY where the kernel has it, and through the text of
// /proc/PID/maps.
func TestMappers(t *testing.T) {
	for _, text := range []bool{false, true} {
		t.Run(map[bool]string{false: "query", true: "text"}[text], func(t *testing.T) {
			tab := &mapTable{noQuery: text}
			testMappers(t, tab)
			if !text && tab.noQuery {
				t.Log("the kernel has no PROCMAP_QUERY: the text was read")
			}
		})
	}
}

func testMappers(t *testing.T, tab *mapTable) {
	path, id := mappedTestFile(t)
	own, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	b, err := unix.Mmap(int(own.Fd()), 0, 4096, unix.PROT_READ, unix.MAP_SHARED)
	own.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(b)

	if got, err := scanMappers(t, tab, everyone(id)); len(got) != 0 || err != nil {
		t.Errorf("mappers with only this process mapping = %v, %v; want none", got, err)
	}
	m := startMapper(t, path)
	pid := uint32(m.cmd.Process.Pid)
	if got, err := scanMappers(t, tab, everyone(id, fileID{id.dev, id.ino + 1})); len(got) != 1 || !got[pid] || err != nil {
		t.Errorf("mappers = %v, %v; want the child %d", got, err, pid)
	}
	m.unmap(t)
	if got, err := scanMappers(t, tab, everyone(id)); len(got) != 0 || err != nil {
		t.Errorf("mappers after munmap = %v, %v; want none", got, err)
	}
}

// scanMappers is tab.mappers of a scan begun now, scanned again while
// another process's owner leases its maps (5 s at most): the tests beside
// this package's (integration's lease attacks) lease theirs for a moment,
// and a scan rightly concludes nothing then.
func scanMappers(t *testing.T, tab *mapTable, ids []mappedFile) (map[uint32]bool, error) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		got, err := tab.mappers(ids, time.Now(), mapsTTL)
		if err == nil || !strings.Contains(err.Error(), "leases its mappings") || time.Now().After(deadline) {
			return got, err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestAwaitUnmapped: the wait ends when the last mapping goes, by munmap
// or by SIGKILL, and when its epoll instance is closed (false).
func TestAwaitUnmapped(t *testing.T) {
	path, id := mappedTestFile(t)
	fsys := testFS(t)
	await := func() (*os.File, chan bool) {
		ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		unix.SetNonblock(ep, true)
		f := os.NewFile(uintptr(ep), "pidfds")
		done := make(chan bool, 1)
		go func() { done <- fsys.awaitUnmapped(f, everyone(id), time.Now()) }()
		return f, done
	}
	result := func(done chan bool) bool {
		select {
		case ok := <-done:
			return ok
		case <-time.After(30 * time.Second):
			t.Fatal("awaitUnmapped did not return")
		}
		return false
	}

	a, b := startMapper(t, path), startMapper(t, path)
	f, done := await()
	defer f.Close()
	a.unmap(t)
	if err := b.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	if !result(done) {
		t.Error("awaitUnmapped = false after munmap and SIGKILL, want true")
	}

	startMapper(t, path)
	f, done = await()
	f.Close()
	if result(done) {
		t.Error("awaitUnmapped = true when stopped while mapped, want false")
	}
}

// TestWatchesShareDescriptorBudget: a watch for the last mapping of an
// UNLINK segment holds descriptors, so it takes one of the releasing
// user's segment descriptors until it ends; past the user's share there
// is no watch (second fresh attack: watches took every descriptor).
func TestWatchesShareDescriptorBudget(t *testing.T) {
	fsys := testFS(t)
	held := newBudget("segment descriptors", 1, 16)
	fsys.handles = held
	path, id := mappedTestFile(t)
	startMapper(t, path)
	ids := everyone(id)
	fsys.watch(1, ids, time.Now(), 1000, func() {})
	fsys.watch(2, ids, time.Now(), 1000, func() {})
	fsys.watches.mu.Lock()
	first, second := fsys.watches.m[1] != nil, fsys.watches.m[2] != nil
	fsys.watches.mu.Unlock()
	if !first || second {
		t.Errorf("watches of a user whose share is one: first %v, second %v; want true, false", first, second)
	}
	used := held.Held(1000)
	if used != 1 {
		t.Errorf("the budget counts %d for the user's watch, want 1", used)
	}
	fsys.watches.unwatch(1)
	deadline := time.Now().Add(10 * time.Second)
	for {
		used = held.Held(1000)
		if used == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if used != 0 {
		t.Errorf("a stopped watch still counts %d in the budget", used)
	}
}

// TestRemoveUnlinkedTogether: UNLINK segments whose last mappings go at
// once are all removed (by walks shared among them), and a segment
// without the flag under the same calls stays.
func TestRemoveUnlinkedTogether(t *testing.T) {
	fsys := testFS(t)
	dir := filepath.Join(fsys.store.Dir, "d")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	var inos []uint64
	for i := range 200 {
		p := filepath.Join(dir, fmt.Sprint("s", i))
		if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
		flags := "UNLINK"
		if i == 0 {
			flags = "SHAREDMEM"
		}
		if err := unix.Setxattr(p, alloc.StoredName(alloc.AttrFlags), []byte(flags), 0); err != nil {
			t.Fatal(err)
		}
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		inos = append(inos, st.Ino)
	}
	var wg sync.WaitGroup
	for _, ino := range inos {
		wg.Go(func() { fsys.removeUnlinked(ino) })
	}
	wg.Wait()
	ents, err := os.ReadDir(dir)
	if err != nil || len(ents) != 1 || ents[0].Name() != "s0" {
		names := []string{}
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("after removing 199 UNLINK segments and one without the flag: %v (%v), want [s0]", names, err)
	}
}

// awaitAll starts a wait (awaitUnmapped) for the last mapping of each of
// files, each with an epoll instance of its own, and returns them and
// where each reports; the cleanup stops them.
func awaitAll(t *testing.T, fsys *filesystem, files ...fileID) ([]*os.File, []chan bool) {
	t.Helper()
	var eps []*os.File
	var dones []chan bool
	for _, id := range files {
		ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		unix.SetNonblock(ep, true)
		f := os.NewFile(uintptr(ep), "pidfds")
		done := make(chan bool, 1)
		go func() { done <- fsys.awaitUnmapped(f, everyone(id), time.Now()) }()
		t.Cleanup(func() { f.Close(); <-done })
		eps, dones = append(eps, f), append(dones, done)
	}
	return eps, dones
}

// waitFor polls cond for up to 10 seconds.
func waitFor(cond func() bool) bool {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if cond() {
			return true
		}
	}
	return cond()
}

// pidfdsHeld returns how many pidfds the table holds and the references
// to each.
func pidfdsHeld(fsys *filesystem) (n int, refs []int) {
	fsys.pidfds.mu.Lock()
	defer fsys.pidfds.mu.Unlock()
	for _, e := range fsys.pidfds.m {
		refs = append(refs, e.refs)
	}
	return len(fsys.pidfds.m), refs
}

// TestPidfdsShared: watches of several segments that the same processes
// map share one pidfd per process, counted once against the processes'
// owner; the last watch to let go closes it and gives it back (K2: a
// pidfd per process and segment took the daemon's descriptors).
func TestPidfdsShared(t *testing.T) {
	fsys := testFS(t)
	held := newBudget("descriptors", 100, 1000)
	fsys.handles = held
	var ids []fileID
	var paths []string
	for range 3 {
		path, id := mappedTestFile(t)
		ids, paths = append(ids, id), append(paths, path)
	}
	var mappers []*mapper
	for range 4 { // each maps every file
		mappers = append(mappers, startMapper(t, strings.Join(paths, ":")))
	}
	_, dones := awaitAll(t, fsys, ids[0], ids[1], ids[2])
	if !waitFor(func() bool { n, _ := pidfdsHeld(fsys); return n == len(mappers) }) {
		n, refs := pidfdsHeld(fsys)
		t.Fatalf("%d pidfds (references %v) for %d mapping processes, want one each", n, refs, len(mappers))
	}
	used := held.Held(uint32(os.Getuid()))
	if used != int64(len(mappers)) {
		t.Errorf("the owner of the mapping processes is charged %d descriptors, want %d (one pidfd each)", used, len(mappers))
	}
	for _, m := range mappers {
		m.cmd.Process.Kill()
	}
	for i, done := range dones {
		select {
		case ok := <-done:
			if !ok {
				t.Errorf("watch %d ended without its mappings gone", i)
			}
			done <- ok // for the cleanup
		case <-time.After(30 * time.Second):
			t.Fatalf("watch %d did not see its mappers exit", i)
		}
	}
	if n, _ := pidfdsHeld(fsys); n != 0 {
		t.Errorf("%d pidfds still held once every watch ended", n)
	}
	used = held.Used()
	if used != 0 {
		t.Errorf("%d descriptors still charged once every watch ended", used)
	}
}

// TestPidfdsOverBound: when the mapping process's owner holds her share
// of descriptors, a watch polls that process instead of holding a pidfd:
// it still waits while the process maps, and ends when it exits.
func TestPidfdsOverBound(t *testing.T) {
	fsys := testFS(t)
	fsys.handles = newBudget("descriptors", 0, 0) // nothing for anyone
	path, id := mappedTestFile(t)
	m := startMapper(t, path)
	_, dones := awaitAll(t, fsys, id)
	select {
	case ok := <-dones[0]:
		t.Fatalf("the watch ended (%v) while a process maps the file", ok)
	case <-time.After(1500 * time.Millisecond):
	}
	if n, _ := pidfdsHeld(fsys); n != 0 {
		t.Errorf("%d pidfds held past the bound, want none", n)
	}
	m.cmd.Process.Kill()
	select {
	case ok := <-dones[0]:
		if !ok {
			t.Error("the polling watch ended without the mapping gone")
		}
		dones[0] <- ok
	case <-time.After(30 * time.Second):
		t.Fatal("the polling watch did not see its mapper exit")
	}
}

// TestScanUnseen: a scan that cannot read /proc (the daemon out of
// descriptors) answers with an error wrapping EAGAIN, never "unmapped",
// and a watch keeps waiting, even for a file nobody maps, until a scan
// sees every process again (K2: EMFILE made every watch remove its
// segment's name).
func TestScanUnseen(t *testing.T) {
	fsys := testFS(t)
	_, id := mappedTestFile(t)
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	unix.SetNonblock(ep, true)
	f := os.NewFile(uintptr(ep), "pidfds")
	defer f.Close()
	restore := exhaustDescriptors(t)
	var tab mapTable
	_, unseen := tab.mappers(everyone(id), time.Now(), mapsTTL)
	done := make(chan bool, 1)
	go func() { done <- fsys.awaitUnmapped(f, everyone(id), time.Now()) }()
	var early bool
	select {
	case early = <-done:
	case <-time.After(500 * time.Millisecond):
	}
	restore()
	if !errors.Is(unseen, syscall.EAGAIN) {
		t.Errorf("a scan without descriptors: %v, want an error wrapping EAGAIN", unseen)
	}
	if early {
		t.Fatal("a watch took a scan that could not read /proc for unmapped")
	}
	select {
	case ok := <-done:
		if !ok {
			t.Error("the watch ended without seeing the file unmapped")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the watch did not end once scans saw every process again")
	}
}

// exhaustDescriptors lowers this process's soft limit on open files to
// its lowest free descriptor, so that every open fails with EMFILE, and
// returns what puts the limit back (also the cleanup's).
func exhaustDescriptors(t *testing.T) func() {
	t.Helper()
	var old unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	free, err := unix.Dup(0)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(free)
	low := unix.Rlimit{Cur: uint64(free), Max: old.Max}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	restore := func() { once.Do(func() { unix.Setrlimit(unix.RLIMIT_NOFILE, &old) }) }
	t.Cleanup(restore)
	return restore
}

// TestZombieLeaderMaps: a process whose leader thread exited alone (a
// zombie, whose /proc/PID/maps is empty) maps through its other threads.
// The scan sees it, by PROCMAP_QUERY and by the text; writers names it; a
// watch waits for it, its leader's pidfd not readable meanwhile, and ends
// at munmap. Once every thread has exited, the zombie left is neither a
// mapper nor a process the scan could not see (fresh attack L6: the scan
// took such a process for one that maps nothing).
func TestZombieLeaderMaps(t *testing.T) {
	path, id := mappedTestFile(t)
	m := startMapper(t, path, leaderExitsEnv+"=1")
	pid := uint32(m.cmd.Process.Pid)
	dir := fmt.Sprintf("/proc/%d", pid)
	if tasks, _ := os.ReadDir(dir + "/task"); len(tasks) < 2 || readProc(dir+"/maps") != "" {
		t.Fatalf("the mapper's leader did not exit alone: %d threads, maps %q", len(tasks), readProc(dir+"/maps"))
	}
	for _, text := range []bool{false, true} {
		tab := &mapTable{noQuery: text}
		if got, err := scanMappers(t, tab, everyone(id)); len(got) != 1 || !got[pid] || err != nil {
			t.Errorf("mappers (text %v) = %v, %v; want the child %d", text, got, err, pid)
		}
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if w := writers(everyone(id), int(f.Fd())); len(w) != 1 || !strings.HasPrefix(w[0], fmt.Sprintf("pid %d ", pid)) {
		t.Errorf("writers = %q, want the child %d", w, pid)
	}

	pidfd, err := unix.PidfdOpen(int(pid), 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pidfd)
	_, dones := awaitAll(t, testFS(t), id)
	select {
	case ok := <-dones[0]:
		dones[0] <- ok // for the cleanup
		t.Fatalf("the watch ended (%v) while the child's threads map the file", ok)
	case <-time.After(300 * time.Millisecond):
	}
	if n, _ := unix.Poll([]unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}, 0); n != 0 {
		t.Error("the pidfd of a leader whose other threads live is readable")
	}
	m.unmap(t)
	select {
	case ok := <-dones[0]:
		if !ok {
			t.Error("awaitUnmapped = false after munmap, want true")
		}
		dones[0] <- ok
	case <-time.After(30 * time.Second):
		t.Fatal("the watch did not end at munmap")
	}

	m.stdin.Close() // the child's last thread exits: a zombie, not reaped
	for {
		n, err := unix.Poll([]unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}, 30000)
		if err == unix.EINTR { // the Go runtime's preemption signal
			continue
		}
		if n != 1 {
			t.Fatalf("the child's pidfd did not become readable: %v", err)
		}
		break
	}
	tab := &mapTable{}
	if got, err := scanMappers(t, tab, everyone(id)); len(got) != 0 || err != nil {
		t.Errorf("mappers with the child a zombie = %v, %v; want none", got, err)
	}
}

// TestLeftOutUnwraps: a process that exits while the scan lists its
// threads is gone, however os wraps the ENOENT (CI: "readdirent
// /proc/PID/task: no such file or directory" made a refcount EAGAIN);
// any other failure is a process not seen.
func TestLeftOutUnwraps(t *testing.T) {
	gone := &os.PathError{Op: "readdirent", Path: "/proc/1/task", Err: syscall.ENOENT}
	if !leftOut(gone) || !leftOut(os.NewSyscallError("open", syscall.ESRCH)) {
		t.Error("a process that exited during the scan counts as not seen")
	}
	if leftOut(&os.PathError{Op: "open", Path: "/proc/1/maps", Err: syscall.EMFILE}) || leftOut(errNewThreads) {
		t.Error("a failed read counts as a process that exited")
	}
}
