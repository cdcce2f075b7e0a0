package contract

import "testing"

func TestPartitionTransform(t *testing.T) {
	for _, tc := range []struct {
		source  string
		n       int
		want    string
		wantErr bool
	}{
		{"outbox.*.*", 8, "outbox.{{wildcard(1)}}.{{wildcard(2)}}.8.{{partition(8,1,2)}}", false},
		{"app.events.*", 3, "app.events.{{wildcard(1)}}.3.{{partition(3,1)}}", false},
		{"outbox.>", 8, "", true},
		{"outbox.x", 8, "", true},
		{"outbox.*.*", 0, "", true},
		{"outbox.*.*", MaxPartitions + 1, "", true},
	} {
		got, err := PartitionTransform(tc.source, tc.n)
		if (err != nil) != tc.wantErr || got != tc.want {
			t.Errorf("PartitionTransform(%q, %d) = %q, %v; want %q, error %v", tc.source, tc.n, got, err, tc.want, tc.wantErr)
		}
		if err == nil {
			if n := TransformPartitions(got); n != tc.n {
				t.Errorf("TransformPartitions(%q) = %d, want %d", got, n, tc.n)
			}
		}
	}
	if n := TransformPartitions("outbox.{{wildcard(1)}}.{{partition(4,1)}}"); n != 0 {
		t.Errorf("a transform without the count token: %d, want 0", n)
	}
}

func TestSubjectPartition(t *testing.T) {
	for _, tc := range []struct {
		subject   string
		n, p      int
		ok        bool
		published string
	}{
		{"outbox.registration.42.8.3", 8, 3, true, "outbox.registration.42"},
		{"outbox.registration.42", 0, 0, false, "outbox.registration.42"},
		{"outbox.registration.8.9", 0, 0, false, "outbox.registration.8.9"}, // p >= n: not a partition
		{"a.4", 0, 0, false, "a.4"},
	} {
		n, p, ok := SubjectPartition(tc.subject)
		if n != tc.n || p != tc.p || ok != tc.ok {
			t.Errorf("SubjectPartition(%q) = %d, %d, %v; want %d, %d, %v", tc.subject, n, p, ok, tc.n, tc.p, tc.ok)
		}
		if got := PublishedSubject(tc.subject); got != tc.published {
			t.Errorf("PublishedSubject(%q) = %q, want %q", tc.subject, got, tc.published)
		}
	}
}
