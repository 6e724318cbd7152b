package gpu

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// TestSimMemfdSealed: every sim allocation, the one behind an IPC handle
// and the one behind an export, is an owner-only memfd (0600) sealed
// against any change of size; each Export is a read-write open file
// description of its own (a seek on one moves no other), and no holder
// can shrink or grow the memory or add a seal.
func TestSimMemfdSealed(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d Device) {
		const size = 3<<20 + 5
		b := alloc(t, d, 100)
		h := ipc(t, d, b).MemHandle
		var st unix.Stat_t
		if err := unix.Stat(fmt.Sprintf("/proc/%d/fd/%d", binary.LittleEndian.Uint32(h[32:]), binary.LittleEndian.Uint32(h[36:])), &st); err != nil {
			t.Fatal(err)
		}
		if st.Mode&0o7777 != 0o600 {
			t.Errorf("the memfd behind an IPC handle has mode %#o, want 0600", st.Mode&0o7777)
		}
		free(t, d, b)

		eb, err := d.AllocExportable(size)
		if err != nil {
			t.Fatal(err)
		}
		defer free(t, d, eb)
		var files []*os.File
		for range 2 {
			f, err := d.Export(eb)
			if err != nil {
				t.Fatalf("Export: %v", err)
			}
			defer f.Close()
			files = append(files, f)
		}
		for i, f := range files {
			fd := int(f.Fd())
			var st unix.Stat_t
			if err := unix.Fstat(fd, &st); err != nil {
				t.Fatal(err)
			}
			fl, _ := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
			seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
			if err != nil || seals&memfdSeals != memfdSeals || st.Mode&0o7777 != 0o600 || fl&unix.O_ACCMODE != unix.O_RDWR {
				t.Errorf("export %d: seals %#x (%v), mode %#o, flags %#x; want seals %#x, mode 0600, read-write", i, seals, err, st.Mode&0o7777, fl, memfdSeals)
			}
			for _, n := range []int64{0, st.Size - 1, st.Size + simGranularity} {
				if err := unix.Ftruncate(fd, n); !errors.Is(err, syscall.EPERM) {
					t.Errorf("export %d: ftruncate to %d = %v, want EPERM", i, n, err)
				}
			}
			if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_FUTURE_WRITE); !errors.Is(err, syscall.EPERM) {
				t.Errorf("export %d: adding a seal = %v, want EPERM", i, err)
			}
		}
		if _, err := files[0].Seek(4242, 0); err != nil {
			t.Fatal(err)
		}
		if off, err := files[1].Seek(0, 1); err != nil || off != 0 {
			t.Errorf("a seek on one export moved the other to %d (%v): they share an open file description", off, err)
		}
		if err := d.CopyIn(eb, size-4, []byte("tail")); err != nil {
			t.Errorf("CopyIn at the end after the attempts to resize: %v", err)
		}
	})
}

// TestHelloStagingChecked: the helper maps a staging area only if it is
// as large as the hello says and sealed against shrinking, so that the
// daemon's side cannot make a touch of it fault (SIGBUS).
func TestHelloStagingChecked(t *testing.T) {
	plain, err := unix.MemfdCreate("plain", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(plain)
	if err := unix.Ftruncate(plain, 1<<20); err != nil {
		t.Fatal(err)
	}
	sealed, err := sealedMemfd("sealed", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(sealed)
	for _, c := range []struct {
		name string
		fd   int
		size int64
		ok   bool
	}{{"unsealed", plain, 1 << 20, false}, {"short", sealed, 2 << 20, false}, {"sealed", sealed, 1 << 20, true}} {
		err := checkMappable(c.fd, c.size)
		if c.ok != (err == nil) || !c.ok && !errors.Is(err, syscall.EINVAL) {
			t.Errorf("%s staging area of %d bytes: %v", c.name, c.size, err)
		}
		s := &server{dev: NewSim(0, 0)}
		_, err = s.hello(&message{op: opHello, args: []int64{c.size}}, c.fd)
		if c.ok != (err == nil) {
			t.Errorf("hello with the %s staging area of %d bytes: %v", c.name, c.size, err)
		}
		if s.staging != nil {
			unix.Munmap(s.staging)
		}
		s.dev.Close()
	}
}
