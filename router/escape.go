package router

import (
	"fmt"
	"strings"
)

// escapeEmpty is the escaped form of the empty string. A subject token can
// never be empty, and "~" alone can never come out of escaping a non-empty
// value (a lone "~" would otherwise be followed by two hex digits), so the
// mapping stays reversible.
const escapeEmpty = "~"

const hexDigits = "0123456789ABCDEF"

// safeByte reports whether b passes through escaping unchanged: ASCII
// letters, digits, '_' and '-'. Everything else, including '~', '.', '*',
// '>', whitespace and every byte of a multi-byte UTF-8 sequence, is escaped.
var safeByte = func() (t [256]bool) {
	for c := 'a'; c <= 'z'; c++ {
		t[c] = true
	}
	for c := 'A'; c <= 'Z'; c++ {
		t[c] = true
	}
	for c := '0'; c <= '9'; c++ {
		t[c] = true
	}
	t['_'] = true
	t['-'] = true
	return t
}()

// EscapeToken returns s in a form that is safe inside one NATS subject
// token: bytes in [A-Za-z0-9_-] are kept, every other byte becomes '~'
// followed by its value in two upper-case hex digits ("." is "~2E", "~" is
// "~7E", "é" is "~C3~A9"), and the empty string becomes a lone "~". The
// result never contains '.', '*', '>' or whitespace, so a value can never
// add, remove or wildcard a subject token. UnescapeToken reverses it.
func EscapeToken(s string) string {
	if s == "" {
		return escapeEmpty
	}
	n := escapedLen(s)
	if n == len(s) {
		return s
	}
	// One allocation: the Builder hands its buffer over as the string.
	var b strings.Builder
	b.Grow(n)
	start := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if safeByte[c] {
			continue
		}
		b.WriteString(s[start:i])
		b.Write([]byte{'~', hexDigits[c>>4], hexDigits[c&0x0F]})
		start = i + 1
	}
	b.WriteString(s[start:])
	return b.String()
}

// text is what the escaping helpers accept: Route passes column bytes
// without converting them to strings.
type text interface{ ~string | ~[]byte }

// escapedLen returns len(EscapeToken(s)) without building it.
func escapedLen[T text](s T) int {
	if len(s) == 0 {
		return len(escapeEmpty)
	}
	n := len(s)
	for i := 0; i < len(s); i++ {
		if !safeByte[s[i]] {
			n += 2
		}
	}
	return n
}

// appendEscaped appends EscapeToken(s) to dst without an intermediate
// string; Route builds subjects with it.
func appendEscaped[T text](dst []byte, s T) []byte {
	if len(s) == 0 {
		return append(dst, escapeEmpty...)
	}
	return appendEscapedN(dst, s)
}

func appendEscapedN[T text](dst []byte, s T) []byte {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if safeByte[c] {
			dst = append(dst, c)
			continue
		}
		dst = append(dst, '~', hexDigits[c>>4], hexDigits[c&0x0F])
	}
	return dst
}

// UnescapeToken reverses EscapeToken. It accepts only the canonical form
// EscapeToken produces (upper-case hex, no escaped safe bytes, "~" alone only
// for the empty string), so each value has exactly one escaped form and
// comparing escaped tokens is the same as comparing values.
func UnescapeToken(token string) (string, error) {
	if token == escapeEmpty {
		return "", nil
	}
	if token == "" {
		return "", fmt.Errorf("unescape subject token: empty token (the empty value is escaped as %q)", escapeEmpty)
	}
	if strings.IndexByte(token, '~') < 0 {
		for i := 0; i < len(token); i++ {
			if !safeByte[token[i]] {
				return "", fmt.Errorf("unescape subject token %q: byte %q at %d must be escaped", token, token[i], i)
			}
		}
		return token, nil
	}
	out := make([]byte, 0, len(token))
	for i := 0; i < len(token); i++ {
		c := token[i]
		if safeByte[c] {
			out = append(out, c)
			continue
		}
		if c != '~' {
			return "", fmt.Errorf("unescape subject token %q: byte %q at %d must be escaped", token, c, i)
		}
		if i+2 >= len(token) {
			return "", fmt.Errorf("unescape subject token %q: '~' at %d needs two hex digits", token, i)
		}
		hi, ok1 := unhex(token[i+1])
		lo, ok2 := unhex(token[i+2])
		if !ok1 || !ok2 {
			return "", fmt.Errorf("unescape subject token %q: '~' at %d needs two upper-case hex digits", token, i)
		}
		b := hi<<4 | lo
		if safeByte[b] {
			return "", fmt.Errorf("unescape subject token %q: %q at %d is escaped but must not be", token, b, i)
		}
		out = append(out, b)
		i += 2
	}
	return string(out), nil
}

func unhex(c byte) (byte, bool) {
	switch {
	case c >= '0' && c <= '9':
		return c - '0', true
	case c >= 'A' && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}
