package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/consumer/internal/group"
	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// setPartitions changes the partitioned stream's count, as `outbox-relay
// setup` with a new nats.partitions does.
func (f *fixture) setPartitions(n int) {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := f.js.Stream(ctx, f.stream)
	testenv.Must(f.t, err, "stream")
	cfg := s.CachedInfo().Config
	dst, err := contract.PartitionTransform(cfg.SubjectTransform.Source, n)
	testenv.Must(f.t, err, "partition transform")
	cfg.SubjectTransform.Destination = dst
	_, err = f.js.UpdateStream(ctx, cfg)
	testenv.Must(f.t, err, "change the partition count")
}

// publishVersions publishes versions from..to of aggs aggregates, one
// version of every aggregate after the other.
func (f *fixture) publishVersions(aggs, from, to int) {
	f.t.Helper()
	for v := from; v <= to; v++ {
		for a := range aggs {
			f.publish(event{ID: uuidN(v*1000 + a), AggID: fmt.Sprintf("agg%d", a), Version: int64(v)})
		}
	}
}

func (f *fixture) durableGone(name string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err := f.js.Consumer(ctx, f.stream, name)
	return errors.Is(err, jetstream.ErrConsumerNotFound)
}

// TestGroupPartialGenerationDelete changes a group's stream from 4 to 8
// partitions under load, and the second delete of the drained 4-partition
// durables fails (an API timeout, a member stopped mid-way). The change
// must still complete: the failed delete is taken up again, the members
// move to the 8 partitions, and every event is applied once and in order
// (without VersionCheck). Before the fix the removal stopped at the first
// error and the incomplete generation counted as undrained for ever: 20
// of 30 applied, the durables unchanged.
func TestGroupPartialGenerationDelete(t *testing.T) {
	f := newFixture(t)
	f.partitionedStream(4)
	cfg := groupConfig(f, 4)
	cfg.VersionCheck, cfg.InitialVersion = false, 0
	var deletes, failed atomic.Int32
	group.DeleteDurable = func(ctx context.Context, strm jetstream.Stream, name string) error {
		if strings.HasPrefix(name, PartitionDurable("grp", 4, 0)[:len("grp-4-")]) && deletes.Add(1) == 2 {
			failed.Add(1)
			return fmt.Errorf("delete %s: %w", name, context.DeadlineExceeded)
		}
		return strm.DeleteConsumer(ctx, name)
	}
	t.Cleanup(func() {
		group.DeleteDurable = func(ctx context.Context, strm jetstream.Stream, name string) error {
			return strm.DeleteConsumer(ctx, name)
		}
	})
	rec := newRecorder("grp")
	f.runMember(cfg, rec, "a")
	f.runMember(cfg, rec, "b")
	f.waitMembers("grp", 2)
	const aggs = 30
	f.publishVersions(aggs, 1, 10)
	f.setPartitions(8)
	f.publishVersions(aggs, 11, 15)
	f.waitFor("the injected delete failure", 30*time.Second, func() bool { return failed.Load() == 1 })
	// Spread over seconds, so that events keep arriving after the step
	// that met the failure: before the fix, the members went back to the
	// incomplete generation at the next step and never consumed these.
	for v := 16; v <= 20; v++ {
		f.publishVersions(aggs, v, v)
		time.Sleep(500 * time.Millisecond)
	}
	f.waitFor("every event applied", 60*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`) >= aggs*20
	})
	f.waitFor("the 4-partition durables removed", 30*time.Second, func() bool {
		for p := range 4 {
			if !f.durableGone(PartitionDurable("grp", 4, p)) {
				return false
			}
		}
		return true
	})
	if failed.Load() != 1 {
		t.Errorf("%d deletes failed, want the injected one", failed.Load())
	}
	f.waitGroupSettled("grp", 8, 30*time.Second)
	f.checkApplied("grp", aggs, 20)
}

// TestGroupPartitionCountBack changes the count 4 → 8 → 4 while the
// 4-partition durables still hold events (their messages are failing and
// retried): generation 4 then holds events from before and after
// generation 8's, so consuming either first would apply some aggregates'
// events out of order. The second generation 4's events are stored, and
// the held ones released, at once after the change back, while the member
// may still consume generation 4 as the older one for up to a step: it
// must apply none of them (the fence of the draining generation). Then
// the members consume neither generation (ErrGroupMismatch, logged with
// the fix, and the draining gauge set): nothing written after the first
// change is applied, and nothing out of order. Before the fence, beside
// six busy loops, 2 events were applied out of order.
func TestGroupPartitionCountBack(t *testing.T) {
	f := newFixture(t)
	f.partitionedStream(4)
	cfg := groupConfig(f, 4)
	cfg.VersionCheck, cfg.InitialVersion = false, 0
	cfg.Group.Member = "solo"
	var hold atomic.Bool
	rec := newRecorder("grp")
	rec.fail = func(*Message, int) error {
		if hold.Load() {
			return Transient(errors.New("held: the partition stays undrained"))
		}
		return nil
	}
	f.start(cfg, rec)
	const aggs = 12
	applied := func() int64 { return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`) }
	f.publishVersions(aggs, 1, 1)
	f.waitFor("version 1 applied", 30*time.Second, func() bool { return applied() == aggs })
	hold.Store(true)
	f.publishVersions(aggs, 2, 2) // generation 4, held
	f.setPartitions(8)
	f.waitFor("the 8-partition durables", 30*time.Second, func() bool { return !f.durableGone(PartitionDurable("grp", 8, 7)) })
	f.publishVersions(aggs, 3, 3) // generation 8
	f.setPartitions(4)
	f.publishVersions(aggs, 4, 4) // generation 4 again, after generation 8's
	hold.Store(false)             // version 2 may be applied now, in order
	f.waitFor("the refusal: nothing owned, generation 8 reported draining", 30*time.Second, func() bool {
		owned, _ := f.metric("outbox_consumer_group_partitions_owned")
		_, n := f.metric("outbox_consumer_group_generation_draining_seconds", "partitions", "8")
		return owned == 0 && n > 0
	})
	// Nothing of generation 8 or of the second generation 4 may be applied.
	if testenv.WaitFor(5*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp' AND version > 2`) > 0
	}) {
		t.Errorf("events written after the first change were applied while the count was back: %d",
			queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp' AND version > 2`))
	}
	if n := queryInt(t, f.pool, `
		SELECT count(*) FROM (
			SELECT version, row_number() OVER (PARTITION BY aggregate_id ORDER BY n) AS pos
			FROM applied WHERE consumer = 'grp') o
		WHERE version <> pos`); n != 0 {
		t.Errorf("%d applications out of version order", n)
	}
}

// TestGroupMemberStartsDespiteTimeouts: the first requests that create or
// check a member's partition durables at its start time out (a loaded
// server: a late-joining member of TestGroupProcessesKillAndJoin exited
// with "partition durable grp-8-7 ...: context deadline exceeded" beside
// six busy loops). The member must retry and consume, not exit.
func TestGroupMemberStartsDespiteTimeouts(t *testing.T) {
	f := newFixture(t)
	f.partitionedStream(4)
	cfg := groupConfig(f, 4)
	var calls atomic.Int32
	group.EnsureDurable = func(ctx context.Context, host group.Host, c jetstream.ConsumerConfig, update bool) (jetstream.Consumer, error) {
		if update && calls.Add(1) <= 2 {
			return nil, fmt.Errorf("partition durable %s: %w", c.Durable, context.DeadlineExceeded)
		}
		return host.EnsureDurable(ctx, c, update)
	}
	t.Cleanup(func() {
		group.EnsureDurable = func(ctx context.Context, host group.Host, c jetstream.ConsumerConfig, update bool) (jetstream.Consumer, error) {
			return host.EnsureDurable(ctx, c, update)
		}
	})
	rec := newRecorder("grp")
	f.start(cfg, rec)
	const aggs = 8
	f.publishVersions(aggs, 1, 3)
	f.waitFor("every event applied", 60*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`) >= aggs*3
	})
	if calls.Load() < 3 {
		t.Errorf("%d start-up durable calls, want the 2 failed ones retried", calls.Load())
	}
}

// newUnversionedGroup is a fixture over a stream of partitions, the
// group configuration for it without VersionCheck (so that only the
// group keeps the order), and a recorder.
func newUnversionedGroup(t *testing.T, partitions int) (*fixture, Config, *recorder) {
	f := newFixture(t)
	f.partitionedStream(partitions)
	cfg := groupConfig(f, partitions)
	cfg.VersionCheck, cfg.InitialVersion = false, 0
	return f, cfg, newRecorder("grp")
}

// waitApplied waits until the group grp applied n events.
func (f *fixture) waitApplied(n int) {
	f.t.Helper()
	f.waitFor(fmt.Sprintf("%d events applied", n), 30*time.Second, func() bool {
		return queryInt(f.t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`) >= int64(n)
	})
}

// changeWhileStopped runs two members over a 4-partition stream until
// version 1 of aggs aggregates is applied and settled, stops them, and
// then, with no member running, changes the stream's count to each of
// counts in turn, storing the next version of every aggregate under each.
func (f *fixture) changeWhileStopped(cfg Config, h Handler, aggs int, counts ...int) {
	f.t.Helper()
	regA, regB := prometheus.NewRegistry(), prometheus.NewRegistry()
	stopA := f.runMember(cfg, h, "a", WithRegisterer(regA))
	stopB := f.runMember(cfg, h, "b", WithRegisterer(regB))
	f.publishVersions(aggs, 1, 1)
	f.waitFor("version 1 applied", 30*time.Second, func() bool {
		return queryInt(f.t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`) == int64(aggs)
	})
	f.waitGroupSettled("grp", 4, 30*time.Second)
	for _, reg := range []prometheus.Gatherer{regA, regB} {
		f.waitOwns(reg, func(n float64) bool { return n == 2 }) // both past their first assignment
	}
	stopA()
	stopB()
	for i, n := range counts {
		f.setPartitions(n)
		f.publishVersions(aggs, i+2, i+2)
	}
}

// memberConfig is cfg for member with partitions.
func memberConfig(cfg Config, member string, partitions int) Config {
	g := *cfg.Group
	g.Member, g.Partitions = member, partitions
	cfg.Group = &g
	return cfg
}

// refusedFor waits until the draining gauge of f's registry reports the
// partition count n, or anything beyond version upTo is applied; it
// reports whether the refusal came.
func (f *fixture) refusedFor(n int, upTo int) bool {
	f.t.Helper()
	refused := func() bool {
		_, series := f.metric("outbox_consumer_group_generation_draining_seconds", "partitions", strconv.Itoa(n))
		return series > 0
	}
	beyond := func() int64 {
		return queryInt(f.t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp' AND version > $1`, upTo)
	}
	f.waitFor("the refusal or an application", 30*time.Second, func() bool { return refused() || beyond() > 0 })
	if !refused() {
		f.t.Errorf("no refusal: the draining gauge of generation %d is not set", n)
	}
	if owned, _ := f.metric("outbox_consumer_group_partitions_owned"); owned != 0 {
		f.t.Errorf("a member owns %v partitions while refusing", owned)
	}
	if testenv.WaitFor(5*time.Second, func() bool { return beyond() > 0 }) {
		f.t.Errorf("%d events beyond version %d applied, want none while refusing", beyond(), upTo)
	}
	return refused()
}

// TestGroupPartitionCountBackWhileStopped changes the count 4 → 8 → 4
// while every member is stopped, with events stored under each count:
// generation 8 never had durables, so its events sit on subjects no
// durable filters, and generation 4's durables hold the events stored
// after them. Members started again with 4 must consume nothing of it and
// refuse (ErrGroupMismatch, the draining gauge for 8 set), not apply the
// later events and lose generation 8's. Before the check the members
// applied version 3 of every aggregate and never version 2. The fix the
// error names is no way out here: members restarted with the count set to
// 8 again must go on refusing, not apply generation 4's version 3 before
// generation 8's version 2.
func TestGroupPartitionCountBackWhileStopped(t *testing.T) {
	f, cfg, rec := newUnversionedGroup(t, 4)
	f.changeWhileStopped(cfg, rec, 10, 8, 4)
	stopA := f.runMember(cfg, rec, "a")
	f.start(memberConfig(cfg, "b", 4), rec)
	f.refusedFor(8, 1)
	stopA()
	// As the wrong fix would: back to 8, members with 8.
	f.setPartitions(8)
	f.runMember(memberConfig(cfg, "c", 8), rec, "c")
	f.waitMembers("grp", 2)
	f.refusedFor(4, 1)
	f.checkOrder("grp")
}

// TestGroupPartitionCountBackWhileStoppedRecovers: 4 → 8 → 4 while every
// member is stopped, with events stored under 8 only. Members started
// with 4 refuse; set to 8 again, as the error says, the group applies
// every event once and in order, generation 4's durables removed.
func TestGroupPartitionCountBackWhileStoppedRecovers(t *testing.T) {
	f, cfg, rec := newUnversionedGroup(t, 4)
	const aggs = 10
	f.changeWhileStopped(cfg, rec, aggs, 8)
	f.setPartitions(4)
	stopA := f.runMember(cfg, rec, "a", WithRegisterer(f.reg))
	f.refusedFor(8, 1)
	stopA()
	f.setPartitions(8)
	f.runMember(memberConfig(cfg, "a", 8), rec, "a")
	f.runMember(memberConfig(cfg, "b", 8), rec, "b")
	f.publishVersions(aggs, 3, 3)
	f.waitApplied(aggs * 3)
	f.waitFor("the 4-partition durables removed", 30*time.Second, func() bool { return f.durableGone(PartitionDurable("grp", 4, 0)) })
	f.checkApplied("grp", aggs, 3)
}

// TestGroupPartitionCountChangedWhileStopped: 4 → 8 while every member is
// stopped, with events stored before the change that generation 4 has not
// delivered yet and events after it. A member started with 4 is refused;
// members started with 8 apply generation 4's events, then generation 8's.
func TestGroupPartitionCountChangedWhileStopped(t *testing.T) {
	f, cfg, rec := newUnversionedGroup(t, 4)
	const aggs = 10
	f.changeWhileStopped(cfg, rec, aggs, 4, 8) // version 2 under 4, undelivered
	old, err := New(f.pool, f.js, memberConfig(cfg, "a", 4), rec, WithLogger(zaptest.NewLogger(t)))
	testenv.Must(t, err, "new member")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := old.Run(ctx); !errors.Is(err, ErrGroupMismatch) {
		t.Fatalf("member with the old count: %v, want ErrGroupMismatch", err)
	}
	f.runMember(memberConfig(cfg, "a", 8), rec, "a")
	f.runMember(memberConfig(cfg, "b", 8), rec, "b")
	f.waitApplied(aggs * 3)
	f.checkApplied("grp", aggs, 3)
}

// TestGroupStraysLookInSmallConsumers: 4 → 1000 → 4 while every member is
// stopped, with events stored under 1000. A member started with 4 must
// find them (1000 is among the last counts the look for strays reads) and
// refuse, and the look must put no more than 128 filters in one consumer:
// the server compares a consumer's filters pairwise, and the single
// consumer with a filter for each of the 1,023 counts without durables
// took it 0.7 to 2.5 s beside six busy loops, past the look's deadline
// when the test ran at a lower priority, so that a member retried the look
// at every step and never started consuming
// (TestGroupHandOffUnpinsNewOwner, "timed out after 30s waiting for a
// applied"). It put 1,023 filters in one consumer before the fix.
func TestGroupStraysLookInSmallConsumers(t *testing.T) {
	f, cfg, rec := newUnversionedGroup(t, 4)
	nc, err := nats.Connect(testenv.Get(t).NATS.URL)
	testenv.Must(t, err, "connect to nats")
	t.Cleanup(nc.Close)
	var most atomic.Int64 // the most filters in one consumer created on the stream
	sub, err := nc.Subscribe("$JS.API.CONSUMER.CREATE."+f.stream+".>", func(m *nats.Msg) {
		var req struct {
			Config jetstream.ConsumerConfig `json:"config"`
		}
		if json.Unmarshal(m.Data, &req) != nil {
			return
		}
		for n := int64(len(req.Config.FilterSubjects)); ; {
			if cur := most.Load(); n <= cur || most.CompareAndSwap(cur, n) {
				break
			}
		}
	})
	testenv.Must(t, err, "watch consumer creation")
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	testenv.Must(t, nc.Flush(), "flush the subscription")
	f.changeWhileStopped(cfg, rec, 10, 1000)
	f.setPartitions(4)
	f.runMember(cfg, rec, "a", WithRegisterer(f.reg))
	f.refusedFor(1000, 1)
	if n := most.Load(); n > 128 {
		t.Errorf("the look for strays put %d filters in one consumer, want at most 128", n)
	}
}

// TestGroupJoinBesideMemberOnOldCount: after a 4 → 8 change, a member of
// the group still heartbeats 4 for longer than the member TTL (its steps
// come late on a starved machine: 12 s late against a TTL of 3 s in
// internal/grouptest at nice 10 beside six busy loops). A member started
// with 8 must join beside it, not exit with ErrGroupMismatch: the group
// has 4-partition durables on this stream, so 4 is this group's count, not
// another group's. Before the fix the new member gave the other one a
// member TTL and then refused ("member lag of group grp runs with 4
// partitions, this one with Group.Partitions 8"). Once the late member
// leaves, every event is applied once and in order.
func TestGroupJoinBesideMemberOnOldCount(t *testing.T) {
	f, cfg, rec := newUnversionedGroup(t, 4)
	const aggs = 10
	f.changeWhileStopped(cfg, rec, aggs, 4, 8) // version 2 under 4, undelivered
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	kv, err := f.js.KeyValue(ctx, GroupBucket("grp"))
	testenv.Must(t, err, "group bucket")
	beatCtx, stopBeat := context.WithCancel(ctx)
	beating := make(chan struct{})
	go func() { // the late member: alive, still on 4
		defer close(beating)
		for beatCtx.Err() == nil {
			_, _ = kv.Put(beatCtx, "lag", []byte("4"))
			select {
			case <-beatCtx.Done():
			case <-time.After(300 * time.Millisecond):
			}
		}
	}()
	defer func() { stopBeat(); <-beating }()
	f.waitMembers("grp", 1)

	c, err := New(f.pool, f.js, memberConfig(cfg, "new", 8), rec, WithLogger(zaptest.NewLogger(t).Named("new")))
	testenv.Must(t, err, "new member")
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	// Three member TTLs: the old join gave up after one.
	select {
	case err := <-done:
		t.Fatalf("the new member beside a member still on 4 partitions: Run returned %v, want it to join and run", err)
	case <-time.After(3 * cfg.Group.MemberTTL):
	}
	stopBeat()
	<-beating
	testenv.Must(t, kv.Delete(ctx, "lag"), "the late member leaves")
	f.waitApplied(aggs * 3)
	stop()
	if err := <-done; err != nil {
		t.Fatalf("new member: Run: %v", err)
	}
	f.checkApplied("grp", aggs, 3)
}
