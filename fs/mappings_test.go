package fs

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// mapperEnv makes the test binary a mapper child (mapperMain) instead.
const mapperEnv = "TENSORFS_TEST_MAPPER"

func TestMain(m *testing.M) {
	if path := os.Getenv(mapperEnv); path != "" {
		mapperMain(path)
		return
	}
	os.Exit(m.Run())
}

// mapperMain maps the file at path, closes its descriptor and says
// "mapped"; then each line on stdin unmaps ("unmapped") until EOF.
func mapperMain(path string) {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		panic(err)
	}
	b, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		panic(err)
	}
	unix.Close(fd)
	fmt.Println("mapped")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		unix.Munmap(b)
		fmt.Println("unmapped")
	}
}

// mapper is a child process that maps a file.
type mapper struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Scanner
}

// startMapper starts a child that maps the file at path with its
// descriptor closed; the cleanup ends it.
func startMapper(t *testing.T, path string) *mapper {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), mapperEnv+"="+path)
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

	if got := tab.mappers(everyone(id), time.Now(), mapsTTL); len(got) != 0 {
		t.Errorf("mappers with only this process mapping = %v, want none", got)
	}
	m := startMapper(t, path)
	pid := uint32(m.cmd.Process.Pid)
	if got := tab.mappers(everyone(id, fileID{id.dev, id.ino + 1}), time.Now(), mapsTTL); len(got) != 1 || !got[pid] {
		t.Errorf("mappers = %v, want the child %d", got, pid)
	}
	m.unmap(t)
	if got := tab.mappers(everyone(id), time.Now(), mapsTTL); len(got) != 0 {
		t.Errorf("mappers after munmap = %v, want none", got)
	}
}

// TestAwaitUnmapped: the wait ends when the last mapping goes, by munmap
// or by SIGKILL, and when its epoll instance is closed (false).
func TestAwaitUnmapped(t *testing.T) {
	path, id := mappedTestFile(t)
	var tab mapTable
	await := func() (*os.File, chan bool) {
		ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		unix.SetNonblock(ep, true)
		f := os.NewFile(uintptr(ep), "pidfds")
		done := make(chan bool, 1)
		go func() { done <- tab.awaitUnmapped(f, everyone(id), time.Now()) }()
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
	fsys.watch(1, ids, time.Now(), 1000)
	fsys.watch(2, ids, time.Now(), 1000)
	fsys.watches.mu.Lock()
	first, second := fsys.watches.m[1] != nil, fsys.watches.m[2] != nil
	fsys.watches.mu.Unlock()
	if !first || second {
		t.Errorf("watches of a user whose share is one: first %v, second %v; want true, false", first, second)
	}
	held.mu.Lock()
	used := held.used[1000]
	held.mu.Unlock()
	if used != 1 {
		t.Errorf("the budget counts %d for the user's watch, want 1", used)
	}
	fsys.watches.unwatch(1)
	deadline := time.Now().Add(10 * time.Second)
	for {
		held.mu.Lock()
		used = held.used[1000]
		held.mu.Unlock()
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
