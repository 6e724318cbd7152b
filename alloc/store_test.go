package alloc

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"tensorfs/internal/tmpfstest"
)

func setAttrRaw(path, name, value string) error {
	return unix.Setxattr(path, name, []byte(value), 0)
}

// smallTmpfs mounts a tmpfs of size bytes for the test (root only).
func smallTmpfs(t *testing.T, size int64) string {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("tests need root under CI")
		}
		t.Skip("needs root to mount a tmpfs")
	}
	dir := t.TempDir()
	if _, err := mountTmpfs(dir, size, 0, false); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

func TestResizeReservesPages(t *testing.T) {
	dir := smallTmpfs(t, 8<<20)
	f, err := os.Create(filepath.Join(dir, "seg"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fd := int(f.Fd())
	if err := Resize(fd, 6<<20); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	unix.Fstat(fd, &st)
	if st.Blocks*512 < 6<<20 {
		t.Errorf("growth reserved %d bytes, want all 6 MiB", st.Blocks*512)
	}
	g, err := os.Create(filepath.Join(dir, "other"))
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if err := Resize(int(g.Fd()), 4<<20); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("growth past capacity: %v, want ErrNoSpace", err)
	}
	if info, _ := g.Stat(); info.Size() != 0 {
		t.Errorf("failed growth left size %d, want 0", info.Size())
	}
	if err := Resize(fd, 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := Resize(int(g.Fd()), 4<<20); err != nil {
		t.Errorf("growth after shrinking the other segment: %v", err)
	}
	if err := Resize(fd, MaxSegmentSize+1); !errors.Is(err, ErrTooBig) {
		t.Errorf("growth past MaxSegmentSize: %v, want ErrTooBig", err)
	}
}

func TestRecoverRemovesUnlinkSegmentsAndRestoresShared(t *testing.T) {
	backing, disk := tmpfsBacking(t), t.TempDir()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	s, err := Open(Config{Backing: backing, Disk: disk}, log)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	keep := filepath.Join(backing, "keep")
	temp := filepath.Join(backing, "temp")
	os.WriteFile(keep, []byte("1234"), 0o644)
	os.WriteFile(temp, []byte("gone"), 0o644)
	if err := storeFlags(temp, Unlink, 0); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(backing, "marker"), nil, 0o644)
	fd, id, err := s.CreateShared(filepath.Join(backing, "marker"), "sub/w", unix.O_RDWR|unix.O_CLOEXEC, 0o640)
	if err != nil {
		t.Fatal(err)
	}
	unix.Write(fd, []byte("on disk"))
	unix.Close(fd)
	// A purged backing: the marker is gone, the disk file stays.
	os.Remove(filepath.Join(backing, "marker"))

	rec, err := s.Recover(nil, false)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Segments != 1 || rec.Bytes != 4 {
		t.Errorf("Recover kept %d segments, %d bytes; want 1, 4", rec.Segments, rec.Bytes)
	}
	if _, err := os.Stat(temp); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("UNLINK segment survived recovery: %v", err)
	}
	restored := filepath.Join(backing, "sub", "w")
	var st unix.Stat_t
	unix.Stat(restored, &st)
	if got, err := ReadMarker(restored, &st); err != nil || got != (Marker{Kind: Disk, ID: id}) {
		t.Errorf("restored marker is %+v (%v), want disk id %q", got, err, id)
	}
	// The disk records no directory's mode: a rebuilt one lists for no
	// user.
	if err := unix.Stat(filepath.Join(backing, "sub"), &st); err != nil || st.Mode&0o7777 != 0o711 {
		t.Errorf("rebuilt directory: mode %#o (%v), want 0711", st.Mode&0o7777, err)
	}
}

// TestRecoverContestedSharedPath: two disk files that record one path
// (one of them stale) both go beside it, name.shared-<id>: recovery does
// not pick one to give the name; a path only one records is its own.
func TestRecoverContestedSharedPath(t *testing.T) {
	backing, disk := tmpfsBacking(t), t.TempDir()
	s, err := Open(Config{Backing: backing, Disk: disk}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ids := map[string]string{}
	for _, c := range []struct{ marker, rel string }{{"m1", "d/model"}, {"m2", "d/model"}, {"m3", "d/other"}} {
		marker := filepath.Join(backing, c.marker)
		os.WriteFile(marker, nil, 0o644)
		fd, id, err := s.CreateShared(marker, c.rel, unix.O_RDWR|unix.O_CLOEXEC, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		unix.Close(fd)
		os.Remove(marker) // a purged backing
		ids[c.marker] = id
	}
	if _, err := s.Recover(nil, false); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"d/model.shared-" + ids["m1"]: ids["m1"],
		"d/model.shared-" + ids["m2"]: ids["m2"],
		"d/other":                     ids["m3"],
	}
	for rel, id := range want {
		p := filepath.Join(backing, rel)
		var st unix.Stat_t
		unix.Stat(p, &st)
		if got, err := ReadMarker(p, &st); err != nil || got != (Marker{Kind: Disk, ID: id}) {
			t.Errorf("%s after recovery: %+v (%v), want disk id %q", rel, got, err, id)
		}
	}
	if _, err := os.Lstat(filepath.Join(backing, "d/model")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the contested path was given to one of its claimants: %v", err)
	}
}

// TestRecoverKeepsMappedUnlinkSegments: an UNLINK segment that the
// predicate reports mapped stays; the others go.
func TestRecoverKeepsMappedUnlinkSegments(t *testing.T) {
	backing := tmpfsBacking(t)
	s := openStore(t, backing)
	mapped, unmapped := filepath.Join(backing, "mapped"), filepath.Join(backing, "unmapped")
	for _, p := range []string{mapped, unmapped} {
		os.WriteFile(p, []byte("abc"), 0o644)
		if err := storeFlags(p, Unlink, 0); err != nil {
			t.Fatal(err)
		}
	}
	var st unix.Stat_t
	if err := unix.Stat(mapped, &st); err != nil {
		t.Fatal(err)
	}
	var asked []uint64
	rec, err := s.Recover(func(s *unix.Stat_t) bool {
		asked = append(asked, s.Ino)
		return s.Dev == st.Dev && s.Ino == st.Ino
	}, false)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Segments != 1 || rec.Bytes != 3 || len(asked) != 2 {
		t.Errorf("Recover kept %d segments, %d bytes, asked about %d; want 1, 3, 2", rec.Segments, rec.Bytes, len(asked))
	}
	if _, err := os.Stat(mapped); err != nil {
		t.Errorf("mapped UNLINK segment: %v, want kept", err)
	}
	if _, err := os.Stat(unmapped); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("unmapped UNLINK segment: %v, want removed", err)
	}
}

// TestRecoverForSuccessor: a successor's recovery keeps the UNLINK
// segments no process maps and the imports' markers, and lists them; a
// mount's removes both.
func TestRecoverForSuccessor(t *testing.T) {
	backing := tmpfsBacking(t)
	s := openStore(t, backing)
	unlink, imported := filepath.Join(backing, "unlink"), filepath.Join(backing, "imported")
	os.WriteFile(unlink, []byte("abc"), 0o644)
	os.WriteFile(imported, nil, 0o444)
	if err := storeFlags(unlink, Unlink, 0); err != nil {
		t.Fatal(err)
	}
	id := NewID()
	if err := MarkImport(imported, id); err != nil {
		t.Fatal(err)
	}
	var ust, ist unix.Stat_t
	unix.Stat(unlink, &ust)
	unix.Stat(imported, &ist)
	rec, err := s.Recover(nil, true)
	if err != nil {
		t.Fatal(err)
	}
	if len(rec.Unlinked) != 1 || rec.Unlinked[0] != ust.Ino {
		t.Errorf("a successor's recovery lists UNLINK segments %v, want [%d]", rec.Unlinked, ust.Ino)
	}
	if want := (ImportMarker{Rel: "imported", Ino: ist.Ino, ID: id}); len(rec.Imports) != 1 || rec.Imports[0] != want {
		t.Errorf("a successor's recovery lists imports %+v, want [%+v]", rec.Imports, want)
	}
	for _, p := range []string{unlink, imported} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("%s after a successor's recovery: %v, want kept", p, err)
		}
	}
	if _, err := s.Recover(nil, false); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{unlink, imported} {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s after a mount's recovery: %v, want removed", p, err)
		}
	}
}

// TestRecoverPulled: a complete pulled segment is kept with its path,
// an incomplete one is emptied (its pull starts over), and one frozen for
// a publish that never finished is a host segment again.
func TestRecoverPulled(t *testing.T) {
	backing := tmpfsBacking(t)
	s := openStore(t, backing)
	cid := strings.Repeat("0f", 32)
	for name, m := range map[string]Marker{
		"complete": {Content: cid, Size: 8, Complete: true},
		"partial":  {Content: cid, Size: 8},
		"frozen":   {Size: 8, Complete: true},
	} {
		p := filepath.Join(backing, name)
		os.WriteFile(p, []byte("8 bytes!"), 0o644)
		if err := MarkPulled(p, m); err != nil {
			t.Fatal(err)
		}
	}
	rec, err := s.Recover(nil, false)
	if err != nil {
		t.Fatal(err)
	}
	got := map[uint64]PulledFile{}
	for _, pf := range rec.Pulled {
		got[pf.Ino] = pf
	}
	stat := func(name string) *unix.Stat_t {
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(backing, name), &st); err != nil {
			t.Fatal(err)
		}
		return &st
	}
	st := stat("complete")
	if pf := got[st.Ino]; pf.Path != "complete" || pf.Marker != (Marker{Kind: Pulled, Content: cid, Size: 8, Complete: true}) || st.Size != 8 {
		t.Errorf("complete: %+v, %d bytes; want it kept, with its path", pf, st.Size)
	}
	st = stat("partial")
	if pf := got[st.Ino]; pf.Path != "" || pf.Marker.Complete || st.Size != 0 {
		t.Errorf("partial: %+v, %d bytes; want it emptied, without a path", pf, st.Size)
	}
	st = stat("frozen")
	if m, err := ReadMarker(filepath.Join(backing, "frozen"), st); err != nil || m.Kind != Host || st.Size != 8 || got[st.Ino].Ino != 0 {
		t.Errorf("frozen: %+v %v, %d bytes; want a host segment with its bytes", m, err, st.Size)
	}
	if rec.Segments != 3 || rec.Bytes != 16 {
		t.Errorf("Recover counted %d segments, %d bytes; want 3, 16", rec.Segments, rec.Bytes)
	}
}

// TestReadMarkerPulled: a pulled marker is read on a file with bytes; one
// that does not hold a content ID tensorfs makes is ErrInvalid.
func TestReadMarkerPulled(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	os.WriteFile(p, []byte("bytes"), 0o644)
	var st unix.Stat_t
	unix.Stat(p, &st)
	if m, err := ReadMarker(p, &st); err != nil || m.Kind != Host {
		t.Fatalf("a file with bytes and no marker: %+v %v", m, err)
	}
	want := Marker{Kind: Pulled, Content: strings.Repeat("a1", 32), Size: 5, Complete: true}
	if err := MarkPulled(p, want); err != nil {
		t.Fatal(err)
	}
	if m, err := ReadMarker(p, &st); err != nil || m != want {
		t.Errorf("ReadMarker = %+v %v; want %+v", m, err, want)
	}
	for _, bad := range []string{`{"content":"../../etc","size":5}`, `{"content":"","size":-1}`, `not json`} {
		if err := unix.Setxattr(p, attrPulled, []byte(bad), 0); err != nil {
			t.Fatal(err)
		}
		if _, err := ReadMarker(p, &st); !errors.Is(err, ErrInvalid) {
			t.Errorf("marker %s: %v; want ErrInvalid", bad, err)
		}
	}
	if err := MarkPulled(p, Marker{Content: "/etc/passwd"}); !errors.Is(err, ErrInvalid) {
		t.Errorf("MarkPulled of a bad content ID: %v", err)
	}
	if names, _ := Listxattr(p); len(names) != 0 {
		t.Errorf("Listxattr shows the marker: %v", names)
	}
}

// openStore opens a store on backing, with no --disk and a silent log,
// closed when the test ends.
func openStore(t *testing.T, backing string) *Store {
	t.Helper()
	s, err := Open(Config{Backing: backing}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// tmpfsBacking returns a new backing directory on a tmpfs (/dev/shm), in
// a directory of mode 0700 (checkPrivateParent), removed at cleanup: a
// backing must be on a tmpfs (checkTmpfs).
func tmpfsBacking(t *testing.T) string {
	t.Helper()
	top := tmpfstest.Dir(t)
	backing := filepath.Join(top, "backing")
	if err := os.Mkdir(backing, 0o755); err != nil {
		t.Fatal(err)
	}
	return backing
}

// TestOpenRefusesBackingNotOnTmpfs: a backing on another filesystem (one
// that reuses inode numbers) is refused, saying why and what to do.
func TestOpenRefusesBackingNotOnTmpfs(t *testing.T) {
	top := t.TempDir()
	var st unix.Statfs_t
	if err := unix.Statfs(top, &st); err != nil || st.Type == unix.TMPFS_MAGIC {
		t.Skipf("the test's temporary directory %s is on a tmpfs (%v): no other filesystem to try", top, err)
	}
	os.Chmod(top, 0o700)
	backing := filepath.Join(top, "backing")
	if err := os.Mkdir(backing, 0o755); err != nil {
		t.Fatal(err)
	}
	s, err := Open(Config{Backing: backing}, slog.New(slog.DiscardHandler))
	if err == nil {
		s.Close()
		t.Fatalf("Open of a backing on filesystem type %#x succeeded", st.Type)
	}
	if !strings.Contains(err.Error(), "not a tmpfs") || !strings.Contains(err.Error(), "no --backing") {
		t.Errorf("Open of a backing on filesystem type %#x: %v; want it to say it is not a tmpfs and what to do", st.Type, err)
	}
	if entries, _ := os.ReadDir(backing); len(entries) != 0 {
		t.Errorf("the refused backing holds %d entries", len(entries))
	}
}

// TestBackingHugePages: the private backing has no huge pages, or with
// --huge-pages is mounted huge=within_size, where a segment sized before it is written
// is mapped in 2 MiB pages and takes no more memory than its size.
func TestBackingHugePages(t *testing.T) {
	if opts := mountOptions(t, smallTmpfs(t, 16<<20)); strings.Contains(opts, "huge=") {
		t.Errorf("the default backing's options: %s, want no huge pages", opts)
	}
	if _, err := os.Stat("/sys/kernel/mm/transparent_hugepage/shmem_enabled"); err != nil {
		t.Skip("this kernel has no transparent huge pages for tmpfs")
	}
	dir := t.TempDir()
	if huge, err := mountTmpfs(dir, 16<<20, 0, true); err != nil || !huge {
		t.Fatalf("mount with huge pages: in huge pages %v, %v", huge, err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	if opts := mountOptions(t, dir); !strings.Contains(","+opts+",", ",huge=within_size,") {
		t.Fatalf("the backing's options: %s, want huge=within_size", opts)
	}
	f, err := os.Create(filepath.Join(dir, "seg"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const size = 4<<20 + 4096 // two huge pages and a small one
	if err := Resize(int(f.Fd()), size); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil || st.Blocks*512 != size {
		t.Errorf("the segment holds %d bytes (%v), want its size, %d", st.Blocks*512, err, size)
	}
	b, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(b)
	var sum byte
	for i := 0; i < size; i += 4096 {
		sum += b[i]
	}
	if pmd := smapsField(t, uintptr(unsafe.Pointer(&b[0])), "ShmemPmdMapped"); pmd != 4<<10 {
		t.Errorf("the mapping's ShmemPmdMapped: %d kB, want 4096 (two huge pages; sum %d)", pmd, sum)
	}
	if _, err := mountTmpfs(dir, 32<<20, 0, false); err != nil { // a successor without --huge-pages
		t.Fatal(err)
	}
	if opts := mountOptions(t, dir); strings.Contains(opts, "huge=") || !strings.Contains(opts, "size=32768k") {
		t.Errorf("the backing's options after a remount without huge pages: %s, want no huge= and the new size", opts)
	}
}

// mountOptions returns the superblock options of the mount at dir.
func mountOptions(t *testing.T, dir string) string {
	t.Helper()
	mounts, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(dir))
	if err != nil || len(mounts) == 0 {
		t.Fatalf("%s is not in /proc/self/mountinfo (%v)", dir, err)
	}
	return mounts[len(mounts)-1].VFSOptions
}

// smapsField returns the field (in kB) of the mapping that starts at addr,
// from /proc/self/smaps.
func smapsField(t *testing.T, addr uintptr, field string) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		t.Fatal(err)
	}
	start := fmt.Sprintf("%x-", addr)
	in := false
	for line := range strings.Lines(string(b)) {
		if f := strings.Fields(line); len(f) > 0 && strings.Contains(f[0], "-") && !strings.HasSuffix(f[0], ":") {
			in = strings.HasPrefix(f[0], start)
		} else if in && len(f) >= 2 && f[0] == field+":" {
			n, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no mapping at %#x with %s in /proc/self/smaps", addr, field)
	return 0
}
