package transfer

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os"
	"strconv"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// listxattr returns the names of path's extended attributes.
func listxattr(path string) ([]string, error) {
	for {
		n, err := unix.Listxattr(path, nil)
		if err != nil {
			if errors.Is(err, unix.ENOTSUP) {
				return nil, nil
			}
			return nil, err
		}
		buf := make([]byte, n+256)
		n, err = unix.Listxattr(path, buf)
		if errors.Is(err, unix.ERANGE) {
			continue
		}
		if err != nil {
			return nil, err
		}
		var names []string
		for _, b := range bytes.Split(buf[:n], []byte{0}) {
			if len(b) > 0 {
				names = append(names, string(b))
			}
		}
		return names, nil
	}
}

// setChunks adds value to attrs under name, split into NAME, NAME.1,
// NAME.2... of at most xattrSizeMax bytes each.
func setChunks(attrs map[string][]byte, name string, value []byte) {
	for i := 0; i == 0 || len(value) > 0; i++ {
		n := min(len(value), xattrSizeMax)
		key := name
		if i > 0 {
			key += "." + strconv.Itoa(i)
		}
		attrs[key] = value[:n]
		value = value[n:]
	}
}

// getChunks reads an attribute that setChunks split; ok is false when it
// is absent.
func getChunks(path, name string) (value []byte, ok bool, err error) {
	for i := 0; ; i++ {
		key := name
		if i > 0 {
			key += "." + strconv.Itoa(i)
		}
		v, ok, err := alloc.GetXattr(path, key)
		if err != nil || (!ok && i == 0) {
			return nil, false, err
		}
		value = append(value, v...)
		if !ok || len(v) < xattrSizeMax {
			return value, true, nil
		}
	}
}

// marshalJSON encodes v as JSON without HTML escaping.
func marshalJSON(v any) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimRight(b.Bytes(), "\n"), nil
}

// readDirNames returns up to n names in dir (all for n <= 0), unsorted.
func readDirNames(dir string, n int) ([]string, error) {
	d, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	names, err := d.Readdirnames(n)
	if errors.Is(err, io.EOF) {
		err = nil
	}
	return names, err
}
