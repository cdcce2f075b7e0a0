package router

import (
	"testing"
	"time"
)

func TestParseTimestamp(t *testing.T) {
	tests := []struct {
		in   string
		want string // RFC 3339 UTC, "" for an error
	}{
		{"2026-11-29 09:35:21.123456+00", "2026-11-29T09:35:21.123456Z"},
		{"2026-11-29 09:35:21+00", "2026-11-29T09:35:21Z"},
		{"2026-11-29 09:35:21.1+00", "2026-11-29T09:35:21.1Z"},
		{"2026-11-29 15:05:21.5+05:30", "2026-11-29T09:35:21.5Z"},
		{"2026-11-29 06:05:06-03:30:15", "2026-11-29T09:35:21Z"},
		{"2026-11-29 10:35:21+01", "2026-11-29T09:35:21Z"},
		{"2026-11-29 09:35:21.123456", "2026-11-29T09:35:21.123456Z"}, // timestamp without time zone: UTC
		{"2026-11-29T09:35:21.123456789Z", "2026-11-29T09:35:21.123456789Z"},
		{"2026-11-29T09:35:21+00:00", "2026-11-29T09:35:21Z"},
		{"2026-11-29", "2026-11-29T00:00:00Z"},
		{"2024-02-29 00:00:00+00", "2024-02-29T00:00:00Z"},
		{"2026-01-01 00:30:00+01", "2025-12-31T23:30:00Z"},
		{"0001-01-01 00:00:00+00", "0001-01-01T00:00:00Z"},
		{"9999-12-31 23:59:59.999999+00", "9999-12-31T23:59:59.999999Z"},
		{"infinity", ""},
		{"-infinity", ""},
		{"2026-11-29 09:35:21+00 BC", ""},
		{"10000-01-01 00:00:00+00", ""},
		{"9999-12-31 23:00:00-05", ""}, // past year 9999 in UTC
		{"0001-01-01 00:30:00+01", ""}, // before year 1 in UTC
		{"2025-02-29 00:00:00+00", ""},
		{"2026-13-01 00:00:00+00", ""},
		{"2026-11-31 00:00:00+00", ""},
		{"2026-11-29 24:00:00+00", ""},
		{"2026-11-29 09:60:00+00", ""},
		{"2026-11-29 09:35:60+00", ""},
		{"2026-11-29 09:35:21.+00", ""},
		{"2026-11-29 09:35:21.1234567891+00", ""},
		{"2026-11-29 09:35:21+16", ""},
		{"2026-11-29 09:35:21+05:60", ""},
		{"2026-11-29 09:35", ""},
		{"2026-11-29 09:35:21 +00", ""},
		{"2026/11/29 09:35:21+00", ""},
		{"", ""},
		{"yesterday", ""},
	}
	for _, tt := range tests {
		got, err := parseTimestamp([]byte(tt.in))
		if tt.want == "" {
			if err == nil {
				t.Errorf("parseTimestamp(%q) = %v, want an error", tt.in, got)
			}
			continue
		}
		if err != nil {
			t.Errorf("parseTimestamp(%q): %v", tt.in, err)
			continue
		}
		if s := got.UTC().Format(time.RFC3339Nano); s != tt.want {
			t.Errorf("parseTimestamp(%q) = %s, want %s", tt.in, s, tt.want)
		}
	}
}

func FuzzParseTimestamp(f *testing.F) {
	f.Add("2026-11-29 09:35:21.123456+00")
	f.Add("2026-11-29 06:05:06-03:30:15")
	f.Fuzz(func(t *testing.T, s string) {
		ts, err := parseTimestamp([]byte(s))
		if err != nil {
			return
		}
		// Whatever it accepts must survive the contract's parse.
		out := ts.UTC().Format(time.RFC3339Nano)
		back, err := time.Parse(time.RFC3339Nano, out)
		if err != nil || !back.Equal(ts) {
			t.Fatalf("parseTimestamp(%q) = %s, which does not parse back: %v", s, out, err)
		}
	})
}
