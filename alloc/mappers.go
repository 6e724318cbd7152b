package alloc

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
)

// Mappers returns the pids of processes that map the file with the given
// device and inode number, read from /proc/*/maps. It finds mappings that
// outlive close(), which FUSE passthrough hides from the daemon. Processes
// whose maps cannot be read are skipped.
func Mappers(dev, ino uint64) ([]int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	// maps lines read "addr perms offset MAJ:MIN INODE path"; the device
	// is printed in hex.
	key := []byte(fmt.Sprintf(" %02x:%02x %d ", devMajor(dev), devMinor(dev), ino))
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if mapsContain("/proc/"+e.Name()+"/maps", key) {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

func mapsContain(path string, key []byte) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if bytes.Contains(sc.Bytes(), key) {
			return true
		}
	}
	return false
}

func devMajor(dev uint64) uint64 { return (dev >> 8) & 0xfff }
func devMinor(dev uint64) uint64 { return (dev & 0xff) | ((dev >> 12) & 0xfff00) }
