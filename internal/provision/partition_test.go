package provision_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestEnsureStreamPartitions: a created stream is partitioned, an existing
// one without the transform (or with another count) is refused with the
// fix, and setup (UpdatePartitions) sets it; stored subjects then carry
// "<P>.<p>" before the aggregate id, and one aggregate always gets the same
// partition. A stream with the transform of the layout before (partition
// tokens last) is refused the same way, and setup replaces it.
func TestEnsureStreamPartitions(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	js, spec := plainStream(ctx, t)
	name := spec.Name
	spec.Partitions = 4
	if _, err := provision.EnsureStream(ctx, js, spec, true); err == nil || !strings.Contains(err.Error(), "run `outbox-relay setup` to set it") {
		t.Fatalf("unpartitioned existing stream: %v, want an error naming setup", err)
	}
	spec.UpdatePartitions = true
	rep, err := provision.EnsureStream(ctx, js, spec, true)
	if err != nil || !rep.Partitioned {
		t.Fatalf("setup: %+v, %v; want the transform set", rep, err)
	}
	spec.UpdatePartitions = false
	if rep, err := provision.EnsureStream(ctx, js, spec, true); err != nil || rep.Partitioned {
		t.Fatalf("second check: %+v, %v; want nothing to do", rep, err)
	}
	spec.Partitions = 8
	if _, err := provision.EnsureStream(ctx, js, spec, true); err == nil || !strings.Contains(err.Error(), "nats.partitions 8") {
		t.Fatalf("other count: %v, want an error naming the count", err)
	}
	for range 3 {
		if _, err := js.Publish(ctx, name+".order.42", []byte("x")); err != nil {
			t.Fatal(err)
		}
	}
	s, err := js.Stream(ctx, name)
	testenv.Must(t, err, "stream")
	var subj string
	for seq := uint64(1); seq <= 3; seq++ {
		m, err := s.GetMsg(ctx, seq)
		testenv.Must(t, err, "get")
		n, _, ok := contract.SubjectPartition(name+".*.*", m.Subject)
		if !ok || n != 4 || !strings.HasPrefix(m.Subject, name+".order.4.") || !strings.HasSuffix(m.Subject, ".42") || subj != "" && m.Subject != subj {
			t.Fatalf("stored subject %q (before %q): want %s.order.4.<p>.42, the same each time", m.Subject, subj, name)
		}
		if pub := contract.PublishedSubject(name+".*.*", m.Subject); pub != name+".order.42" {
			t.Fatalf("PublishedSubject(%q) = %q, want %s.order.42", m.Subject, pub, name)
		}
		subj = m.Subject
	}
	// The layout before this one: refused with the fix, replaced by setup.
	info, err := s.Info(ctx)
	testenv.Must(t, err, "info")
	cfg := info.Config
	cfg.SubjectTransform = &jetstream.SubjectTransformConfig{Source: name + ".*.*", Destination: name + ".{{wildcard(1)}}.{{wildcard(2)}}.8.{{partition(8,1,2)}}"}
	_, err = js.UpdateStream(ctx, cfg)
	testenv.Must(t, err, "old layout")
	if _, err := provision.EnsureStream(ctx, js, spec, true); err == nil || !strings.Contains(err.Error(), "run `outbox-relay setup` to set it") {
		t.Fatalf("old layout: %v, want an error naming setup", err)
	}
	// Issue 26: setup replaced the transform over the 3 messages stored
	// in the other layout, stranding them (and the tools then misread
	// them). It refuses with the steps; once the stream is purged it
	// replaces the transform.
	spec.UpdatePartitions = true
	if _, err := provision.EnsureStream(ctx, js, spec, true); !errors.Is(err, provision.ErrLayoutChange) || !strings.Contains(err.Error(), "nats stream purge "+name) {
		t.Fatalf("setup over the old layout with messages: %v, want ErrLayoutChange naming the purge", err)
	}
	testenv.Must(t, s.Purge(ctx), "purge")
	if rep, err := provision.EnsureStream(ctx, js, spec, true); err != nil || !rep.Partitioned ||
		contract.TransformPartitions(name+".*.*", rep.Info.Config.SubjectTransform.Destination) != 8 {
		t.Fatalf("setup over the old layout: %+v, %v; want the transform replaced", rep, err)
	}
	// A count change keeps the layout: allowed over stored messages.
	if _, err := js.Publish(ctx, name+".order.42", []byte("x")); err != nil {
		t.Fatal(err)
	}
	spec.Partitions = 16
	if rep, err := provision.EnsureStream(ctx, js, spec, true); err != nil || !rep.Partitioned {
		t.Fatalf("count change 8 -> 16 over a message: %+v, %v", rep, err)
	}
	spec.Partitions = 8
	spec.UpdatePartitions = false
	// A created stream is partitioned from the start.
	spec.Name, spec.Subjects, spec.Partitions = name+"_new", []string{name + "_new.*.*"}, 2
	rep, err = provision.EnsureStream(ctx, js, spec, true)
	if err != nil || rep.Info.Config.SubjectTransform == nil {
		t.Fatalf("created stream: %+v, %v; want a transform", rep, err)
	}
	_ = js.DeleteStream(ctx, spec.Name)
}

// Issue 26: setup added the partition transform to a plain stream holding
// events: they stayed on their published subjects, which no partition's
// filter matches, so consumer groups never delivered them. Refused with
// the steps; an empty plain stream is partitioned.
func TestEnsureStreamRefusesPartitioningStoredEvents(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	js, spec := plainStream(ctx, t)
	name := spec.Name
	if _, err := js.Publish(ctx, name+".order.42", []byte("x")); err != nil {
		t.Fatal(err)
	}
	spec.Partitions, spec.UpdatePartitions = 4, true
	_, err := provision.EnsureStream(ctx, js, spec, true)
	if !errors.Is(err, provision.ErrLayoutChange) || !strings.Contains(err.Error(), "holds 1 message(s)") {
		t.Fatalf("partition a stream holding an event: %v, want ErrLayoutChange", err)
	}
	s, err := js.Stream(ctx, name)
	testenv.Must(t, err, "stream")
	if info, err := s.Info(ctx); err != nil || info.Config.SubjectTransform != nil {
		t.Fatalf("the refused stream was changed: %+v, %v", info, err)
	}
	testenv.Must(t, s.Purge(ctx), "purge")
	if rep, err := provision.EnsureStream(ctx, js, spec, true); err != nil || !rep.Partitioned {
		t.Fatalf("partition the purged stream: %+v, %v", rep, err)
	}
}

// plainStream creates a stream <name>.*.* without a partition transform,
// deleted when the test ends.
func plainStream(ctx context.Context, t *testing.T) (jetstream.JetStream, provision.StreamSpec) {
	t.Helper()
	js, err := jetstream.New(connectNATS(t))
	testenv.Must(t, err, "jetstream")
	name := testenv.UniqueName("P")
	spec := provision.StreamSpec{Name: name, Subjects: []string{name + ".*.*"}, Duplicates: time.Minute}
	if _, err := provision.EnsureStream(ctx, js, spec, true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), name) })
	return js, spec
}
