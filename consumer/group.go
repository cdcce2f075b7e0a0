package consumer

import (
	"fmt"
	"os"
	"regexp"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/consumer/internal/group"
	"github.com/outbox-relay/outbox-relay/contract"
)

// DefaultMemberTTL is GroupConfig.MemberTTL's default.
const DefaultMemberTTL = 6 * time.Second

// groupPullExpiry is how long one pull request of a partition lives
// (group.PullExpiry); PinnedTTL must exceed it by a second.
const groupPullExpiry = group.PullExpiry

// GroupConfig makes a Consumer one member of the partitioned consumer group
// Config.Name (see docs/consumer.md "Consumer groups"). The stream must be
// partitioned into Partitions by its subject transform (`outbox-relay
// setup` with nats.partitions); each partition is a durable consumer
// "<Name>-<Partitions>-<p>" with a pinned-client priority group, so
// JetStream delivers each partition to one member at a time. Members find
// each other through a key-value bucket (OUTBOX_GROUP_<Name>) and divide
// the partitions among the live ones; a member that stops heartbeating
// loses its partitions to the others.
type GroupConfig struct {
	// Partitions is the partition count the stream was set up with.
	// Required; every member of the group must agree, and with the stream.
	Partitions int
	// Member identifies this process in the group. Default
	// "<hostname>-<pid>-<random>": a restarted process is a new member.
	Member string
	// MemberTTL is how long a member that stopped heartbeating (every
	// MemberTTL/3) still counts as alive. Default DefaultMemberTTL.
	MemberTTL time.Duration
	// PinnedTTL is how long a partition stays pinned to a member that
	// stopped pulling from it before JetStream lets another member pull it.
	// Order does not depend on it: a new owner unpins the partition and
	// resets its durable to the ack floor before it pulls (see
	// docs/consumer.md "Order across rebalances"). It must exceed the pull
	// expiry (2 s) + 1 s, so that a live owner keeps its pin between pulls.
	// Default MemberTTL + 2 s.
	PinnedTTL time.Duration
	// DrainTimeout bounds a voluntary hand-off (a member joins or leaves):
	// how long the member lets its workers settle the messages of a
	// partition it gives up before it unpins it. The next owner does not
	// wait for it (it resets the partition to its ack floor). Default
	// AckWait + RetryMax.
	DrainTimeout time.Duration
}

// groupNameRE: the group name is part of durable consumer and bucket names.
var groupNameRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,128}$`)

// memberRE: member ids are key-value keys.
var memberRE = regexp.MustCompile(`^[A-Za-z0-9_=-][A-Za-z0-9_=.-]{0,199}$`)

func (c *Config) setGroupDefaults() {
	g := *c.Group // never write to the caller's struct
	c.Group = &g
	if g.Member == "" {
		host, _ := os.Hostname()
		g.Member = sanitizeMember(host) + "-" + strconv.Itoa(os.Getpid()) + "-" + uuid.NewString()[:8]
	}
	if g.MemberTTL == 0 {
		g.MemberTTL = DefaultMemberTTL
	}
	if g.PinnedTTL == 0 {
		g.PinnedTTL = g.MemberTTL + groupPullExpiry
	}
	if g.DrainTimeout == 0 {
		g.DrainTimeout = c.AckWait + c.RetryMax
	}
	// A gap may now also wait for a crashed member's pin to expire.
	if need := c.RetryMax + c.AckWait + g.PinnedTTL; c.GapWait == max(DefaultGapWait, c.RetryMax+c.AckWait) && c.GapWait < need {
		c.GapWait = need
	}
}

func sanitizeMember(s string) string {
	b := []byte(s)
	for i, ch := range b {
		if !(ch >= 'a' && ch <= 'z' || ch >= 'A' && ch <= 'Z' || ch >= '0' && ch <= '9' || ch == '-' || ch == '_') {
			b[i] = '_'
		}
	}
	if len(b) == 0 {
		return "member"
	}
	return string(b)
}

func (c *Config) validateGroup() error {
	g := c.Group
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case !groupNameRE.MatchString(c.Name):
		return bad("Name %q is not a valid group name: in a group it names durable consumers and a key-value bucket, so use 1 to 128 letters, digits, - and _", c.Name)
	case g.Partitions < 1 || g.Partitions > contract.MaxPartitions:
		return bad("Group.Partitions is %d: set it to the partition count the stream was set up with (nats.partitions of the relay, 1 to %d)", g.Partitions, contract.MaxPartitions)
	case !memberRE.MatchString(g.Member):
		return bad("Group.Member %q: use letters, digits, ., -, _ and =, or leave it empty for <host>-<pid>-<random>", g.Member)
	case len(c.FilterSubjects) > 0:
		return bad("FilterSubjects cannot be combined with Group: each partition's durable filters its own partition; choose events with EventTypes")
	case c.VersionCheck && c.InitialVersion == 0:
		// A member taking over a partition can see a later version of an
		// aggregate before the earlier one comes back from the old owner;
		// with InitialVersion 0 it would take that one as the start and
		// dead-letter the earlier one as a conflict.
		return bad("VersionCheck with InitialVersion 0 is unsafe in a group: after a partition moves, a later version can arrive first and would be taken as the aggregate's start; set InitialVersion to the first version your producer writes (usually 1)")
	case g.MemberTTL < time.Second:
		return bad("Group.MemberTTL %s is below 1s", g.MemberTTL)
	case g.PinnedTTL < groupPullExpiry+time.Second:
		return bad("Group.PinnedTTL %s is below the pull expiry %s + 1s: an owner would lose its pin between two pulls; raise PinnedTTL or leave it 0",
			g.PinnedTTL, groupPullExpiry)
	case g.DrainTimeout <= 0:
		return bad("Group.DrainTimeout %s must be positive", g.DrainTimeout)
	case c.VersionCheck && c.GapWait < c.RetryMax+c.AckWait+g.PinnedTTL:
		return bad("GapWait %s is below RetryMax + AckWait + Group.PinnedTTL (%s): after a member crashes, a later version would be dead-lettered as a gap while the earlier one waits for the partition's new owner; raise GapWait or leave it 0",
			c.GapWait, c.RetryMax+c.AckWait+g.PinnedTTL)
	}
	return nil
}

// PartitionDurable is the durable consumer name of partition p of a group
// with the given partition count.
func PartitionDurable(name string, partitions, p int) string {
	return group.PartitionDurable(name, partitions, p)
}

// GroupBucket is the key-value bucket where a group's members heartbeat.
func GroupBucket(name string) string { return group.Bucket(name) }

// StreamPartitions reads how a stream partitions its subjects: the subject
// the transform applies to and the partition count. An error names the fix
// when the stream is not set up for consumer groups.
func StreamPartitions(cfg jetstream.StreamConfig) (source string, partitions int, err error) {
	return group.StreamPartitions(cfg)
}

// Group errors. Match them with errors.Is.
var (
	// ErrGroupStream means the stream is not partitioned for consumer
	// groups; the message names the setup step.
	ErrGroupStream = group.ErrStream
	// ErrGroupMismatch means this member disagrees with the stream or with
	// another live member about the group's partition count.
	ErrGroupMismatch = group.ErrMismatch
)
