package alloc

import (
	"fmt"
	"math/bits"
	"strconv"
	"strings"
)

// Flags is a set of segment modes, with MapAllocator's bit values.
type Flags uint32

// The segment modes of DESIGN.md §3, with MapAllocator's bit values.
const (
	Shared    Flags = 1  // SHARED: data in a file on the persistent disk directory
	SharedMem Flags = 2  // SHAREDMEM: data in shared memory (the backing tmpfs), the default
	Exclusive Flags = 4  // EXCLUSIVE: names in a directory are created exclusively
	NoCreate  Flags = 8  // NOCREATE: nothing new may be created in a directory
	KeepFD    Flags = 16 // KEEPFD: the daemon keeps the fd and hands it out
	FromFD    Flags = 32 // FROMFD: read-only segment adopted from a client's fd
	Unlink    Flags = 64 // UNLINK: the name goes when the reference count falls to zero

	allFlags = Shared | SharedMem | Exclusive | NoCreate | KeepFD | FromFD | Unlink
)

// flagNames holds the name of each bit, indexed by bit position.
var flagNames = [...]string{"SHARED", "SHAREDMEM", "EXCLUSIVE", "NOCREATE", "KEEPFD", "FROMFD", "UNLINK"}

// ParseFlags parses a "|"-separated list of flag names (case-insensitive) or decimal bit
// values, such as "SHAREDMEM|UNLINK", "66" or "sharedmem|64". Whitespace around the value and
// around each element is ignored; an empty value means no flags. Unknown names or bits, empty
// elements and SHARED together with SHAREDMEM are errors wrapping ErrInvalid.
func ParseFlags(s string) (Flags, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, nil
	}
	var f Flags
	for _, elem := range strings.Split(s, "|") {
		g, err := parseFlag(strings.TrimSpace(elem))
		if err != nil {
			return 0, err
		}
		f |= g
	}
	if f&(Shared|SharedMem) == Shared|SharedMem {
		return 0, fmt.Errorf("%w: SHARED and SHAREDMEM are exclusive", ErrInvalid)
	}
	return f, nil
}

// parseFlag parses one element of a flag list: a name or a decimal number.
func parseFlag(elem string) (Flags, error) {
	if elem == "" {
		return 0, fmt.Errorf("%w: empty flag in list", ErrInvalid)
	}
	if elem[0] >= '0' && elem[0] <= '9' {
		n, err := strconv.ParseUint(elem, 10, 32)
		if err != nil {
			return 0, fmt.Errorf("%w: bad flag number %q", ErrInvalid, elem)
		}
		f := Flags(n)
		if f&^allFlags != 0 {
			return 0, fmt.Errorf("%w: unknown flag bits %#x", ErrInvalid, uint32(f&^allFlags))
		}
		return f, nil
	}
	key := lowerASCII(elem)
	for i, name := range flagNames {
		if key == strings.ToLower(name) {
			return 1 << i, nil
		}
	}
	return 0, fmt.Errorf("%w: unknown flag %q", ErrInvalid, elem)
}

// String returns the canonical form of f: flag names in ascending bit order joined with "|",
// "" for no flags. Bits without a name are appended as one decimal number.
func (f Flags) String() string {
	var names []string
	for rest := f & allFlags; rest != 0; rest &= rest - 1 {
		names = append(names, flagNames[bits.TrailingZeros32(uint32(rest))])
	}
	if unknown := f &^ allFlags; unknown != 0 {
		names = append(names, strconv.FormatUint(uint64(unknown), 10))
	}
	return strings.Join(names, "|")
}

// lowerASCII lower-cases the ASCII letters of s and nothing else, so that no Unicode folding
// ("ſ" to "s", the Kelvin sign to "k") lets an odd spelling through.
func lowerASCII(s string) string {
	return strings.Map(func(r rune) rune {
		if 'A' <= r && r <= 'Z' {
			return r + 'a' - 'A'
		}
		return r
	}, s)
}
