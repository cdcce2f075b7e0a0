// Package group is the membership side of a consumer group member: the
// heartbeat in the group's key-value bucket, the roster of live members,
// the assignment of partitions, the generations of partition durables
// across partition-count changes, and each owned partition's pull and
// hand-off (docs/consumer.md "Consumer groups").
//
// It knows nothing of how a message is applied. The consumer engine
// (package consumer, engine.go) runs a [Member] as one of its sources and
// gives it a [Host]: the Host opens a [Feed] on a partition durable — the
// deliveries, in stream order, on their way to the engine's workers — and
// creates durables under the consumer's identity. So this package does not
// import the engine, and the engine sees a group only as a source.
//
// JetStream priority groups (pinned client):
// https://docs.nats.io/nats-concepts/jetstream/consumers#pinned-client.
package group

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
)

// Config is what a member needs of the consumer's configuration, with
// defaults already filled in (consumer.GroupConfig documents the fields).
type Config struct {
	Name, Stream, Member string
	Partitions           int
	MemberTTL, PinnedTTL time.Duration
	DrainTimeout         time.Duration
	AckWait              time.Duration
	MaxAckPending        int // each partition durable's; the host's feeds share it member-wide
	VersionCheck         bool
	// Durable is the consumer's durable configuration, which each partition
	// durable starts from.
	Durable jetstream.ConsumerConfig
}

// Host is what a member needs of the engine it runs in.
type Host interface {
	// Feed opens a feed of the durable cons (named name) to the engine's
	// workers, pulling with opts. admit is asked about each delivery's
	// stream sequence before it is handed on: an error from it ends Pump
	// with that error, the delivery not handed on.
	Feed(cons jetstream.Consumer, name string, admit func(streamSeq uint64) error, opts ...jetstream.PullMessagesOpt) Feed
	// EnsureDurable creates the partition durable cfg, or checks that the
	// one that exists is this consumer's (its database, cfg.FilterSubject)
	// and, with update, brings it to cfg.
	EnsureDurable(ctx context.Context, cfg jetstream.ConsumerConfig, update bool) (jetstream.Consumer, error)
}

// Feed is one partition durable's deliveries on their way to the workers,
// in stream order (consumer/feed.go).
type Feed interface {
	// Pump hands deliveries to the workers until ctx ends (its error) or
	// the durable cannot be pulled any more.
	Pump(ctx context.Context) error
	// Stop closes the pull subscription; what it buffered comes again to
	// whoever resets the durable next.
	Stop()
	// Close stops the feed for good, once the partition is no longer
	// pulled: what is naked for a retry no longer counts against the
	// member's MaxAckPending (it comes back to the next owner).
	Close()
	// Settle waits until what was handed out is settled (except what is
	// held behind a message naked for a retry), or ctx ends.
	Settle(ctx context.Context) error
	// Unsettled is the number of deliveries handed out and not settled.
	Unsettled() int
	// Pin is the pin id of the last delivery ("" before one).
	Pin() string
}

// PullExpiry is how long one pull request of a partition lives. The pinned
// member re-pulls at least this often while it has room, which keeps its
// pin; PinnedTTL must exceed it by a second.
const PullExpiry = 2 * time.Second

// maxPriorityGroup is JetStream's limit on a priority group's name.
const maxPriorityGroup = 16

// PriorityGroup is the pinned-client priority group of the group's
// partition durables: the group name itself when JetStream accepts it (as
// members since the first release have used), else a shortened name with a
// hash of the whole, so that a long group name still works and two long
// names do not meet (each partition durable has its own group anyway).
func PriorityGroup(name string) string {
	if len(name) <= maxPriorityGroup {
		return name
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(name))
	return fmt.Sprintf("%s-%08x", name[:maxPriorityGroup-9], h.Sum32())
}

// Metadata keys of a group's partition durables.
const (
	metaGroup      = "outbox-relay.group"
	metaPartitions = "outbox-relay.partitions"
	metaPartition  = "outbox-relay.partition"
	// metaFrom is the stream's last sequence in the stream info that
	// showed the durable's partition count when the durable was created:
	// every message of an older count up to it was stored before the
	// change (generation.from).
	metaFrom = "outbox-relay.from"
)

// PartitionDurable is the durable consumer name of partition p of a group
// with the given partition count.
func PartitionDurable(group string, partitions, p int) string {
	return group + "-" + strconv.Itoa(partitions) + "-" + strconv.Itoa(p)
}

// generationFilter is the subject filter of every partition of a
// partition count: PartitionFilter with the partition token a wildcard.
func generationFilter(source string, partitions int) string {
	a := strings.Split(contract.PartitionFilter(source, partitions, 0), ".")
	b := strings.Split(contract.PartitionFilter(source, partitions, 1), ".")
	for i := range a {
		if i < len(b) && a[i] != b[i] {
			a[i] = "*"
		}
	}
	return strings.Join(a, ".")
}

// Bucket is the key-value bucket where a group's members heartbeat.
func Bucket(group string) string { return "OUTBOX_GROUP_" + group }

// StreamPartitions reads how a stream partitions its subjects: the subject
// the transform applies to and the partition count. An error names the fix
// when the stream is not set up for consumer groups.
func StreamPartitions(cfg jetstream.StreamConfig) (source string, partitions int, err error) {
	t := cfg.SubjectTransform
	if t == nil || t.Destination == "" {
		return "", 0, fmt.Errorf("%w: stream %s has no partition subject transform: set nats.partitions in the relay config and run `outbox-relay setup` (see docs/consumer.md \"Consumer groups\")",
			ErrStream, cfg.Name)
	}
	src := t.Source
	if src == "" {
		if len(cfg.Subjects) != 1 {
			return "", 0, fmt.Errorf("%w: stream %s has a partition transform without a source and %d subjects; give the transform the stream's subject as source", ErrStream, cfg.Name, len(cfg.Subjects))
		}
		src = cfg.Subjects[0]
	}
	n := contract.TransformPartitions(src, t.Destination)
	if n == 0 {
		return "", 0, fmt.Errorf("%w: stream %s transforms %q to %q, which is not the partition transform of this version (for example %q → %q): set nats.partitions in the relay config and run `outbox-relay setup` to replace it",
			ErrStream, cfg.Name, src, t.Destination, src, exampleTransform(src))
	}
	return src, n, nil
}

// exampleTransform is the partition transform of source into 8, for
// error messages; the reason when source cannot be partitioned.
func exampleTransform(source string) string {
	dst, err := contract.PartitionTransform(source, 8)
	if err != nil {
		return err.Error()
	}
	return dst
}

// checkStream checks that the stream is partitioned as the group expects.
func (cfg *Config) checkStream(info *jetstream.StreamInfo) (source string, partitions int, err error) {
	source, partitions, err = StreamPartitions(info.Config)
	if err != nil {
		return "", 0, err
	}
	if partitions != cfg.Partitions {
		return "", 0, fmt.Errorf("%w: stream %s is partitioned into %d, group %s is configured with Group.Partitions %d: every member must use the stream's count; set Group.Partitions to %d (to change the count, follow docs/consumer.md \"Changing the number of partitions\")",
			ErrMismatch, info.Config.Name, partitions, cfg.Name, cfg.Partitions, partitions)
	}
	return source, partitions, nil
}

// errNotGroupDurable marks a consumer of the stream that is not one of
// this group's partition durables.
var errNotGroupDurable = errors.New("not a partition durable of this group")

// durableGeneration reads which partition count and partition a durable
// consumer of this group serves.
func (cfg *Config) durableGeneration(ci *jetstream.ConsumerInfo) (partitions, p int, err error) {
	md := ci.Config.Metadata
	if md[metaGroup] != cfg.Name {
		return 0, 0, errNotGroupDurable
	}
	partitions, err1 := strconv.Atoi(md[metaPartitions])
	p, err2 := strconv.Atoi(md[metaPartition])
	if err1 != nil || err2 != nil || ci.Name != PartitionDurable(cfg.Name, partitions, p) {
		return 0, 0, errNotGroupDurable
	}
	return partitions, p, nil
}

// Group errors, exported by package consumer as ErrGroupStream and
// ErrGroupMismatch.
var (
	// ErrStream means the stream is not partitioned for consumer groups;
	// the message names the setup step.
	ErrStream = errors.New("stream not set up for consumer groups")
	// ErrMismatch means this member disagrees with the stream or with
	// another live member about the group's partition count.
	ErrMismatch = errors.New("consumer group configuration mismatch")
	// ErrSetUpCancelled means the member's context ended before its first
	// assignment: it never consumed, so that is an error, not a shutdown.
	ErrSetUpCancelled = errors.New("consumer group member cancelled during its set-up")
)

// isGone reports an error meaning the consumer no longer exists.
func isGone(err error) bool {
	return errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound)
}
