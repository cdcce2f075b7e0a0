package contract

import "testing"

func TestFilterCovers(t *testing.T) {
	tests := []struct {
		outer, inner string
		want         bool
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
		{"a.*", "a.b", true},
		{"a.>", "a.b.c", true},
		{"a.*", "a.b.c", false},
		{"a.*.*", "a.dlq.>", false},
		{"a.>", "a", false},
		{"*", ">", false},
		{">", "*", true},
	}
	for _, tt := range tests {
		if got := FilterCovers(tt.outer, tt.inner); got != tt.want {
			t.Errorf("FilterCovers(%q, %q) = %v, want %v", tt.outer, tt.inner, got, tt.want)
		}
	}
}

func TestFiltersOverlap(t *testing.T) {
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
		{"a.*.*", "a.dlq.>", true},
		{"*", ">", true},
	} {
		if got := FiltersOverlap(c.a, c.b); got != c.want {
			t.Errorf("FiltersOverlap(%q, %q) = %v, want %v", c.a, c.b, got, c.want)
		}
		if got := FiltersOverlap(c.b, c.a); got != c.want {
			t.Errorf("FiltersOverlap(%q, %q) = %v, want %v", c.b, c.a, got, c.want)
		}
	}
}

func TestSubjectMatches(t *testing.T) {
	for _, c := range []struct {
		subject string
		filters []string
		want    bool
	}{
		{"a.b.c", []string{"a.*.c"}, true},
		{"a.b.c", []string{"a.>"}, true},
		{"a.b.c", []string{"a.*"}, false},
		{"a.b", []string{"a.*.c"}, false},
		{"a.b.c", []string{"x.>", "a.b.c"}, true},
		{"a", []string{">"}, true},
		{"a", []string{"*"}, true},
		{"a.b", nil, false},
		{"ab.c", []string{"a.*"}, false},
	} {
		if got := SubjectMatches(c.subject, c.filters...); got != c.want {
			t.Errorf("SubjectMatches(%q, %q) = %v, want %v", c.subject, c.filters, got, c.want)
		}
	}
}
