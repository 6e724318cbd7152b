package lifecycle

import (
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"

	"tensorfs/fs"
)

// TestHandoverOrphans: a handover carries the orphans' descriptors after
// the state, more than one message holds (maxFds), each under its node
// ID and reaching the same file, then the imports', each under its id
// and sender.
func TestHandoverOrphans(t *testing.T) {
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		c, err := net.FileConn(os.NewFile(uintptr(fd), "pair"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c.(*net.UnixConn)
	}
	a, b := conn(pair[0]), conn(pair[1])
	dir := t.TempDir()
	inos := map[uint64]uint64{}
	tk := fs.Takeover{Init: []byte("init"), Gen: 2, Orphans: map[uint64]int{}, Imports: map[fs.Import]int{}, State: fs.State{Unnamed: []uint64{7}}}
	for i := range maxFds + 50 {
		f, err := os.Create(filepath.Join(dir, strconv.Itoa(i)))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		var st unix.Stat_t
		unix.Fstat(int(f.Fd()), &st)
		tk.Orphans[uint64(1000+i)], inos[uint64(1000+i)] = int(f.Fd()), st.Ino
	}
	tk.Fd = tk.Orphans[1000]
	imported := map[fs.Import]uint64{}
	for i := range 3 {
		imp := fs.Import{ID: "import-" + strconv.Itoa(i), UID: uint32(1000 + i)}
		tk.Imports[imp], imported[imp] = tk.Orphans[uint64(1001+i)], inos[uint64(1001+i)]
	}
	errs := make(chan error, 1)
	go func() { errs <- send(a, tk) }()
	got, err := receive(b, os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	defer unix.Close(got.Fd)
	if len(got.Orphans) != len(inos) || len(got.State.Unnamed) != 1 || got.State.Unnamed[0] != 7 {
		t.Fatalf("received %d orphans and unnamed %v, want %d and [7]", len(got.Orphans), got.State.Unnamed, len(inos))
	}
	for id, fd := range got.Orphans {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil || st.Ino != inos[id] {
			t.Errorf("orphan %d: inode %d %v, want %d", id, st.Ino, err, inos[id])
		}
		unix.Close(fd)
	}
	if len(got.Imports) != len(imported) {
		t.Fatalf("received %d imports, want %d", len(got.Imports), len(imported))
	}
	for imp, fd := range got.Imports {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil || st.Ino != imported[imp] {
			t.Errorf("import %+v: inode %d %v, want %d", imp, st.Ino, err, imported[imp])
		}
		unix.Close(fd)
	}
}
