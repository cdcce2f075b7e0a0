package contract

import (
	"reflect"
	"strconv"
	"strings"
	"testing"
)

func TestPartitionTransform(t *testing.T) {
	for _, tc := range []struct {
		source  string
		n       int
		want    string
		filter  string // of partition 3
		wantErr bool
	}{
		{"outbox.*.*", 8, "outbox.{{wildcard(1)}}.8.{{partition(8,1,2)}}.{{wildcard(2)}}", "outbox.*.8.3.*", false},
		{"app.events.*", 4, "app.events.4.{{partition(4,1)}}.{{wildcard(1)}}", "app.events.4.3.*", false},
		{"ev.*.x.*.*", 5, "ev.{{wildcard(1)}}.x.{{wildcard(2)}}.5.{{partition(5,1,2,3)}}.{{wildcard(3)}}", "ev.*.x.*.5.3.*", false},
		{"*", 6, "6.{{partition(6,1)}}.{{wildcard(1)}}", "6.3.*", false},
		{"outbox.>", 8, "", "", true},
		{"outbox.x", 8, "", "", true},
		{"outbox.*.*", 0, "", "", true},
		{"outbox.*.*", MaxPartitions + 1, "", "", true},
	} {
		got, err := PartitionTransform(tc.source, tc.n)
		if (err != nil) != tc.wantErr || got != tc.want {
			t.Errorf("PartitionTransform(%q, %d) = %q, %v; want %q, error %v", tc.source, tc.n, got, err, tc.want, tc.wantErr)
		}
		if err != nil {
			continue
		}
		if n := TransformPartitions(tc.source, got); n != tc.n {
			t.Errorf("TransformPartitions(%q, %q) = %d, want %d", tc.source, got, n, tc.n)
		}
		if f := PartitionFilter(tc.source, tc.n, 3); f != tc.filter {
			t.Errorf("PartitionFilter(%q, %d, 3) = %q, want %q", tc.source, tc.n, f, tc.filter)
		}
		if i := strings.Index(tc.filter, "*"); i >= 0 && strings.Count(tc.filter[i:], "*") > strings.Count(tc.source, "*") {
			t.Errorf("filter %q has more wildcards than %q", tc.filter, tc.source)
		}
	}
	for _, dst := range []string{
		"outbox.{{wildcard(1)}}.{{wildcard(2)}}.4.{{partition(4,1,2)}}", // the layout before: partition tokens last
		"outbox.{{wildcard(1)}}.{{partition(4,1,2)}}.{{wildcard(2)}}",   // without the count token
		"outbox.{{wildcard(1)}}.4.{{partition(4,1)}}.{{wildcard(2)}}",   // not from both wildcards
		"outbox.{{wildcard(1)}}.{{wildcard(2)}}",
	} {
		if n := TransformPartitions("outbox.*.*", dst); n != 0 {
			t.Errorf("TransformPartitions(%q) = %d, want 0", dst, n)
		}
	}
}

func TestSubjectPartition(t *testing.T) {
	for _, tc := range []struct {
		source, subject string
		n, p            int
		ok              bool
		published       string
	}{
		{"outbox.*.*", "outbox.registration.8.3.42", 8, 3, true, "outbox.registration.42"},
		{"outbox.*.*", "outbox.registration.42", 0, 0, false, "outbox.registration.42"},
		{"outbox.*.*", "outbox.registration.8.9.42", 0, 0, false, "outbox.registration.8.9.42"}, // p >= n: not a partition
		{"outbox.*.*", "other.registration.8.3.42", 0, 0, false, "other.registration.8.3.42"},   // another prefix
		{"outbox.*.*", "outbox.registration.8.x.42", 0, 0, false, "outbox.registration.8.x.42"},
		{"app.events.*", "app.events.4.0.7", 4, 0, true, "app.events.7"},
		{"*", "6.5.x", 6, 5, true, "x"},
	} {
		n, p, ok := SubjectPartition(tc.source, tc.subject)
		if n != tc.n || p != tc.p || ok != tc.ok {
			t.Errorf("SubjectPartition(%q, %q) = %d, %d, %v; want %d, %d, %v", tc.source, tc.subject, n, p, ok, tc.n, tc.p, tc.ok)
		}
		if got := PublishedSubject(tc.source, tc.subject); got != tc.published {
			t.Errorf("PublishedSubject(%q, %q) = %q, want %q", tc.source, tc.subject, got, tc.published)
		}
	}
}

// FuzzSubjectPartition: a subject built by inserting partition tokens
// into a published subject maps back to it, and nothing panics on
// arbitrary input.
func FuzzSubjectPartition(f *testing.F) {
	f.Add("outbox.*.*", "outbox.registration.42", 8, 3)
	f.Add("*", "x", 1, 0)
	f.Fuzz(func(t *testing.T, source, published string, n, p int) {
		SubjectPartition(source, published)
		PublishedSubject(source, published)
		_, at, err := slot(source)
		if err != nil || checkCount(n) != nil || p < 0 || p >= n {
			return
		}
		toks := strings.Split(published, ".")
		src := strings.Split(source, ".")
		if len(toks) != len(src) {
			return
		}
		for i, s := range src {
			if toks[i] == "" || strings.ContainsAny(toks[i], " *>") || (s != "*" && toks[i] != s) {
				return
			}
		}
		stored := strings.Join(append(append(toks[:at:at], strconv.Itoa(n), strconv.Itoa(p)), toks[at:]...), ".")
		gn, gp, ok := SubjectPartition(source, stored)
		if !ok || gn != n || gp != p {
			t.Fatalf("SubjectPartition(%q, %q) = %d, %d, %v; want %d, %d", source, stored, gn, gp, ok, n, p)
		}
		if got := PublishedSubject(source, stored); got != published {
			t.Fatalf("PublishedSubject(%q, %q) = %q, want %q", source, stored, got, published)
		}
	})
}

func TestLayout(t *testing.T) {
	dst, err := PartitionTransform("outbox.*.*", 8)
	if err != nil {
		t.Fatal(err)
	}
	part := StreamLayout("outbox.*.*", dst)
	plain := StreamLayout("", "")
	foreign := StreamLayout("outbox.*.*", "outbox.{{wildcard(2)}}.{{wildcard(1)}}")
	if !part.Partitioned() || part.Partitions != 8 || plain.Partitioned() || foreign.Partitioned() {
		t.Fatalf("layouts: %+v %+v %+v", part, plain, foreign)
	}
	for _, tc := range []struct {
		l              Layout
		stored, public string
	}{
		{part, "outbox.registration.8.3.42", "outbox.registration.42"},
		{part, "outbox.registration.16.3.42", "outbox.registration.42"}, // before a count change
		{part, "outbox.registration.42", "outbox.registration.42"},      // before the transform
		// A plain stream's five-token subject is never read as
		// partitioned (issue 26: outbox.registration.42.8.2 was read as
		// partition 8 of 42 and published outbox.registration.2).
		{plain, "outbox.registration.42.8.2", "outbox.registration.42.8.2"},
		{plain, "outbox.registration.8.3.42", "outbox.registration.8.3.42"},
	} {
		if got := tc.l.Published(tc.stored); got != tc.public {
			t.Errorf("%+v.Published(%q) = %q, want %q", tc.l, tc.stored, got, tc.public)
		}
	}
	if got, want := part.StoredFilters("outbox.registration.42"), []string{"outbox.registration.42", "outbox.registration.*.*.42"}; !reflect.DeepEqual(got, want) {
		t.Errorf("StoredFilters = %q, want %q", got, want)
	}
	if got := part.StoredFilters("other.x"); !reflect.DeepEqual(got, []string{"other.x"}) {
		t.Errorf("StoredFilters(other.x) = %q", got)
	}
	if got := plain.StoredFilters("outbox.registration.42"); !reflect.DeepEqual(got, []string{"outbox.registration.42"}) {
		t.Errorf("plain StoredFilters = %q", got)
	}
	for _, f := range part.StoredFilters("outbox.registration.42") {
		if !SubjectMatches("outbox.registration.8.3.42", f) && f != "outbox.registration.42" {
			t.Errorf("filter %q does not match the stored subject", f)
		}
	}
}
