package consumer

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/consumer/internal/group"
	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// partitionedStream replaces the fixture's stream with one partitioned
// into n the way `outbox-relay setup` makes it, in memory.
func (f *fixture) partitionedStream(n int) {
	f.t.Helper()
	f.partitionedStreamOn(n, jetstream.MemoryStorage)
}

// partitionedStreamOn is partitionedStream on storage.
func (f *fixture) partitionedStreamOn(n int, storage jetstream.StorageType) {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	name := testenv.UniqueName("G")
	src := name + ".*.*"
	dst, err := contract.PartitionTransform(src, n)
	testenv.Must(f.t, err, "partition transform")
	_, err = f.js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{src}, Storage: storage,
		SubjectTransform: &jetstream.SubjectTransformConfig{Source: src, Destination: dst}})
	testenv.Must(f.t, err, "create partitioned stream")
	f.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = f.js.DeleteStream(ctx, name)
		_ = f.js.DeleteKeyValue(ctx, GroupBucket("grp"))
	})
	f.stream = name
}

func groupConfig(f *fixture, partitions int) Config {
	cfg := f.baseConfig("grp")
	cfg.AckWait = 2 * time.Second
	cfg.HandlerTimeout = time.Second
	cfg.VersionCheck = true
	cfg.InitialVersion = 1
	cfg.GapWait = 0
	cfg.Group = &GroupConfig{Partitions: partitions, MemberTTL: 2 * time.Second}
	return cfg
}

// runMember runs a group member until stop is called.
func (f *fixture) runMember(cfg Config, h Handler, member string, opts ...Option) (stop func()) {
	f.t.Helper()
	g := *cfg.Group
	g.Member = member
	cfg.Group = &g
	opts = append([]Option{WithLogger(zaptest.NewLogger(f.t).Named(member))}, opts...)
	c, err := New(f.pool, f.js, cfg, h, opts...)
	testenv.Must(f.t, err, "new member")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var stopped bool
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			f.t.Errorf("member %s: Run: %v", member, err)
		}
	}
	f.t.Cleanup(stop)
	return stop
}

// checkApplied checks that every event of aggs x versions was applied
// once, each aggregate in version order, and nothing dead-lettered.
func (f *fixture) checkApplied(name string, aggs, versions int) {
	f.t.Helper()
	if n := queryInt(f.t, f.pool, `SELECT count(*) FROM applied WHERE consumer = $1`, name); n != int64(aggs*versions) {
		f.t.Errorf("applied %d rows, want %d", n, aggs*versions)
	}
	if n := queryInt(f.t, f.pool, `SELECT count(*) FROM (SELECT event_id FROM applied WHERE consumer = $1 GROUP BY event_id HAVING count(*) > 1) d`, name); n != 0 {
		f.t.Errorf("%d events applied more than once", n)
	}
	f.checkOrder(name)
	if n := queryInt(f.t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = $1`, name); n != 0 {
		f.t.Errorf("%d dead letters", n)
	}
}

// checkOrder checks that each aggregate's events were applied in version
// order, from version 1.
func (f *fixture) checkOrder(name string) {
	f.t.Helper()
	if n := queryInt(f.t, f.pool, `
		SELECT count(*) FROM (
			SELECT version, row_number() OVER (PARTITION BY aggregate_id ORDER BY n) AS pos
			FROM applied WHERE consumer = $1) o
		WHERE version <> pos`, name); n != 0 {
		f.t.Errorf("%d applications out of version order", n)
	}
}

// TestGroupMembersShareAndHandOff runs three members over an 8-partition
// stream while events arrive; one leaves, one joins. Every event is
// applied once and in version order, and the partitions spread.
func TestGroupMembersShareAndHandOff(t *testing.T) {
	f := newFixture(t)
	f.partitionedStream(8)
	cfg := groupConfig(f, 8)
	rec := newRecorder("grp")
	regA := prometheus.NewRegistry()
	stopA := f.runMember(cfg, rec, "a", WithRegisterer(regA))
	f.runMember(cfg, rec, "b")
	f.runMember(cfg, rec, "c")
	f.waitMembers("grp", 3)
	const aggs, versions = 40, 30
	n := 0
	for v := 1; v <= versions; v++ {
		for a := 0; a < aggs; a++ {
			n++
			f.publish(event{ID: uuidN(n), AggID: fmt.Sprintf("agg%d", a), Version: int64(v)})
		}
		switch v {
		case 10:
			f.waitFor("some applied", 30*time.Second, func() bool {
				return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`) >= aggs*5
			})
			// A member stopped before its first assignment is an error
			// (TestGroupRunCancelledBeforeAssignment): a leaves once it owns.
			f.waitOwns(regA, func(n float64) bool { return n > 0 })
			stopA() // leaves: its partitions are handed off
		case 20:
			f.runMember(cfg, rec, "d")
			f.waitMembers("grp", 3)
		}
	}
	f.waitFor("all applied", 60*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`) >= aggs*versions
	})
	f.waitGroupSettled("grp", 8, 30*time.Second)
	f.checkApplied("grp", aggs, versions)
}

// TestGroupLongName: JetStream limits a priority group's name to 16
// characters; a longer group name must still consume (the first release
// passed the name through, and every pull failed with error 10162).
func TestGroupLongName(t *testing.T) {
	f := newFixture(t)
	f.partitionedStream(4)
	const name = "reward-service-consumers"
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = f.js.DeleteKeyValue(ctx, GroupBucket(name))
	})
	cfg := groupConfig(f, 4)
	cfg.Name = name
	f.runMember(cfg, newRecorder(name), "a")
	const aggs, versions = 8, 3
	n := 0
	for v := 1; v <= versions; v++ {
		for a := 0; a < aggs; a++ {
			n++
			f.publish(event{ID: uuidN(n), AggID: fmt.Sprintf("agg%d", a), Version: int64(v)})
		}
	}
	f.waitFor("all applied", 30*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = $1`, name) >= aggs*versions
	})
	f.checkApplied(name, aggs, versions)
	if got := group.PriorityGroup(name); len(got) > 16 || got == group.PriorityGroup(name+"x") {
		t.Errorf("PriorityGroup(%q) = %q: want at most 16 characters (JetStream's limit), distinct from a longer name's", name, got)
	}
}

func TestGroupConfigErrors(t *testing.T) {
	f := newFixture(t)
	base := func() Config { return groupConfig(f, 4) }
	cases := []struct {
		name string
		mod  func(*Config)
		want string
	}{
		{"zero partitions", func(c *Config) { c.Group.Partitions = 0 }, "Group.Partitions is 0: set it to the partition count the stream was set up with"},
		{"invalid name", func(c *Config) { c.Name = "rewards.v2" }, "is not a valid group name"},
		{"initial version 0", func(c *Config) { c.InitialVersion = 0 }, "set InitialVersion to the first version your producer writes"},
		{"filter subjects", func(c *Config) { c.FilterSubjects = []string{"x.>"} }, "FilterSubjects cannot be combined with Group"},
		{"short pinned ttl", func(c *Config) { c.Group.PinnedTTL = 2 * time.Second }, "raise PinnedTTL or leave it 0"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := base()
			g := *cfg.Group
			cfg.Group = &g
			tc.mod(&cfg)
			_, err := New(f.pool, f.js, cfg, newRecorder("x"))
			if !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New: %v, want ErrInvalidConfig containing %q", err, tc.want)
			}
		})
	}
}

func TestGroupStreamErrors(t *testing.T) {
	f := newFixture(t)
	run := func(cfg Config) error {
		c, err := New(f.pool, f.js, cfg, newRecorder("x"), WithLogger(zaptest.NewLogger(t)))
		testenv.Must(t, err, "new")
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return c.Run(ctx)
	}
	// The fixture's stream has no partition transform.
	cfg := groupConfig(f, 4)
	if err := run(cfg); !errors.Is(err, ErrGroupStream) || !strings.Contains(err.Error(), "set nats.partitions in the relay config and run `outbox-relay setup`") {
		t.Fatalf("unpartitioned stream: %v, want ErrGroupStream naming setup", err)
	}
	f.partitionedStream(4)
	cfg = groupConfig(f, 8)
	if err := run(cfg); !errors.Is(err, ErrGroupMismatch) || !strings.Contains(err.Error(), "set Group.Partitions to 4") {
		t.Fatalf("other partition count: %v, want ErrGroupMismatch naming the count", err)
	}
	// A live member of the same name with another count (the stream
	// changed under it) is refused as well.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, err := f.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: GroupBucket("grp"), TTL: 2 * time.Second, Storage: jetstream.MemoryStorage})
	testenv.Must(t, err, "bucket")
	beat := func() { _, _ = kv.Put(ctx, "old-member", []byte("8")) }
	beat()
	stopBeat := make(chan struct{})
	defer close(stopBeat)
	go func() { // keeps the other member alive while Run waits for agreement
		for {
			select {
			case <-stopBeat:
				return
			case <-time.After(300 * time.Millisecond):
				beat()
			}
		}
	}()
	cfg = groupConfig(f, 4)
	if err := run(cfg); !errors.Is(err, ErrGroupMismatch) || !strings.Contains(err.Error(), "two groups cannot share the name grp") {
		t.Fatalf("member with other count: %v, want ErrGroupMismatch", err)
	}
}

// waitGroupSettled waits until no partition durable has pending or
// unacknowledged messages.
func (f *fixture) waitGroupSettled(name string, partitions int, timeout time.Duration) {
	f.t.Helper()
	f.waitFor("partitions settled", timeout, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		for p := range partitions {
			c, err := f.js.Consumer(ctx, f.stream, PartitionDurable(name, partitions, p))
			if err != nil {
				return false
			}
			info, err := c.Info(ctx)
			if err != nil || info.NumPending > 0 || info.NumAckPending > 0 {
				return false
			}
		}
		return true
	})
}

// waitMembers waits until the group has n live members.
func (f *fixture) waitMembers(name string, n int) {
	f.t.Helper()
	f.waitFor(fmt.Sprintf("%d members", n), 30*time.Second, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		kv, err := f.js.KeyValue(ctx, GroupBucket(name))
		if err != nil {
			return false
		}
		keys, err := kv.Keys(ctx)
		return err == nil && len(keys) == n
	})
}

// A member exports its group metrics: members, partitions owned,
// rebalances, and pending and unowned time per partition.
func TestGroupMetrics(t *testing.T) {
	f := newFixture(t)
	f.partitionedStream(4)
	cfg := groupConfig(f, 4)
	g := *cfg.Group
	g.Member = "solo"
	cfg.Group = &g
	rec := newRecorder("grp")
	f.start(cfg, rec)
	for i := range 20 {
		f.publish(event{ID: uuidN(i + 1), AggID: fmt.Sprintf("m%d", i), Version: 1})
	}
	f.waitFor("applied", 30*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`) == 20
	})
	value := f.metric
	f.waitFor("group gauges", 10*time.Second, func() bool {
		members, _ := value("outbox_consumer_group_members")
		owned, _ := value("outbox_consumer_group_partitions_owned")
		rebalances, _ := value("outbox_consumer_group_rebalances_total")
		pending, ps := value("outbox_consumer_group_partition_pending_messages")
		_, us := value("outbox_consumer_group_partition_unowned_seconds")
		return members == 1 && owned == 4 && rebalances >= 1 && ps == 4 && us == 4 && pending == 0
	})
}

// metric sums the series of a gauge or counter of the fixture's registry
// that carry the given label name/value pairs.
func (f *fixture) metric(name string, labels ...string) (sum float64, series int) {
	f.t.Helper()
	return f.metricOf(f.reg, name, labels...)
}

// waitOwns waits until the member registered with reg owns a number of
// partitions that ok accepts.
func (f *fixture) waitOwns(reg prometheus.Gatherer, ok func(owned float64) bool) {
	f.t.Helper()
	f.waitFor("the member's partitions", 30*time.Second, func() bool {
		owned, _ := f.metricOf(reg, "outbox_consumer_group_partitions_owned")
		return ok(owned)
	})
}

// metricOf is metric of the registry reg.
func (f *fixture) metricOf(reg prometheus.Gatherer, name string, labels ...string) (sum float64, series int) {
	f.t.Helper()
	mfs, err := reg.Gather()
	testenv.Must(f.t, err, "gather")
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				if !slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool { return l.GetName() == labels[i] && l.GetValue() == labels[i+1] }) {
					continue series
				}
			}
			series++
			sum += m.GetGauge().GetValue() + m.GetCounter().GetValue()
		}
	}
	return sum, series
}

// TestGroupRunCancelledBeforeAssignment: a member's context cancelled
// while it creates its partition durables, or after that while it waits
// for its first assignment, makes Run return an error wrapping ctx's, as
// a plain durable's set-up does (TestRunCancelledDuringSetUp): the member
// never consumed, so it is not a shutdown. Before, Run returned nil.
func TestGroupRunCancelledBeforeAssignment(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool // the durable is created before the cancel
	}{{"creating the partition durables", false}, {"waiting for the first assignment", true}} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.partitionedStream(2)
			cfg := groupConfig(f, 2)
			cfg.Group.Member = "m1"
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			last := PartitionDurable("grp", 2, 1)
			group.EnsureDurable = func(ectx context.Context, host group.Host, c jetstream.ConsumerConfig, update bool) (jetstream.Consumer, error) {
				if c.Durable != last {
					return host.EnsureDurable(ectx, c, update)
				}
				if tc.ok {
					defer cancel()
				} else {
					cancel()
				}
				return host.EnsureDurable(ectx, c, update)
			}
			t.Cleanup(func() {
				group.EnsureDurable = func(ctx context.Context, host group.Host, c jetstream.ConsumerConfig, update bool) (jetstream.Consumer, error) {
					return host.EnsureDurable(ctx, c, update)
				}
			})
			c, err := New(f.pool, f.js, cfg, newRecorder("grp"), WithRegisterer(f.reg))
			testenv.Must(t, err, "new consumer")
			runCancelled(t, ctx, c)
		})
	}
}

// runCancelled runs c on ctx, which is cancelled during its set-up, and
// checks that Run returns an error wrapping context.Canceled.
func runCancelled(t *testing.T, ctx context.Context, c *Consumer) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var err error
	select {
	case err = <-done:
	case <-time.After(30 * time.Second):
		t.Fatalf("Run did not return after its context was cancelled during the set-up")
	}
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Run = %v, want an error wrapping context.Canceled", err)
	}
}
