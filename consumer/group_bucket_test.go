package consumer

// A running member's lost member bucket: deleted, and created again by a
// member or by someone else, while members run. Written first as a
// helper's attack, kept as tests.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// usedBucket creates the group bucket as the members do and stores n
// puts in it (a bucket in use for a while: its stream's sequence is at
// n), then deletes the filler key so that it is no member.
func (f *fixture) usedBucket(ttl time.Duration, n int) {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	kv, err := f.js.CreateKeyValue(ctx, bucketConfig(ttl))
	testenv.Must(f.t, err, "group bucket")
	for i := range n {
		if _, err := kv.Put(ctx, "filler", []byte("4")); err != nil {
			f.t.Fatalf("put %d: %v", i, err)
		}
	}
	testenv.Must(f.t, kv.Delete(ctx, "filler"), "delete filler")
}

// usedBucketPuts is the puts stored before the members start: a bucket
// in use for a while, whose stream's sequence is far above a new one's.
const usedBucketPuts = 2000

func bucketConfig(ttl time.Duration) jetstream.KeyValueConfig {
	return jetstream.KeyValueConfig{
		Bucket:      GroupBucket("grp"),
		Description: "outbox-relay consumer group members (heartbeats)",
		TTL:         ttl,
		History:     1,
		Storage:     jetstream.FileStorage,
	}
}

// runMemberWith runs member on js with its own registry until the test ends.
func (f *fixture) runMemberWith(js jetstream.JetStream, cfg Config, member string, partitions int) (prometheus.Gatherer, chan error) {
	f.t.Helper()
	reg := prometheus.NewRegistry()
	log, _ := observedLogger(f.t, member)
	done, _ := f.runJoiner(js, cfg, member, partitions, log, WithRegisterer(reg))
	return reg, done
}

// consumingGroup starts members ids of group grp on js over a new
// 4-partition stream (its bucket in use for a while when used), publishes
// version 1 of aggs aggregates, and waits until it is applied and every
// member owns its share of the partitions.
func (f *fixture) consumingGroup(js jetstream.JetStream, used bool, aggs int, ids ...string) (Config, []prometheus.Gatherer, []chan error) {
	f.t.Helper()
	f.partitionedStream(4)
	cfg := groupConfig(f, 4)
	if used {
		f.usedBucket(cfg.Group.MemberTTL, usedBucketPuts)
	}
	var regs []prometheus.Gatherer
	var dones []chan error
	for _, id := range ids {
		reg, done := f.runMemberWith(js, cfg, id, 4)
		regs, dones = append(regs, reg), append(dones, done)
	}
	f.publishVersions(aggs, 1, 1)
	f.waitApplied(aggs)
	for _, reg := range regs {
		f.waitOwns(reg, func(n float64) bool { return n == float64(4/len(ids)) })
	}
	return cfg, regs, dones
}

// deleteBucket deletes group grp's member bucket under its members.
func (f *fixture) deleteBucket() {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	testenv.Must(f.t, f.js.DeleteKeyValue(ctx, GroupBucket("grp")), "delete the bucket")
}

func (f *fixture) appliedCount() int64 {
	return queryInt(f.t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`)
}

// TestGroupBucketRecreatedByAnotherWhileRunning: the member bucket, in
// use for a while, is deleted (an operator's `nats kv del`, a NATS restart
// that lost a memory bucket of an earlier version) and created again by
// someone else before this member's next heartbeat: in a group, by the
// other member whose heartbeat failed first. This member's heartbeats then
// succeed, so nothing made it reopen the bucket or restart its roster
// watch; the watch's ordered consumer, its stream gone, reset itself after
// missed heartbeats onto the new stream at the old stream's sequence + 1,
// and so missed every entry of the new bucket until its sequence passed
// the old one. The member's roster emptied (not even itself was live), it
// handed off every partition and consumed nothing (8 of 16 applied after
// a minute). The watch now starts anew at the member's first heartbeat
// stored in the new bucket, whose revision is below its previous one
// (roster.ownHeard).
func TestGroupBucketRecreatedByAnotherWhileRunning(t *testing.T) {
	f := newFixture(t)
	const aggs = 8
	cfg, regs, dones := f.consumingGroup(f.js, true, aggs, "m")
	reg, done := regs[0], dones[0]
	ttl := cfg.Group.MemberTTL

	// Deleted, and created again at once by "the other member".
	f.deleteBucket()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	_, err := f.js.CreateKeyValue(ctx, bucketConfig(ttl))
	cancel()
	testenv.Must(t, err, "create the bucket again")
	f.rosterShrinks(5*ttl, reg)
	f.publishVersions(aggs, 2, 2)
	deadline := 60 * time.Second
	ok, exited := whileRunning(deadline, func() bool {
		members, _ := f.metricOf(reg, "outbox_consumer_group_members")
		return f.appliedCount() == 2*aggs && members == 1
	}, done)
	members, _ := f.metricOf(reg, "outbox_consumer_group_members")
	owned, _ := f.metricOf(reg, "outbox_consumer_group_partitions_owned")
	switch {
	case exited != nil:
		t.Errorf("the member exited after its bucket was re-created: %v", exited)
	case !ok:
		t.Errorf("%s after the bucket was deleted and re-created by another, the member has applied %d of %d (its roster: %v members, it owns %v partitions); %s",
			deadline, f.appliedCount(), 2*aggs, members, owned, f.bucketWatches())
	}
}

// TestGroupBucketDeletedTwoMembers: the realistic form of the above. Two
// members run; the bucket (in use for a while) is deleted. The member
// whose heartbeat fails first re-creates it; the other's next heartbeat
// succeeds on the new bucket. Before the watch started anew on missed own
// heartbeats, that member's roster emptied and it owned nothing, while
// the first, which saw both, took only its half: half the partitions went
// unconsumed (24 of 32 applied after a minute).
func TestGroupBucketDeletedTwoMembers(t *testing.T) {
	f := newFixture(t)
	const aggs = 16
	cfg, regs, dones := f.consumingGroup(f.js, true, aggs, "a", "b")
	regA, regB, doneA, doneB := regs[0], regs[1], dones[0], dones[1]
	ttl := cfg.Group.MemberTTL

	f.deleteBucket()
	f.rosterShrinks(5*ttl, regA, regB)
	f.publishVersions(aggs, 2, 2)
	deadline := 60 * time.Second
	ok, exited := whileRunning(deadline, func() bool {
		a, _ := f.metricOf(regA, "outbox_consumer_group_members")
		b, _ := f.metricOf(regB, "outbox_consumer_group_members")
		return f.appliedCount() == 2*aggs && a == 2 && b == 2
	}, doneA, doneB)
	state := func() string {
		var s string
		for i, reg := range []prometheus.Gatherer{regA, regB} {
			members, _ := f.metricOf(reg, "outbox_consumer_group_members")
			owned, _ := f.metricOf(reg, "outbox_consumer_group_partitions_owned")
			s += fmt.Sprintf(" %c: roster %v members, owns %v;", 'a'+i, members, owned)
		}
		return s
	}
	switch {
	case exited != nil:
		t.Errorf("a member exited after the bucket was deleted: %v", exited)
	case !ok:
		t.Errorf("%s after the bucket was deleted, the group has applied %d of %d:%s %s", deadline, f.appliedCount(), 2*aggs, state(), f.bucketWatches())
	}
}

// TestGroupLostBucketPutTimesOut: a heartbeat Put that times out does not
// reopen the bucket (TestGroupHeartbeatTimeoutKeepsBucket). Where a lost
// bucket makes the Put time out instead of answering no-responders (here
// simulated; across a JetStream domain or a leaf node, say), the roster
// watch re-creates it, and the member goes on consuming.
func TestGroupLostBucketPutTimesOut(t *testing.T) {
	f := newFixture(t)
	const aggs = 8
	js := &faultJS{JetStream: f.js}
	js.put = func(kv jetstream.KeyValue, ctx context.Context, key string, value []byte) (uint64, error) {
		rev, err := kv.Put(ctx, key, value)
		if errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders) {
			return 0, fmt.Errorf("put %s: %w", key, nats.ErrTimeout)
		}
		return rev, err
	}
	cfg, regs, dones := f.consumingGroup(js, false, aggs, "m")
	reg, done := regs[0], dones[0]
	opened := js.opened.Load()
	t0 := time.Now()
	f.deleteBucket()
	f.publishVersions(aggs, 2, 2)
	deadline := 60 * time.Second
	recovered := f.recovered(reg, cfg.Group.MemberTTL)
	ok, exited := whileRunning(deadline, func() bool {
		return recovered() && f.appliedCount() == 2*aggs
	}, done)
	switch {
	case exited != nil:
		t.Errorf("the member exited: %v", exited)
	case !ok:
		t.Errorf("%s after the bucket was lost (puts time out), applied %d of %d, bucket re-created: %v, openings since: %d",
			deadline, f.appliedCount(), 2*aggs, f.bucketExists(), js.opened.Load()-opened)
	default:
		t.Logf("recovered %s after the loss (bucket openings since: %d)", time.Since(t0).Round(time.Millisecond), js.opened.Load()-opened)
	}
}

// recovered returns a condition: group grp's member bucket exists again
// and the member of reg has counted itself live in it for two member
// TTLs, which a roster still on the lost bucket would not have.
func (f *fixture) recovered(reg prometheus.Gatherer, ttl time.Duration) func() bool {
	var since time.Time
	return func() bool {
		if members, _ := f.metricOf(reg, "outbox_consumer_group_members"); members != 1 || !f.bucketExists() {
			since = time.Time{}
			return false
		}
		if since.IsZero() {
			since = time.Now()
		}
		return time.Since(since) > 2*ttl
	}
}

// rosterShrinks polls the members gauges of regs for up to d and returns
// once one shows fewer members than it did at the call (a live member lost
// from that member's roster, as when its watch stops delivering), or after
// d: the tests publish after it, so that what they wait for needs the
// roster whole again.
func (f *fixture) rosterShrinks(d time.Duration, regs ...prometheus.Gatherer) {
	f.t.Helper()
	var want []float64
	for _, reg := range regs {
		n, _ := f.metricOf(reg, "outbox_consumer_group_members")
		want = append(want, n)
	}
	testenv.WaitFor(d, func() bool {
		for i, reg := range regs {
			if n, _ := f.metricOf(reg, "outbox_consumer_group_members"); n < want[i] {
				return true
			}
		}
		return false
	})
}

// TestGroupBucketDeletedAlone: a lone member's bucket is deleted while
// it runs, and nobody else re-creates it: its own heartbeat gets no
// responders, re-creates the bucket and restarts the watch. The member
// goes on consuming, and counts itself again.
func TestGroupBucketDeletedAlone(t *testing.T) {
	f := newFixture(t)
	const aggs = 8
	js := &faultJS{JetStream: f.js}
	cfg, regs, dones := f.consumingGroup(js, true, aggs, "m")
	reg, done := regs[0], dones[0]
	opened := js.opened.Load()
	f.deleteBucket()
	f.publishVersions(aggs, 2, 2)
	deadline := 60 * time.Second
	recovered := f.recovered(reg, cfg.Group.MemberTTL)
	ok, exited := whileRunning(deadline, func() bool {
		return recovered() && f.appliedCount() == 2*aggs
	}, done)
	switch {
	case exited != nil:
		t.Errorf("the member exited: %v", exited)
	case !ok:
		t.Errorf("%s after the bucket was lost, applied %d of %d (openings since: %d)", deadline, f.appliedCount(), 2*aggs, js.opened.Load()-opened)
	}
	t.Logf("bucket openings since the loss: %d", js.opened.Load()-opened)
}

// bucketWatches describes the bucket stream's consumers (the members'
// roster watches): where each starts, against the stream's last sequence.
func (f *fixture) bucketWatches() string {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := f.js.Stream(ctx, "KV_"+GroupBucket("grp"))
	if err != nil {
		return fmt.Sprintf("bucket stream: %v", err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return fmt.Sprintf("bucket stream info: %v", err)
	}
	out := fmt.Sprintf("bucket stream last sequence %d; watches:", info.State.LastSeq)
	l := s.ListConsumers(ctx)
	for ci := range l.Info() {
		out += fmt.Sprintf(" [deliver %s, start sequence %d, delivered up to stream sequence %d]", ci.Config.DeliverPolicy, ci.Config.OptStartSeq, ci.Delivered.Stream)
	}
	return out
}

// lagWatch hands on the entries of the roster's watch w lag() after they
// arrive (a starved machine's watch), and none at all while stalled()
// reports true (a watch that stopped delivering).
func lagWatch(w jetstream.KeyWatcher, lag func() time.Duration, stalled func() bool) jetstream.KeyWatcher {
	l := &laggingWatcher{KeyWatcher: w, out: make(chan jetstream.KeyValueEntry), stop: make(chan struct{})}
	type due struct {
		e  jetstream.KeyValueEntry
		at time.Time
	}
	q := make(chan due, 4096)
	go func() {
		defer close(q)
		for {
			select {
			case e, ok := <-w.Updates():
				if !ok {
					return
				}
				select {
				case q <- due{e, time.Now().Add(lag())}:
				case <-l.stop:
					return
				}
			case <-l.stop:
				return
			}
		}
	}()
	go func() {
		defer close(l.out)
		for d := range q {
			if d.e != nil && stalled() {
				continue
			}
			select {
			case <-time.After(time.Until(d.at)):
			case <-l.stop:
				return
			}
			select {
			case l.out <- d.e:
			case <-l.stop:
				return
			}
		}
	}()
	return l
}

type laggingWatcher struct {
	jetstream.KeyWatcher
	out  chan jetstream.KeyValueEntry
	stop chan struct{}
	once sync.Once
}

func (l *laggingWatcher) Updates() <-chan jetstream.KeyValueEntry { return l.out }

func (l *laggingWatcher) Stop() error {
	l.once.Do(func() { close(l.stop) })
	return l.KeyWatcher.Stop()
}

// watchFaults are what the roster watches made through js do: hand
// entries on lag after they arrive, and none at all from the first watch
// while stallFirst is set. watches counts the watches started.
type watchFaults struct {
	lag        atomic.Int64 // time.Duration
	stallFirst atomic.Bool
	watches    atomic.Int32
}

func (wf *watchFaults) js(base jetstream.JetStream) *faultJS {
	js := &faultJS{JetStream: base}
	js.watch = func(kv jetstream.KeyValue, ctx context.Context, opts ...jetstream.WatchOpt) (jetstream.KeyWatcher, error) {
		w, err := kv.WatchAll(ctx, opts...)
		if err != nil {
			return w, err
		}
		first := wf.watches.Add(1) == 1
		return lagWatch(w,
			func() time.Duration { return time.Duration(wf.lag.Load()) },
			func() bool { return first && wf.stallFirst.Load() }), nil
	}
	return js
}

// TestGroupLaggingWatchKeepsGoing: on a starved machine the roster watch
// delivers the member's own heartbeats more than a member TTL after they
// are stored (the group tests at nice 10 beside six busy loops). The watch
// was started anew whenever none came for a TTL: in those runs several
// times per test, each time a consumer's creation more for a starved
// server, and a warning that asked whether the bucket had been deleted.
// A watch that delivers entries is now kept for three TTLs; one that
// delivers nothing at all is started anew after one (TestRosterOwnHeard).
// Here member m's watch hands every entry on 1.5 TTLs late from its
// start, while member n's heartbeats keep it delivering.
func TestGroupLaggingWatchKeepsGoing(t *testing.T) {
	f := newFixture(t)
	const aggs = 8
	f.partitionedStream(4)
	cfg := groupConfig(f, 4)
	ttl := cfg.Group.MemberTTL
	var wf watchFaults
	wf.lag.Store(int64(3 * ttl / 2))
	regM, doneM := f.runMemberWith(wf.js(f.js), cfg, "m", 4)
	regN, doneN := f.runMemberWith(f.js, cfg, "n", 4)
	f.publishVersions(aggs, 1, 1)
	f.waitApplied(aggs)
	for _, reg := range []prometheus.Gatherer{regM, regN} {
		f.waitOwns(reg, func(n float64) bool { return n == 2 })
	}
	f.publishVersions(aggs, 2, 2)
	// Long enough for a watch started anew after one TTL to show.
	restarted, exited := whileRunning(6*ttl, func() bool { return wf.watches.Load() > 1 }, doneM, doneN)
	members, _ := f.metricOf(regM, "outbox_consumer_group_members")
	switch {
	case exited != nil:
		t.Errorf("a member exited: %v", exited)
	case restarted:
		t.Errorf("the roster watch, delivering %s late, was started anew (%d watches)", 3*ttl/2, wf.watches.Load())
	case f.appliedCount() != 2*aggs || members != 2:
		t.Errorf("%s with m's watch %s late: applied %d of %d, m's roster %v members", 6*ttl, 3*ttl/2, f.appliedCount(), 2*aggs, members)
	}
}

// TestGroupStalledWatchStartsAnew: a roster watch that stops delivering
// while the bucket stays (as when a NATS restart lost its consumer, before
// nats.go's ordered consumer notices) is started anew a member TTL after
// the member's heartbeat; the member, its roster emptied meanwhile, goes
// on consuming.
func TestGroupStalledWatchStartsAnew(t *testing.T) {
	f := newFixture(t)
	const aggs = 8
	var wf watchFaults
	cfg, regs, dones := f.consumingGroup(wf.js(f.js), false, aggs, "m")
	reg, done, ttl := regs[0], dones[0], cfg.Group.MemberTTL
	wf.stallFirst.Store(true)
	t0 := time.Now()
	f.publishVersions(aggs, 2, 2)
	deadline := 60 * time.Second
	ok, exited := whileRunning(deadline, func() bool {
		members, _ := f.metricOf(reg, "outbox_consumer_group_members")
		return wf.watches.Load() > 1 && f.appliedCount() == 2*aggs && members == 1
	}, done)
	members, _ := f.metricOf(reg, "outbox_consumer_group_members")
	switch {
	case exited != nil:
		t.Errorf("the member exited: %v", exited)
	case !ok:
		t.Errorf("%s after its roster watch stalled: %d watches, applied %d of %d, roster %v members", deadline, wf.watches.Load(), f.appliedCount(), 2*aggs, members)
	default:
		t.Logf("recovered %s after the stall (member TTL %s)", time.Since(t0).Round(time.Millisecond), ttl)
	}
}
