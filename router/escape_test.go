package router

import (
	"strings"
	"testing"
	"unicode/utf8"
)

func TestEscapeToken(t *testing.T) {
	tests := []struct {
		in, want string
	}{
		{"", "~"},
		{"Order", "Order"},
		{"a-b_c09", "a-b_c09"},
		{"order.42", "order~2E42"},
		{"~", "~7E"},
		{"~7E", "~7E7E"},
		{"*", "~2A"},
		{">", "~3E"},
		{"a b\tc\n", "a~20b~09c~0A"},
		{"é", "~C3~A9"},
		{"日本", "~E6~97~A5~E6~9C~AC"},
		{"\xff", "~FF"},
		{"$JS", "~24JS"},
		{"3f2504e0-4f89-11d3-9a0c-0305e82c3301", "3f2504e0-4f89-11d3-9a0c-0305e82c3301"},
	}
	for _, tt := range tests {
		if got := EscapeToken(tt.in); got != tt.want {
			t.Errorf("EscapeToken(%q) = %q, want %q", tt.in, got, tt.want)
		}
		if n := escapedLen(tt.in); n != len(tt.want) {
			t.Errorf("escapedLen(%q) = %d, want %d", tt.in, n, len(tt.want))
		}
		back, err := UnescapeToken(tt.want)
		if err != nil || back != tt.in {
			t.Errorf("UnescapeToken(%q) = %q, %v; want %q", tt.want, back, err, tt.in)
		}
	}
}

func TestUnescapeTokenRejectsNonCanonical(t *testing.T) {
	for _, tok := range []string{
		"",         // empty token: "" escapes to "~"
		"a.b",      // unescaped dot
		"a b",      // unescaped space
		"*",        // wildcard
		"~2e",      // lower-case hex
		"~2",       // short escape
		"a~",       // dangling escape
		"~~",       // "~" is escaped as ~7E
		"~41",      // 'A' must not be escaped
		"~G0",      // not hex
		"é",        // raw UTF-8
		"abc~2Ex~", // dangling at the end
	} {
		if s, err := UnescapeToken(tok); err == nil {
			t.Errorf("UnescapeToken(%q) = %q, want an error", tok, s)
		}
	}
}

func FuzzEscapeToken(f *testing.F) {
	for _, s := range []string{"", "a", "order.42", "~", "~7E", "*", ">", " ", "é", "\xff\x00", "a.b.c"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		e := EscapeToken(s)
		if e == "" {
			t.Fatalf("EscapeToken(%q) is empty", s)
		}
		for i := 0; i < len(e); i++ {
			c := e[i]
			if !safeByte[c] && c != '~' {
				t.Fatalf("EscapeToken(%q) = %q holds %q", s, e, c)
			}
		}
		if strings.ContainsAny(e, ".*> \t\r\n") || !utf8.ValidString(e) {
			t.Fatalf("EscapeToken(%q) = %q is not a safe token", s, e)
		}
		if n := escapedLen(s); n != len(e) {
			t.Fatalf("escapedLen(%q) = %d, want %d", s, n, len(e))
		}
		if b := appendEscaped([]byte("x"), []byte(s)); string(b) != "x"+e {
			t.Fatalf("appendEscaped(%q) = %q, want %q", s, b[1:], e)
		}
		back, err := UnescapeToken(e)
		if err != nil || back != s {
			t.Fatalf("UnescapeToken(EscapeToken(%q)) = %q, %v", s, back, err)
		}
		// Any token UnescapeToken accepts is canonical: escaping gives it back.
		if u, err := UnescapeToken(s); err == nil && EscapeToken(u) != s {
			t.Fatalf("UnescapeToken(%q) = %q, which escapes to %q", s, u, EscapeToken(u))
		}
	})
}
