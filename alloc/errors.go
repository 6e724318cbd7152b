package alloc

import (
	"errors"

	"tensorfs/fdpass"
)

// Sentinel errors returned by the store. Callers match them with errors.Is;
// the front end maps each to one errno.
var (
	// ErrInvalid is returned when an xattr value or flag set does not parse
	// or does not fit the segment (EINVAL).
	ErrInvalid = errors.New("invalid value")
	// ErrReadOnly is returned when a client writes a read-only attribute or
	// opens a FROMFD segment for writing (EPERM).
	ErrReadOnly = errors.New("read-only")
	// ErrNotEmpty is returned when flags or device are set on a segment
	// that already has bytes (EBUSY).
	ErrNotEmpty = errors.New("segment is not empty")
	// ErrExists is returned when a name in an EXCLUSIVE directory would be
	// created or truncated a second time (EEXIST).
	ErrExists = errors.New("exists in an EXCLUSIVE directory")
	// ErrNoCreate is returned when something would be created in a NOCREATE
	// directory (EPERM).
	ErrNoCreate = errors.New("directory is NOCREATE")
	// ErrNoDisk is returned when a SHARED segment is asked for but the
	// mount has no --disk directory (EOPNOTSUPP).
	ErrNoDisk = errors.New("SHARED needs --disk")
	// ErrNoDevice is returned when a device other than cpu is asked for
	// and no GPU backend serves it (EOPNOTSUPP).
	ErrNoDevice = errors.New("device not available")
	// ErrTooBig is returned when a segment would grow past MaxSegmentSize (EFBIG).
	ErrTooBig = errors.New("segment too large")
	// ErrNoSpace is returned when the backing cannot reserve the pages a
	// segment grows to (ENOSPC).
	ErrNoSpace = errors.New("no space left in the backing store")
	// ErrBadStored is returned, together with what passed, when a tensor
	// attribute stored on a backing file fails the check its write through
	// the mount has: a peer holding a descriptor of the file (export, load)
	// can store any user.* value there. What fails is not served.
	ErrBadStored = errors.New("stored attribute fails validation")
	// ErrNoAttr is returned when an attribute does not exist (ENODATA).
	ErrNoAttr = errors.New("no such attribute")
	// ErrLeased is returned when a lease on a backing file (its owner's,
	// taken through a descriptor of it) stands in the way of an open: the
	// daemon never waits for one to break (fdpass.OpenNoWait; EAGAIN).
	ErrLeased = fdpass.ErrLeased
)
