package provision

import (
	"context"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
)

// partitionTransform is the subject transform of a partitioned stream.
func partitionTransform(spec StreamSpec) (*jetstream.SubjectTransformConfig, error) {
	if len(spec.Subjects) != 1 {
		return nil, fmt.Errorf("stream %s: nats.partitions needs exactly one stream subject to partition, have %v: use one subject template for all tables (e.g. outbox.{aggregate_type}.{aggregate_id})", spec.Name, spec.Subjects)
	}
	dst, err := contract.PartitionTransform(spec.Subjects[0], spec.Partitions)
	if err != nil {
		return nil, fmt.Errorf("stream %s: nats.partitions: %w", spec.Name, err)
	}
	return &jetstream.SubjectTransformConfig{Source: spec.Subjects[0], Destination: dst}, nil
}

// ensurePartitions checks an existing stream's partition transform, and
// with spec.UpdatePartitions sets it. Changing the count is safe for
// consumer groups: events stored from now on carry the new count in their
// subject, and the members consume them only after every partition of the
// old count is drained (docs/consumer.md "Changing the number of
// partitions").
func ensurePartitions(ctx context.Context, js jetstream.JetStream, spec StreamSpec, info *jetstream.StreamInfo, rep *StreamReport) (*jetstream.StreamInfo, error) {
	want, err := partitionTransform(spec)
	if err != nil {
		return nil, err
	}
	have := info.Config.SubjectTransform
	if have != nil && have.Source == want.Source && have.Destination == want.Destination {
		return info, nil
	}
	if !spec.UpdatePartitions {
		now := "no partition transform"
		if have != nil {
			now = fmt.Sprintf("transform %s -> %s", have.Source, have.Destination)
		}
		return nil, fmt.Errorf("stream %s has %s, nats.partitions %d wants %s -> %s: run `outbox-relay setup` to set it (see docs/consumer.md \"Changing the number of partitions\")",
			spec.Name, now, spec.Partitions, want.Source, want.Destination)
	}
	if info.State.Msgs > 0 && StreamLayout(info.Config).Source != want.Source {
		return nil, layoutChangeError(spec, have, want, info.State.Msgs)
	}
	cfg := info.Config
	cfg.SubjectTransform = want
	s, err := js.UpdateStream(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("stream %s: set partition transform: %w", spec.Name, err)
	}
	rep.Partitioned = true
	return s.CachedInfo(), nil // the update's answer holds the new info
}

// StreamLayout is how the stream with this configuration stores events:
// read from its own subject transform, never guessed from subjects.
func StreamLayout(cfg jetstream.StreamConfig) contract.Layout {
	if t := cfg.SubjectTransform; t != nil {
		return contract.StreamLayout(t.Source, t.Destination)
	}
	return contract.Layout{}
}

// layoutChangeError refuses to set a partition transform over messages
// stored in another layout (none, or an earlier version's): the stream's
// subjects would no longer say how to read them, consumer groups would
// never deliver them, and the tools would misread them. Changing only the
// count is fine: the count is in the stored subject.
func layoutChangeError(spec StreamSpec, have, want *jetstream.SubjectTransformConfig, msgs uint64) error {
	now := "their published subjects (no partition transform)"
	if have != nil {
		now = fmt.Sprintf("the subject transform %s -> %s", have.Source, have.Destination)
	}
	return fmt.Errorf("%w: stream %s holds %d message(s) stored under %s; the partition transform %s -> %s would leave them on subjects no partition's filter matches. "+
		"Either let every consumer of the stream finish, purge it (nats stream purge %s) and rerun `outbox-relay setup`; or set nats.stream to a new stream name (with subjects that do not overlap this one's) and rerun setup; or unset nats.partitions to keep the stream as it is",
		ErrLayoutChange, spec.Name, msgs, now, want.Source, want.Destination, spec.Name)
}
