package procfs

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestReadStatusSelf: this process's status matches what the kernel says
// through system calls.
func TestReadStatusSelf(t *testing.T) {
	s, err := ReadStatus(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	groups, err := unix.Getgroups()
	if err != nil {
		t.Fatal(err)
	}
	var want []uint32
	for _, g := range groups {
		want = append(want, uint32(g))
	}
	slices.Sort(want)
	got := slices.Sorted(slices.Values(s.Groups))
	switch {
	case s.Tgid != os.Getpid():
		t.Errorf("Tgid %d, want %d", s.Tgid, os.Getpid())
	case s.Uid[0] != uint32(os.Getuid()) || s.Uid[1] != uint32(os.Geteuid()):
		t.Errorf("Uid %v, want real %d effective %d", s.Uid, os.Getuid(), os.Geteuid())
	case s.Gid[0] != uint32(os.Getgid()) || s.Gid[1] != uint32(os.Getegid()):
		t.Errorf("Gid %v, want real %d effective %d", s.Gid, os.Getgid(), os.Getegid())
	case !slices.Equal(got, want):
		t.Errorf("Groups %v, want getgroups() %v", got, want)
	case s.VmRSS <= 0 || s.VmHWM < s.VmRSS:
		t.Errorf("VmRSS %d, VmHWM %d: want 0 < VmRSS <= VmHWM", s.VmRSS, s.VmHWM)
	}
}

// TestReadStatusThread: a thread's status names its process.
func TestReadStatusThread(t *testing.T) {
	tid := make(chan int)
	go func() {
		runtime.LockOSThread() // the thread ends with the goroutine
		tid <- unix.Gettid()
		<-tid
	}()
	id := <-tid
	defer close(tid)
	s, err := ReadStatus(id)
	if err != nil || s.Tgid != os.Getpid() {
		t.Errorf("thread %d: Tgid %d, %v; want %d", id, s.Tgid, err, os.Getpid())
	}
}

// TestReadStatusExited: a reaped process has no status.
func TestReadStatusExited(t *testing.T) {
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Skip(err)
	}
	if _, err := ReadStatus(cmd.Process.Pid); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("status of exited pid %d: %v, want fs.ErrNotExist", cmd.Process.Pid, err)
	}
}

// sample is a process's status as Linux 6 writes it, less some lines.
const sample = "Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t4242\nNgid:\t0\nPid:\t4243\n" +
	"PPid:\t1\nUid:\t1000\t1001\t1002\t1003\nGid:\t100\t101\t102\t103\nFDSize:\t64\n" +
	"Groups:\t4 24 27 100 \nNStgid:\t4242\nVmPeak:\t  20000 kB\nVmHWM:\t    9000 kB\nVmRSS:\t    8000 kB\n" +
	"Threads:\t2\nvoluntary_ctxt_switches:\t10\n"

func TestParseStatus(t *testing.T) {
	s, err := ParseStatus([]byte(sample))
	want := Status{Tgid: 4242, Uid: [4]uint32{1000, 1001, 1002, 1003}, Gid: [4]uint32{100, 101, 102, 103},
		Groups: []uint32{4, 24, 27, 100}, VmRSS: 8000 << 10, VmHWM: 9000 << 10}
	if err != nil || !reflect.DeepEqual(s, want) {
		t.Fatalf("ParseStatus(sample) = %+v, %v; want %+v", s, err, want)
	}

	// A kernel thread: no memory lines, no groups.
	kthread := "Name:\tkthreadd\nTgid:\t2\nPid:\t2\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\nGroups:\t \n"
	if s, err := ParseStatus([]byte(kthread)); err != nil || s.Tgid != 2 || s.Groups != nil || s.VmRSS != 0 {
		t.Errorf("kernel thread: %+v, %v", s, err)
	}

	for _, bad := range []struct{ from, to string }{
		{"Tgid:\t4242\n", ""},
		{"Uid:\t1000\t1001\t1002\t1003\n", ""},
		{"Gid:\t100\t101\t102\t103\n", ""},
		{"Tgid:\t4242", "Tgid:\t-1"},
		{"Tgid:\t4242", "Tgid:\t0"},
		{"Tgid:\t4242", "Tgid:\t4242 7"},
		{"Tgid:\t4242", "Tgid:\t99999999999"},
		{"Uid:\t1000\t1001\t1002\t1003", "Uid:\t1000\t1001\t1002"},
		{"Gid:\t100", "Gid:\t-100"},
		{"Groups:\t4 24", "Groups:\t4 x24"},
		{"Groups:\t4 24", "Groups:\t4 4294967296"},
		{"VmRSS:\t    8000 kB", "VmRSS:\t8000"},
		{"VmRSS:\t    8000 kB", "VmRSS:\t8000 MB"},
		{"VmHWM:\t    9000 kB", "VmHWM:\t-9 kB"},
		{"VmHWM:\t    9000 kB", "VmHWM:\t9223372036854775807 kB"},
	} {
		text := strings.Replace(sample, bad.from, bad.to, 1)
		if text == sample {
			t.Fatalf("case %q does not change the sample", bad.from)
		}
		if s, err := ParseStatus([]byte(text)); err == nil {
			t.Errorf("ParseStatus accepted %q for %q: %+v", bad.to, bad.from, s)
		}
	}
}

// format writes s as the kernel would.
func format(s Status) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Tgid:\t%d\nUid:\t%d\t%d\t%d\t%d\nGid:\t%d\t%d\t%d\t%d\nGroups:\t", s.Tgid,
		s.Uid[0], s.Uid[1], s.Uid[2], s.Uid[3], s.Gid[0], s.Gid[1], s.Gid[2], s.Gid[3])
	for _, g := range s.Groups {
		fmt.Fprintf(&b, "%d ", g)
	}
	fmt.Fprintf(&b, "\nVmHWM:\t%8d kB\nVmRSS:\t%8d kB\n", s.VmHWM/1024, s.VmRSS/1024)
	return b.String()
}

// FuzzParseStatus: ParseStatus never panics, and what it accepts it reads
// back the same once written as the kernel writes it.
func FuzzParseStatus(f *testing.F) {
	f.Add([]byte(sample))
	f.Add([]byte("Tgid:\t2\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\nGroups:\t \n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := ParseStatus(b)
		if err != nil {
			return
		}
		if s.Tgid <= 0 || s.VmRSS < 0 || s.VmHWM < 0 || s.VmRSS%1024 != 0 || s.VmHWM%1024 != 0 {
			t.Fatalf("ParseStatus(%q) = %+v", b, s)
		}
		again, err := ParseStatus([]byte(format(s)))
		if err != nil || !reflect.DeepEqual(again, s) {
			t.Fatalf("ParseStatus(%q) = %+v; written and read back: %+v, %v", b, s, again, err)
		}
	})
}

// TestReadFileNeverWaitsForLease: a lease a process's owner holds on its
// own /proc/PID/status makes ReadFile answer EAGAIN at once instead of
// sleeping for lease-break-time; once the lease is gone, it reads.
func TestReadFileNeverWaitsForLease(t *testing.T) {
	fd, err := syscall.Open("/proc/self/status", syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fd)
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETLEASE, unix.F_WRLCK); err != nil {
		t.Skipf("no lease on /proc/self/status: %v", err)
	}
	start := time.Now()
	_, err = ReadFile("/proc/self/status")
	if took := time.Since(start); !errors.Is(err, syscall.EAGAIN) || took > 2*time.Second {
		t.Fatalf("ReadFile of a leased /proc file: %v after %v, want EAGAIN at once", err, took)
	}
	unix.FcntlInt(uintptr(fd), unix.F_SETLEASE, unix.F_UNLCK)
	b, err := ReadFile("/proc/self/status")
	if err != nil {
		t.Fatalf("ReadFile once the lease is gone: %v", err)
	}
	if s, err := ParseStatus(b); err != nil || s.Tgid != os.Getpid() {
		t.Errorf("status read: Tgid %d, %v; want %d", s.Tgid, err, os.Getpid())
	}
}
