package alloc

import (
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"
)

func TestEscape(t *testing.T) {
	for _, c := range []struct{ in, word, text string }{
		{"python3", "python3", "python3"},
		{"", "", ""},
		{"x\n1 systemd 9", `x\x0a1\x20systemd\x209`, `x\x0a1 systemd 9`},
		{"\x1b[2J\a", `\x1b[2J\x07`, `\x1b[2J\x07`},
		{"a\\b\x7f", `a\x5cb\x7f`, `a\x5cb\x7f`},
		{"[2, 3]", `[2,\x203]`, "[2, 3]"},
		{"tab\there", `tab\x09here`, `tab\x09here`},
		{"\xff\xfe", `\xff\xfe`, `\xff\xfe`},
		{"naïve 日本", `naïve\x20日本`, "naïve 日本"},
		{"\u009b31m", `\xc2\x9b31m`, `\xc2\x9b31m`},                               // C1 CSI
		{"a\u202eb\u00a0c", `a\xe2\x80\xaeb\xc2\xa0c`, `a\xe2\x80\xaeb\xc2\xa0c`}, // bidi override, no-break space
		{"\ufffd", "\ufffd", "\ufffd"},                                            // a real U+FFFD is printable
	} {
		if got := Escape(c.in); got != c.word {
			t.Errorf("Escape(%q) = %q, want %q", c.in, got, c.word)
		}
		if got := EscapeText(c.in); got != c.text {
			t.Errorf("EscapeText(%q) = %q, want %q", c.in, got, c.text)
		}
		if got := Unescape(c.word); got != c.in {
			t.Errorf("Unescape(%q) = %q, want %q", c.word, got, c.in)
		}
	}
	for in, want := range map[string]string{`\x`: `\x`, `\x4`: `\x4`, `\xzz1`: `\xzz1`, `\x41\`: `A\`, `\\x41`: `\A`} {
		if got := Unescape(in); got != want {
			t.Errorf("Unescape(%q) = %q, want %q", in, got, want)
		}
	}
}

// FuzzEscape: whatever the input, the escaped forms are printable UTF-8
// without control characters, Escape's is a single field, and Unescape
// gives the input back.
func FuzzEscape(f *testing.F) {
	for _, s := range []string{"python3", "x\n1 systemd 9", "\x1b]0;t\a", "a\\x41", "\xc3", "\u2028 \u0085"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		word, text := Escape(s), EscapeText(s)
		for _, e := range []string{word, text} {
			if !utf8.ValidString(e) {
				t.Fatalf("escape of %q is not UTF-8: %q", s, e)
			}
			for _, r := range e {
				if !unicode.IsPrint(r) {
					t.Fatalf("escape of %q holds %U: %q", s, r, e)
				}
			}
			if got := Unescape(e); got != s {
				t.Fatalf("Unescape(%q) = %q, want %q", e, got, s)
			}
		}
		if s != "" && len(strings.Fields(word)) != 1 || strings.Contains(word, " ") {
			t.Fatalf("Escape(%q) = %q is not one field", s, word)
		}
	})
}
