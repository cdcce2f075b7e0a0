package publisher

import "testing"

func TestSubjectCovers(t *testing.T) {
	tests := []struct {
		stream, filter string
		want           bool
	}{
		{"outbox.>", "outbox.*.*", true},
		{"outbox.>", "outbox.registration.*", true},
		{"outbox.>", "outbox", false},
		{"outbox.*.*", "outbox.*.*", true},
		{"outbox.*.*", "outbox.a.*", true},
		{"outbox.*.*", "outbox.>", false},
		{"outbox.*", "outbox.*.*", false},
		{"outbox.a.*", "outbox.*.*", false},
		{">", "anything.at.all", true},
		{"outbox.dlq.>", "outbox.dlq.>", true},
		{"outbox.dlq.*", "outbox.dlq.>", false},
		{"a.b", "a.b", true},
		{"a.b", "a.c", false},
	}
	for _, tt := range tests {
		if got := SubjectCovers(tt.stream, tt.filter); got != tt.want {
			t.Errorf("SubjectCovers(%q, %q) = %v, want %v", tt.stream, tt.filter, got, tt.want)
		}
	}
}

func TestSubjectsOverlap(t *testing.T) {
	for _, c := range []struct {
		a, b string
		want bool
	}{
		{"outbox.>", "outbox.*.*", true},
		{"outbox.*.*", "outbox.registration.*", true},
		{"outbox.*.*", "outbox.*", false},
		{"outbox.>", "outbox", false},
		{"outbox_dlq.>", "outbox.>", false},
		{">", "a.b", true},
		{"a.b", "a.b", true},
		{"a.b", "a.c", false},
		{"a.*", "*.b", true},
	} {
		if got := subjectsOverlap(c.a, c.b); got != c.want {
			t.Errorf("subjectsOverlap(%q, %q) = %v, want %v", c.a, c.b, got, c.want)
		}
		if got := subjectsOverlap(c.b, c.a); got != c.want {
			t.Errorf("subjectsOverlap(%q, %q) = %v, want %v", c.b, c.a, got, c.want)
		}
	}
}
