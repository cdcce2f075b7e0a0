package consumer

// A group's roster across a NATS server restart and a young bucket created
// again by someone else. Written first as a helper's attack on the roster
// watch's restart rules (branch attack9), kept as tests: the rule that
// waited three member TTLs for a silent watch left every partition
// unowned for 6.7 s after a NATS restart at TTL 2 s (12 s at the default
// 6 s), against 0.3–2.6 s before it.

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// unowned polls the owned-partitions gauges of regs every 20 ms until
// done holds (checked once at least atLeast has passed, while all want
// partitions are owned) or d has passed, and returns the longest stretch
// in which fewer than want were owned in all.
func (f *fixture) unowned(atLeast, d time.Duration, want float64, done func() bool, regs ...prometheus.Gatherer) (longest time.Duration, ok bool) {
	f.t.Helper()
	start := time.Now()
	var since time.Time
	for time.Since(start) < d {
		var sum float64
		for _, reg := range regs {
			n, _ := f.metricOf(reg, "outbox_consumer_group_partitions_owned")
			sum += n
		}
		switch {
		case sum < want:
			if since.IsZero() {
				since = time.Now()
			}
			longest = max(longest, time.Since(since))
		default:
			since = time.Time{}
			if time.Since(start) > atLeast && done() {
				return longest, true
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	return longest, false
}

// appliedTwice is how many of group grp's applications repeat an
// (aggregate, version) already applied.
func (f *fixture) appliedTwice() int64 {
	return queryInt(f.t, f.pool, `SELECT count(*) - count(DISTINCT (aggregate_id, version)) FROM applied WHERE consumer = 'grp'`)
}

// bothWhole is a condition: every event of versions 1 and 2 of aggs
// aggregates applied, and both members' rosters count two members.
func (f *fixture) bothWhole(aggs int, a, b prometheus.Gatherer) func() bool {
	return func() bool {
		ma, _ := f.metricOf(a, "outbox_consumer_group_members")
		mb, _ := f.metricOf(b, "outbox_consumer_group_members")
		return f.appliedCount() == int64(2*aggs) && ma == 2 && mb == 2
	}
}

// TestGroupNATSRestartKeepsPartitions: the single NATS server (file
// storage) restarts under two running members; nothing is deleted. The
// watches' ordered consumers live in the server's memory and are lost;
// nats.go notices after two missed idle heartbeats (10 s), while each
// roster, its own member included, expires after one member TTL, and
// the members hand every partition off. A member now watches anew when
// its watch has delivered nothing since the first heartbeat after its
// connection reconnected, before its roster expires. No "created again" (the stream's sequence went on), every
// event applied once.
func TestGroupNATSRestartKeepsPartitions(t *testing.T) {
	t.Parallel() // its own NATS server and database
	const aggs = 16
	g := startOwnGroup(t, jetstream.FileStorage, false, aggs) // a NATS restart keeps the stream
	f, n, ttl, regs, dones, logs := g.f, g.nats, g.ttl, g.regs, g.dones, g.logs

	n.Stop()
	time.Sleep(500 * time.Millisecond) // the server is down this long
	testenv.Must(t, n.Start(), "restart nats")
	testenv.WaitFor(30*time.Second, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := f.js.Stream(ctx, f.stream)
		return err == nil
	})
	f.publishVersions(aggs, 2, 2)
	longest, ok := f.unowned(8*ttl, 60*time.Second, 4, f.bothWhole(aggs, regs[0], regs[1]), regs...)
	for i, done := range dones {
		select {
		case err := <-done:
			t.Errorf("member %d exited: %v", i, err)
		default:
		}
	}
	var createdAgain int
	for _, obs := range logs {
		createdAgain += logCount(obs, errBucketCreatedAgainText)
	}
	twice := f.appliedTwice()
	t.Logf("after the restart: partitions unowned for at most %s (member TTL %s)", longest.Round(time.Millisecond), ttl)
	switch {
	case !ok:
		t.Errorf("not whole again within 60 s after a NATS restart: applied %d of %d", f.appliedCount(), 2*aggs)
	case longest > ttl:
		t.Errorf("after a NATS restart (nothing deleted) partitions went unowned for %s (> a member TTL of %s)", longest.Round(time.Millisecond), ttl)
	}
	if createdAgain > 0 {
		t.Errorf("%d logs said the bucket was created again, after a NATS restart that created nothing", createdAgain)
	}
	if twice != 0 {
		t.Errorf("%d events applied twice", twice)
	}
}

// errBucketCreatedAgainText is what the members log when a heartbeat's
// revision goes back.
const errBucketCreatedAgainText = "deleted and created again by someone else"

// TestGroupYoungBucketCreatedAgain: two members; the bucket is deleted and
// created again by someone else, and the new bucket's revisions are past
// the old one's before the members next put (a young bucket: here a key
// that is no member's is put until they are). No heartbeat's revision
// goes back and the connection stays, so only the silent watch tells,
// after a member TTL; waiting three for it left the partitions unowned for
// 5.6 s at TTL 2 s, against 1.7 s before.
func TestGroupYoungBucketCreatedAgain(t *testing.T) {
	f := newFixture(t)
	const aggs = 16
	cfg, regs, _ := f.consumingGroup(f.js, false, aggs, "a", "b")
	ttl := cfg.Group.MemberTTL
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := f.js.Stream(ctx, "KV_"+GroupBucket("grp"))
	testenv.Must(t, err, "bucket stream")
	info, err := s.Info(ctx)
	testenv.Must(t, err, "bucket stream info")
	f.deleteBucket()
	kv, err := f.js.CreateKeyValue(ctx, bucketConfig(ttl))
	testenv.Must(t, err, "create the bucket again")
	for range info.State.LastSeq {
		_, err := kv.Put(ctx, "filler", []byte("x"))
		testenv.Must(t, err, "filler")
	}
	testenv.Must(t, kv.Delete(ctx, "filler"), "delete filler")
	f.publishVersions(aggs, 2, 2)
	longest, ok := f.unowned(8*ttl, 60*time.Second, 4, f.bothWhole(aggs, regs[0], regs[1]), regs...)
	t.Logf("old bucket's last sequence %d; partitions unowned for at most %s (member TTL %s)", info.State.LastSeq, longest.Round(time.Millisecond), ttl)
	switch {
	case !ok:
		t.Errorf("not whole again within 60 s: applied %d of %d; %s", f.appliedCount(), 2*aggs, f.bucketWatches())
	case longest > 2*ttl:
		t.Errorf("partitions went unowned for %s (> 2 member TTLs of %s) after a young bucket was created again", longest.Round(time.Millisecond), ttl)
	}
}
