package alloc

import (
	"errors"
	"fmt"
	"os"
	"runtime/debug"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// treeRoots are the directories a Tree test runs in: the test's temporary
// directory and, where there is one, a tmpfs like the backing's.
func treeRoots(t *testing.T) map[string]string {
	roots := map[string]string{"tempdir": t.TempDir()}
	if dir, err := os.MkdirTemp("/dev/shm", "tree-test-"); err == nil {
		t.Cleanup(func() {
			if err := RemoveTree(dir); err != nil {
				t.Error(err)
			}
		})
		roots["tmpfs"] = dir
	}
	return roots
}

// chain makes depth directories named name, each in the one before,
// below the directory open at fd, calls at with each one's descriptor and
// depth (1 first), and returns how many objects at made.
func chain(t *testing.T, fd, depth int, name string, at func(fd, depth int) int) int {
	t.Helper()
	fd, err := unix.Dup(fd)
	if err != nil {
		t.Fatal(err)
	}
	made := 0
	for i := 1; i <= depth; i++ {
		if err := unix.Mkdirat(fd, name, 0o755); err != nil {
			t.Fatal(err)
		}
		next, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			t.Fatal(err)
		}
		fd = next
		made += 1 + at(fd, i)
	}
	unix.Close(fd)
	return made
}

// touch makes the empty file name in the directory open at fd.
func touch(t *testing.T, fd int, name string) {
	t.Helper()
	f, err := unix.Openat(fd, name, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(f)
}

// openFds is how many descriptors the process has open.
func openFds(t *testing.T) int {
	names, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(names)
}

// TestTreeDeep: Tree reaches every object of a chain deeper than
// MaxDepth (where Walk stops), each once, with its parent and path,
// holding one descriptor of its own; it goes on in each directory where
// it left it, in a directory of more names than one read returns.
func TestTreeDeep(t *testing.T) {
	const depth = MaxDepth + 44
	for kind, root := range treeRoots(t) {
		t.Run(kind, func(t *testing.T) {
			rootFd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(rootFd)
			made := 0
			for i := 0; i < 300; i++ {
				touch(t, rootFd, fmt.Sprintf("file%03d-%s", i, strings.Repeat("n", 40)))
				made++
			}
			made += chain(t, rootFd, depth, "d", func(fd, level int) int {
				n := 0
				for i := 0; i < level%3; i++ {
					touch(t, fd, fmt.Sprintf("f%d", i))
					n++
				}
				if level%100 == 0 {
					n += chain(t, fd, 2, "side", func(fd, _ int) int { touch(t, fd, "s"); return 1 })
				}
				if level == depth {
					touch(t, fd, "bottom")
					n++
				}
				return n
			})
			if err := Walk(rootFd, func(int, string, string, *unix.Stat_t) error { return nil }); err != ErrTooDeep {
				t.Fatalf("Walk: %v, want ErrTooDeep: the chain is not past its limit", err)
			}

			base := openFds(t)
			seen := map[uint64]int{}
			calls, fds := 0, 0
			err = Tree(rootFd, func(e *Entry) error {
				calls++
				seen[e.Stat.Ino]++
				var dir unix.Stat_t
				if err := unix.Fstat(e.Dirfd, &dir); err != nil {
					return err
				}
				top := !strings.Contains(e.Rel(), "/")
				if top && e.Parent != 0 || !top && e.Parent != dir.Ino {
					t.Errorf("%s: parent %d, its directory is %d", e.Rel(), e.Parent, dir.Ino)
				}
				if e.Name == "bottom" {
					fds = openFds(t)
					if want := strings.TrimSuffix(strings.Repeat("d/", depth), "/") + "/bottom"; e.Rel() != want {
						t.Errorf("bottom: Rel %d bytes, want %d", len(e.Rel()), len(want))
					}
					if want := ".../" + strings.Repeat("d/", LogDepth-1) + "bottom"; e.Tail() != want {
						t.Errorf("bottom: Tail %q, want its last %d components", e.Tail(), LogDepth)
					}
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if calls != made || len(seen) != made {
				t.Errorf("Tree called fn %d times for %d objects; %d were made", calls, len(seen), made)
			}
			if fds == 0 || fds > base+1 {
				t.Errorf("at the bottom, %d descriptors open, %d before the walk: it holds more than one", fds, base)
			}
		})
	}
}

// TestTreeSkipDir: ErrSkipDir for a directory leaves its contents, and
// the walk goes on past it; fn's own error stops it, as it is.
func TestTreeSkipDir(t *testing.T) {
	root := t.TempDir()
	for _, p := range []string{"a/in", "b/in", "c"} {
		if err := os.MkdirAll(root+"/"+p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	var got []string
	err = Tree(fd, func(e *Entry) error {
		got = append(got, e.Rel())
		if e.Name == "b" {
			return ErrSkipDir
		}
		return nil
	})
	if err != nil || len(got) != 4 || strings.Contains(strings.Join(got, " "), "b/in") {
		t.Errorf("Tree: %v, visited %q; want a, a/in, b and c", err, got)
	}
	stop := fmt.Errorf("stop")
	if err := Tree(fd, func(*Entry) error { return stop }); err != stop {
		t.Errorf("Tree: %v, want fn's error", err)
	}
}

// TestTreeNoRecursion: Tree and RemoveTree go through a chain thousands
// deep on a stack far smaller than one frame per level would take.
func TestTreeNoRecursion(t *testing.T) {
	const depth = 3000
	roots := treeRoots(t)
	root, ok := roots["tmpfs"]
	if !ok {
		root = roots["tempdir"]
	}
	fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	made := chain(t, fd, depth, "d", func(int, int) int { return 0 })
	defer debug.SetMaxStack(debug.SetMaxStack(256 << 10))
	n := 0
	if err := Tree(fd, func(*Entry) error { n++; return nil }); err != nil || n != made {
		t.Errorf("Tree: %v after %d objects; %d were made", err, n, made)
	}
	if err := RemoveTree(root + "/d"); err != nil {
		t.Fatal(err)
	}
}

// TestTreeCut: a directory moved while the walk is below it cuts the walk
// (it cannot go back up to where it was): a *CutError, never a quiet end.
func TestTreeCut(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(root+"/a/b/c", 0o755); err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	err = Tree(fd, func(e *Entry) error {
		if e.Name == "c" {
			return os.Rename(root+"/a/b", root+"/moved")
		}
		return nil
	})
	var cut *CutError
	if !errors.As(err, &cut) || !errors.Is(err, unix.ESTALE) {
		t.Errorf("Tree: %v, want a *CutError (ESTALE)", err)
	}
}

// TestTreeRemoves: fn may remove what it is called for, as recovery
// does, and rename the directory the walk is in: every name made is
// visited once (the walk finds its place again in the directory above,
// by its name, or after its offset once the name is gone), the renamed
// directory at most once more under its new name.
func TestTreeRemoves(t *testing.T) {
	for kind, root := range treeRoots(t) {
		t.Run(kind, func(t *testing.T) {
			made := map[string]bool{}
			for i := 0; i < 40; i++ {
				name := fmt.Sprintf("%s/f%d", root, i)
				if i%4 == 0 {
					name = fmt.Sprintf("%s/d%d", root, i)
					if err := os.Mkdir(name, 0o755); err != nil {
						t.Fatal(err)
					}
					made[name] = true
					name += "/in"
				}
				if err := os.WriteFile(name, nil, 0o644); err != nil {
					t.Fatal(err)
				}
				made[name] = true
			}
			fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(fd)
			seen := map[string]int{}
			err = Tree(fd, func(e *Entry) error {
				p := root + "/" + e.Rel()
				seen[p]++
				if e.Stat.Mode&unix.S_IFMT == unix.S_IFDIR {
					return nil
				}
				if err := unix.Unlinkat(e.Dirfd, e.Name, 0); err != nil {
					return err
				}
				if e.Rel() == "d0/in" {
					return os.Rename(root+"/d0", root+"/moved")
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			for p := range made {
				if seen[p] != 1 {
					t.Errorf("%s visited %d times", p, seen[p])
				}
			}
			delete(seen, root+"/moved")
			if len(seen) != len(made) {
				t.Errorf("%d names visited, %d made", len(seen), len(made))
			}
		})
	}
}
