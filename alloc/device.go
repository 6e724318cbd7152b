package alloc

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// A device segment's bytes live in GPU memory while it is mounted; its
// backing file stays empty and records the device (attrDevice), the
// segment's size (attrDevSize: "SIZE", or "SIZE:BLOCK" while mounted,
// BLOCK naming its block of the GPU helper's, for a successor: DESIGN.md
// §12) and, after a clean unmount spilled the bytes into the backing
// file, attrSpilled.
var (
	attrDevSize = internalAttr("devsize")
	attrSpilled = internalAttr("spilled")
)

// ReadDevice returns the device stored on the backing object at path:
// "cpu" when none is.
func ReadDevice(path string) (string, error) {
	v, err := readAttr(path, StoredName(AttrDevice))
	if err != nil || v == "" {
		return "cpu", err
	}
	return v, nil
}

// StoreDevice records the device dev (canonical, ParseDevice) of the
// backing object at path: cpu, the default, as no attribute.
func StoreDevice(path, dev string) error {
	if dev == "cpu" {
		dev = ""
	}
	return storeOrRemove(path, StoredName(AttrDevice), dev, 0)
}

// ParseDevice returns the canonical name of a device value: "cpu" or
// "cuda:N" ("cuda" is "cuda:0").
func ParseDevice(v string) (string, bool) {
	dev := strings.TrimSpace(v)
	switch {
	case dev == "cpu":
		return dev, true
	case dev == "cuda":
		return "cuda:0", true
	case strings.HasPrefix(dev, "cuda:"):
		n, err := strconv.ParseUint(dev[len("cuda:"):], 10, 16)
		return "cuda:" + strconv.FormatUint(n, 10), err == nil
	}
	return "", false
}

// DeviceState is what a device segment's backing file records.
type DeviceState struct {
	// Size is the segment's size in bytes.
	Size int64
	// Spilled is true when the backing file holds the bytes (a clean
	// unmount); false after a crash, when they are lost.
	Spilled bool
	// Block is the ID of the segment's block of device memory while
	// mounted (0 for none): a successor's to claim from the helper.
	Block uint64
}

// ReadDeviceState reads the device segment state stored at path.
func ReadDeviceState(path string) (DeviceState, error) {
	var ds DeviceState
	v, err := readAttr(path, attrDevSize)
	if err != nil {
		return ds, err
	}
	if v != "" {
		size, block, hasBlock := strings.Cut(v, ":")
		if ds.Size, err = strconv.ParseInt(size, 10, 64); err != nil || ds.Size < 0 {
			return ds, fmt.Errorf("%w: device segment size %q", ErrInvalid, v)
		}
		if hasBlock {
			if ds.Block, err = strconv.ParseUint(block, 10, 64); err != nil {
				return ds, fmt.Errorf("%w: device segment size %q", ErrInvalid, v)
			}
		}
	}
	v, err = readAttr(path, attrSpilled)
	ds.Spilled = v == "1"
	return ds, err
}

// WriteDeviceState records a device segment's state at path.
func WriteDeviceState(path string, ds DeviceState) error {
	v := strconv.FormatInt(ds.Size, 10)
	if ds.Block != 0 {
		v += ":" + strconv.FormatUint(ds.Block, 10)
	}
	if err := unix.Setxattr(path, attrDevSize, []byte(v), 0); err != nil {
		return err
	}
	if ds.Spilled {
		return unix.Setxattr(path, attrSpilled, []byte("1"), 0)
	}
	if err := unix.Removexattr(path, attrSpilled); err != nil && !errors.Is(err, unix.ENODATA) {
		return err
	}
	return nil
}
