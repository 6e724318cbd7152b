package alloc

import (
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Escape returns s as one printable word for a terminal or a
// line-oriented attribute: every byte of a control character (C0, DEL,
// C1), a non-printable or space rune, a backslash or invalid UTF-8 is
// written \xNN. What it returns holds no space, so it can neither forge a
// field or a line nor move a terminal's cursor. Unescape undoes it.
func Escape(s string) string { return escape(s, false) }

// EscapeText is Escape keeping ASCII spaces, for values shown as text
// such as a shape "[2, 3]".
func EscapeText(s string) string { return escape(s, true) }

func escape(s string, keepSpace bool) string {
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == ' ' && keepSpace || r != ' ' && r != '\\' && unicode.IsPrint(r) && (r != utf8.RuneError || n > 1) {
			b.WriteString(s[i : i+n])
		} else {
			for _, c := range []byte(s[i : i+n]) {
				b.WriteString(`\x`)
				b.WriteByte("0123456789abcdef"[c>>4])
				b.WriteByte("0123456789abcdef"[c&15])
			}
		}
		i += n
	}
	return b.String()
}

// Unescape undoes Escape and EscapeText; a backslash that starts no \xNN
// stays as it is.
func Unescape(s string) string {
	if !strings.Contains(s, `\x`) {
		return s
	}
	b := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) && s[i+1] == 'x' {
			if v, err := strconv.ParseUint(s[i+2:i+4], 16, 8); err == nil {
				b = append(b, byte(v))
				i += 3
				continue
			}
		}
		b = append(b, s[i])
	}
	return string(b)
}
