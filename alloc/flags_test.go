package alloc

import (
	"errors"
	"testing"
)

func TestParseFlags(t *testing.T) {
	good := []struct {
		in   string
		want Flags
	}{
		{"", 0},
		{"  \n", 0},
		{"0", 0},
		{"SHAREDMEM", SharedMem},
		{"sharedmem\n", SharedMem},
		{" SharedMem | unlink ", SharedMem | Unlink},
		{"SHARED|EXCLUSIVE|NOCREATE|KEEPFD|FROMFD|UNLINK", Shared | Exclusive | NoCreate | KeepFD | FromFD | Unlink},
		{"66", SharedMem | Unlink},
		{"2|64", SharedMem | Unlink},
		{"SHAREDMEM|64", SharedMem | Unlink},
		{"UNLINK|UNLINK", Unlink},
		{"125", Shared | Exclusive | NoCreate | KeepFD | FromFD | Unlink},
		{"0002", SharedMem},
	}
	for _, tc := range good {
		got, err := ParseFlags(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("ParseFlags(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
	bad := []string{
		"SHM", "SHARED|", "|SHARED", "A||B", "SHAREDMEM||UNLINK", "|",
		"SHARED|SHAREDMEM", "3", "1|2", "128", "255", "-1", "+2", "0x2",
		"4294967296", "99999999999999999999", "SHARED UNLINK", "SHARED,UNLINK",
		"SHAREDMEM\x00", "2.0", "ſharedmem", "\u212aEEPFD", "²",
	}
	for _, in := range bad {
		if got, err := ParseFlags(in); !errors.Is(err, ErrInvalid) {
			t.Errorf("ParseFlags(%q) = %v, %v; want ErrInvalid", in, got, err)
		}
	}
}

func TestFlagsString(t *testing.T) {
	for _, tc := range []struct {
		f    Flags
		want string
	}{
		{0, ""},
		{SharedMem, "SHAREDMEM"},
		{Unlink | SharedMem, "SHAREDMEM|UNLINK"},
		{Shared | Exclusive | NoCreate | KeepFD | FromFD | Unlink, "SHARED|EXCLUSIVE|NOCREATE|KEEPFD|FROMFD|UNLINK"},
		{SharedMem | 128 | 256, "SHAREDMEM|384"},
	} {
		if got := tc.f.String(); got != tc.want {
			t.Errorf("Flags(%d).String() = %q, want %q", uint32(tc.f), got, tc.want)
		}
	}
}

func TestFlagsRoundTrip(t *testing.T) {
	for f := Flags(0); f <= allFlags; f++ {
		if f&(Shared|SharedMem) == Shared|SharedMem {
			continue
		}
		if got, err := ParseFlags(f.String()); err != nil || got != f {
			t.Errorf("ParseFlags(%q) = %v, %v; want %d", f.String(), got, err, uint32(f))
		}
	}
}

func FuzzParseFlags(f *testing.F) {
	f.Fuzz(func(t *testing.T, s string) {
		flags, err := ParseFlags(s)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("ParseFlags(%q) error %v does not wrap ErrInvalid", s, err)
			}
			return
		}
		if flags&^allFlags != 0 || flags&(Shared|SharedMem) == Shared|SharedMem {
			t.Fatalf("ParseFlags(%q) = %d, an invalid set", s, uint32(flags))
		}
		if again, err := ParseFlags(flags.String()); err != nil || again != flags {
			t.Fatalf("ParseFlags(%q) = %v, %v; want %v", flags.String(), again, err, flags)
		}
	})
}
