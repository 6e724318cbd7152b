package alloc

import (
	"errors"
	"fmt"
	"strings"

	"golang.org/x/sys/unix"
)

// Names of the attributes tensorfs gives meaning to (DESIGN.md §4).
const (
	AttrFlags     = "user.tensorfs.flags"
	AttrDevice    = "user.tensorfs.device"
	AttrDtype     = "user.tensor.dtype"
	AttrShape     = "user.tensor.shape"
	AttrStride    = "user.tensor.stride"
	AttrOffset    = "user.tensor.storage_offset"
	AttrRefcount  = "user.tensorfs.refcount"
	AttrHolders   = "user.tensorfs.holders"
	AttrHandle    = "user.tensorfs.handle"
	AttrRbytes    = "user.tensorfs.rbytes"
	AttrRsegments = "user.tensorfs.rsegments"
	AttrSocket    = "user.tensorfs.socket"
	AttrStats     = "user.tensorfs.stats"
	AttrCluster   = "user.tensorfs.cluster"

	AttrCudaIPCHandle   = "user.tensorfs.cuda.ipc_handle"
	AttrCudaOffset      = "user.tensorfs.cuda.offset"
	AttrCudaEventHandle = "user.tensorfs.cuda.event_handle"
	AttrCudaRefCounter  = "user.tensorfs.cuda.ref_counter"
)

// The flags and the device are the daemon's state as much as the markers
// (marker.go) are: recovery and the last close remove an UNLINK segment's
// name, ReadMarker takes a device for a marker, export obeys KEEPFD and
// FROMFD. A peer of the control socket holds a descriptor of a backing
// file itself (export, load), on which the kernel lets every writer of
// the file set user.* attributes; so they are stored under internal
// names (internalAttr: trusted.* when the daemon is root), and the mount
// shows them as AttrFlags and AttrDevice. A backing written by a root
// daemon that stored them as user.* loses them: they are never read
// (DESIGN.md §4).
var (
	attrFlags  = internalAttr("flags")
	attrDevice = internalAttr("device")
)

// StoredName returns the name under which the attribute name is stored on
// a backing object: the daemon's own for the flags and the device, name
// itself for every other.
func StoredName(name string) string {
	switch name {
	case AttrFlags:
		return attrFlags
	case AttrDevice:
		return attrDevice
	}
	return name
}

// ReadOnlyAttr reports whether clients may not write name: every
// user.tensorfs.* name but the flags and the device is computed by
// tensorfs or reserved for it.
func ReadOnlyAttr(name string) bool {
	switch name {
	case AttrFlags, AttrDevice:
		return false
	}
	return ownAttr(name)
}

// ownAttr reports whether name is tensorfs's: its internal state, or a
// user.tensorfs.* name, which the mount computes or reads through
// StoredName. What a backing file holds under such a user.* name was not
// stored by the daemon (a peer holding a descriptor of the file, or an
// older daemon, stored it) and is neither served nor listed.
func ownAttr(name string) bool {
	return strings.HasPrefix(name, "user.tensorfs.") || InternalAttr(name)
}

// Object is a backing file or directory as the attribute functions see it.
type Object struct {
	// Path reaches the object through /proc/self/fd (see the package doc).
	Path string
	// Dir is true for directories.
	Dir bool
	// Size is the segment's size in bytes (0 for directories).
	Size int64
	// HasDisk is true when the mount has a --disk directory.
	HasDisk bool
	// GPU names the device the mount serves ("cuda:0"), "" for none.
	GPU string
}

// Getxattr reads a stored attribute into dest (sized like getxattr(2):
// a zero-length dest asks for the size). tensorfs's own names are never
// read as stored (see ownAttr).
func Getxattr(path, name string, dest []byte) (int, error) {
	if ownAttr(name) {
		return 0, ErrNoAttr
	}
	n, err := unix.Getxattr(path, name, dest)
	if errors.Is(err, unix.ENODATA) {
		return 0, ErrNoAttr
	}
	return n, err
}

// ReadFlags returns the flags stored on the object at path; none stored is 0.
func ReadFlags(path string) (Flags, error) {
	v, err := readAttr(path, StoredName(AttrFlags))
	if err != nil || v == "" {
		return 0, err
	}
	return ParseFlags(v)
}

// readAttr returns a stored attribute as a string, "" when it is absent.
func readAttr(path, name string) (string, error) {
	v, _, err := GetXattr(path, name)
	return string(v), err
}

// Setxattr validates and stores an attribute. tensorfs's own names are
// parsed and stored in canonical form; other names are stored verbatim.
// Refusals change nothing and say why: ErrReadOnly, ErrInvalid,
// ErrNotEmpty, ErrNoDisk, ErrNoDevice.
func Setxattr(obj Object, name string, value []byte, flags int) error {
	if ReadOnlyAttr(name) {
		return fmt.Errorf("%w: %s is computed by tensorfs", ErrReadOnly, name)
	}
	switch {
	case name == AttrFlags:
		return setFlags(obj, string(value), flags)
	case name == AttrDevice:
		return setDevice(obj, string(value))
	case TensorAttr(name):
		cur, err := ReadLayout(obj.Path)
		if errors.Is(err, ErrBadStored) {
			err = nil // a valid value replaces a bad one
		}
		if err == nil {
			_, err = SetTensorAttr(obj, cur, name, value, flags)
		}
		return err
	}
	return unix.Setxattr(obj.Path, name, value, flags)
}

func setFlags(obj Object, v string, xflags int) error {
	f, err := ParseFlags(v)
	if err != nil {
		return err
	}
	old, err := ReadFlags(obj.Path)
	if err != nil {
		return err
	}
	switch {
	case f&FromFD != old&FromFD:
		return fmt.Errorf("%w: FROMFD is set only by the import operation", ErrReadOnly)
	case f&Shared != 0 && !obj.HasDisk:
		return fmt.Errorf("%w: SHARED segments live under --disk, and this mount has none", ErrNoDisk)
	case !obj.Dir && f&(Exclusive|NoCreate) != 0:
		return fmt.Errorf("%w: EXCLUSIVE and NOCREATE apply to directories", ErrInvalid)
	case !obj.Dir && f&Shared != old&Shared:
		return fmt.Errorf("%w: SHARED is chosen when a segment is created; set it on the directory", ErrInvalid)
	case !obj.Dir && f != old && obj.Size > 0:
		return fmt.Errorf("%w: flags of a segment are set while it is empty (it has %d bytes)", ErrNotEmpty, obj.Size)
	}
	return storeFlags(obj.Path, f, xflags)
}

// storeFlags writes f in canonical form; 0 removes the attribute.
func storeFlags(path string, f Flags, xflags int) error {
	v := ""
	if f != 0 {
		v = f.String()
	}
	return storeOrRemove(path, StoredName(AttrFlags), v, xflags)
}

// storeOrRemove sets the attribute name of the object at path to v, with
// setxattr's xflags, or removes it when v is empty (none there is no
// error).
func storeOrRemove(path, name, v string, xflags int) error {
	if v == "" {
		err := unix.Removexattr(path, name)
		if errors.Is(err, unix.ENODATA) {
			return nil
		}
		return err
	}
	return unix.Setxattr(path, name, []byte(v), xflags)
}

// setDevice stores a segment's or directory's device: cpu, the default,
// is stored as no attribute; cuda:N only when the mount serves that
// device. A segment changes device only while it is empty.
func setDevice(obj Object, v string) error {
	dev, ok := ParseDevice(v)
	switch {
	case !ok:
		return fmt.Errorf("%w: device %q is neither cpu nor cuda:N", ErrInvalid, strings.TrimSpace(v))
	case dev != "cpu" && dev != obj.GPU:
		if obj.GPU == "" {
			return fmt.Errorf("%w: %s: this mount serves no GPU (mount with --gpu sim or --gpu cuda)", ErrNoDevice, dev)
		}
		return fmt.Errorf("%w: %s: this mount serves %s only", ErrNoDevice, dev, obj.GPU)
	}
	if !obj.Dir && obj.Size > 0 {
		cur, err := ReadDevice(obj.Path)
		if err != nil {
			return err
		}
		if cur != dev {
			return fmt.Errorf("%w: the device of a segment is set while it is empty", ErrNotEmpty)
		}
	}
	return StoreDevice(obj.Path, dev)
}

// canonicalTensorAttr parses a dtype/shape/stride/offset value and returns
// its canonical spelling.
func canonicalTensorAttr(name, v string) (string, error) {
	switch name {
	case AttrDtype:
		d, err := ParseDtype(v)
		return d.Name, err
	case AttrShape, AttrStride:
		dims, err := ParseShape(v)
		return FormatShape(dims), err
	default:
		off, err := ParseOffset(v)
		return fmt.Sprint(off), err
	}
}

// Layout is a segment's stored tensor attributes (dtype, shape, stride,
// storage offset) in canonical form, "" where one is absent.
type Layout struct {
	Dtype, Shape, Stride, Offset string
}

// TensorAttr reports whether name is one of the attributes of a Layout.
func TensorAttr(name string) bool {
	switch name {
	case AttrDtype, AttrShape, AttrStride, AttrOffset:
		return true
	}
	return false
}

// field returns the Layout's field for a TensorAttr name.
func (l *Layout) field(name string) *string {
	switch name {
	case AttrDtype:
		return &l.Dtype
	case AttrShape:
		return &l.Shape
	case AttrStride:
		return &l.Stride
	}
	return &l.Offset
}

// Get returns the stored value of a TensorAttr name, "" when absent.
func (l Layout) Get(name string) string { return *l.field(name) }

// With returns l with name set to v ("" removes it).
func (l Layout) With(name, v string) Layout {
	*l.field(name) = v
	return l
}

// ReadLayout reads the tensor attributes stored on the object at path:
// one listing, then only the names that are there. Every value is checked
// as SetTensorAttr checks it, whoever stored it (a peer that holds a
// descriptor of the backing file can store anything): a value that does
// not parse is left out, and so is the whole layout when the values do
// not lay out a tensor together. Then the layout holds what passed, in
// canonical form, and the error, wrapping ErrBadStored, says what was
// left out and why; a caller serves the layout and logs the error.
func ReadLayout(path string) (Layout, error) {
	var l Layout
	stored, err := Listxattr(path)
	if err != nil {
		return l, err
	}
	var bad []string
	for _, name := range stored {
		if !TensorAttr(name) {
			continue
		}
		v, err := readAttr(path, name)
		if err != nil {
			return Layout{}, err
		}
		if *l.field(name), err = canonicalTensorAttr(name, v); err != nil {
			*l.field(name) = ""
			bad = append(bad, fmt.Sprintf("%s %q: %v", name, v, err))
		}
	}
	if err := checkLayout(l, 0, "", ""); err != nil {
		bad = append(bad, fmt.Sprintf("dtype %q shape %q stride %q offset %q together: %v", l.Dtype, l.Shape, l.Stride, l.Offset, err))
		l = Layout{}
	}
	if bad != nil {
		return l, fmt.Errorf("%w, not served: %s", ErrBadStored, strings.Join(bad, "; "))
	}
	return l, nil
}

// SetTensorAttr validates a dtype/shape/stride/offset value against the
// segment's size and the rest of its stored layout cur, stores it in
// canonical form on the object at obj.Path, and returns the new layout.
// A refusal (ErrInvalid) changes nothing.
func SetTensorAttr(obj Object, cur Layout, name string, value []byte, flags int) (Layout, error) {
	if obj.Dir {
		return cur, fmt.Errorf("%w: %s applies to segments, not directories", ErrInvalid, name)
	}
	v, err := canonicalTensorAttr(name, string(value))
	if err != nil {
		return cur, err
	}
	next := cur.With(name, v)
	if err := checkLayout(next, obj.Size, name, v); err != nil {
		return cur, err
	}
	if err := unix.Setxattr(obj.Path, name, []byte(v), flags); err != nil {
		return cur, err
	}
	return next, nil
}

// checkLayout refuses a layout that reaches past the segment's size bytes;
// name and v are the attribute being set, for the message.
func checkLayout(l Layout, size int64, name, v string) error {
	if l.Shape == "" {
		return nil // nothing to lay out yet
	}
	shape, _ := ParseShape(l.Shape)
	dtype := Dtype{Name: "uint8", Size: 1}
	var err error
	if l.Dtype != "" {
		if dtype, err = ParseDtype(l.Dtype); err != nil {
			return err
		}
	}
	var stride []int64
	if l.Stride != "" {
		if stride, err = ParseShape(l.Stride); err != nil {
			return err
		}
	}
	var offset int64
	if l.Offset != "" {
		if offset, err = ParseOffset(l.Offset); err != nil {
			return err
		}
	}
	extent, err := Extent(dtype, shape, stride, offset)
	if err != nil {
		return err
	}
	if size > 0 && extent > size {
		return fmt.Errorf("%w: %s %s lays out %d bytes, the segment has %d", ErrInvalid, name, v, extent, size)
	}
	return nil
}

// Listxattr returns the user.* names stored on the object at path, less
// tensorfs's own (ownAttr).
func Listxattr(path string) ([]string, error) {
	all, err := listNames(path)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, s := range all {
		if strings.HasPrefix(s, "user.") && !ownAttr(s) {
			names = append(names, s)
		}
	}
	return names, nil
}

// listNames returns every attribute name stored on the object at path
// that the daemon may see (trusted.* too when it is root).
func listNames(path string) ([]string, error) {
	buf := make([]byte, 1024)
	for {
		n, err := unix.Listxattr(path, buf)
		if errors.Is(err, unix.ERANGE) {
			buf = make([]byte, 2*len(buf))
			continue
		}
		if err != nil {
			return nil, err
		}
		var names []string
		for _, s := range strings.Split(string(buf[:n]), "\x00") {
			if s != "" {
				names = append(names, s)
			}
		}
		return names, nil
	}
}

// Removexattr removes a stored attribute; tensorfs's read-only names
// cannot be removed.
func Removexattr(path, name string) error {
	if ReadOnlyAttr(name) {
		return fmt.Errorf("%w: %s is computed by tensorfs", ErrReadOnly, name)
	}
	err := unix.Removexattr(path, StoredName(name))
	if errors.Is(err, unix.ENODATA) {
		return ErrNoAttr
	}
	return err
}

// InheritFlags stores on a new child the flags it inherits from its parent
// directory: a directory inherits them all, a segment its storage modes
// (and FROMFD, which only the import operation passes).
func InheritFlags(parent Flags, childPath string, dir bool) error {
	f := parent
	if !dir {
		f &= SharedMem | Shared | Unlink | KeepFD | FromFD
	}
	if f == 0 {
		return nil
	}
	return storeFlags(childPath, f, 0)
}

// GetXattr reads the extended attribute name of the file at path whole
// (any file: clients use it on the mount); ok is false when it is absent
// or the filesystem has none.
func GetXattr(path, name string) (v []byte, ok bool, err error) {
	buf := make([]byte, 256)
	for {
		n, err := unix.Getxattr(path, name, buf)
		switch {
		case errors.Is(err, unix.ENODATA), errors.Is(err, unix.ENOTSUP):
			return nil, false, nil
		case errors.Is(err, unix.ERANGE):
			if n, err = unix.Getxattr(path, name, nil); err != nil {
				return nil, false, err
			}
			buf = make([]byte, n+256) // it may grow meanwhile
			continue
		case err != nil:
			return nil, false, err
		}
		return buf[:n], true, nil
	}
}
