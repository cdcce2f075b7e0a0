package consumer

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/consumer/internal/group"
	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// gate holds each message in its handler until open is closed or hold has
// passed, recording how many were in handlers at once.
type gate struct {
	next Handler
	hold time.Duration
	open chan struct{}

	mu       sync.Mutex
	now, max int
}

func newGate(next Handler, hold time.Duration) *gate {
	return &gate{next: next, hold: hold, open: make(chan struct{})}
}

func (g *gate) Handle(ctx context.Context, tx pgx.Tx, m *Message) error {
	g.mu.Lock()
	g.now++
	g.max = max(g.max, g.now)
	g.mu.Unlock()
	select {
	case <-g.open:
	case <-time.After(g.hold):
	case <-ctx.Done():
	}
	g.mu.Lock()
	g.now--
	g.mu.Unlock()
	return g.next.Handle(ctx, tx, m)
}

func (g *gate) peak() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.max
}

// aggregatesIn returns n aggregate ids whose events the fixture's stream
// (partitioned into partitions) stores in partition p: it publishes a probe
// for each candidate, reads where it was stored, and purges the stream.
func (f *fixture) aggregatesIn(partitions, p, n int) []string {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	strm, err := f.js.Stream(ctx, f.stream)
	testenv.Must(f.t, err, "stream")
	var ids []string
	for i := 0; len(ids) < n && i < 100*n; i++ {
		id := fmt.Sprintf("agg%d", i)
		ack, err := f.js.PublishMsg(ctx, event{ID: uuidN(900000 + i), AggID: id, Version: 1, MsgID: fmt.Sprintf("probe-%d-%d", time.Now().UnixNano(), i)}.msg(f.stream))
		testenv.Must(f.t, err, "publish a probe")
		raw, err := strm.GetMsg(ctx, ack.Sequence)
		testenv.Must(f.t, err, "read a probe")
		if got, q, ok := contract.SubjectPartition(f.stream+".*.*", raw.Subject); ok && got == partitions && q == p {
			ids = append(ids, id)
		}
	}
	testenv.Must(f.t, strm.Purge(ctx), "purge the probes")
	if len(ids) < n {
		f.t.Fatalf("found %d aggregates in partition %d, want %d", len(ids), p, n)
	}
	return ids
}

// TestGroupPartitionUsesMemberBudget: a member whose deliveries all come
// from one of its partitions may have its whole MaxAckPending in flight
// from it. Split into a fixed share per partition (MaxAckPending /
// partitions each), one busy partition got a quarter of it here, and the
// member's workers sat idle beside a backlog.
func TestGroupPartitionUsesMemberBudget(t *testing.T) {
	f := newFixture(t)
	const partitions, pending = 4, 16
	f.partitionedStream(partitions)
	aggs := f.aggregatesIn(partitions, 0, 48)
	cfg := groupConfig(f, partitions)
	cfg.Workers, cfg.MaxAckPending, cfg.BatchSize = 8, pending, 1
	cfg.AckWait, cfg.HandlerTimeout = 10*time.Second, 8*time.Second
	g := newGate(newRecorder("grp"), 3*time.Second)
	want := cfg.Workers - 2 // above the fixed share, pending/partitions
	f.runMember(cfg, g, "m1")
	for i, id := range aggs {
		f.publish(event{ID: uuidN(i + 1), AggID: id, Version: 1})
	}
	// 48 aggregates over 8 workers: every worker has some.
	deadline := time.Now().Add(20 * time.Second)
	for g.peak() < want && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	peak := g.peak()
	close(g.open)
	if peak < want {
		t.Errorf("at most %d messages of the one busy partition in handlers at once; want at least %d of MaxAckPending %d (a fixed share per partition is %d)",
			peak, want, pending, pending/partitions)
	}
	f.waitFor("all applied", time.Minute, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`) >= int64(len(aggs))
	})
	f.waitGroupSettled("grp", partitions, 30*time.Second)
	f.checkApplied("grp", len(aggs), 1)
}

// TestGroupMemberBudgetBounds: with every partition busy and the handlers
// stuck, a member holds at most MaxAckPending deliveries in its workers
// plus its pull buffers (MaxAckPending / partitions each): the durables'
// unacknowledged deliveries add up to no more than twice MaxAckPending,
// although each partition durable's max_ack_pending is the whole of it.
func TestGroupMemberBudgetBounds(t *testing.T) {
	f := newFixture(t)
	const partitions, pending = 4, 8
	f.partitionedStream(partitions)
	cfg := groupConfig(f, partitions)
	cfg.Workers, cfg.MaxAckPending, cfg.BatchSize = 4, pending, 1
	cfg.AckWait, cfg.HandlerTimeout = 10*time.Second, 8*time.Second
	g := newGate(newRecorder("grp"), time.Minute)
	const aggs = 200
	for a := range aggs {
		f.publish(event{ID: uuidN(a + 1), AggID: fmt.Sprintf("agg%d", a), Version: 1})
	}
	f.runMember(cfg, g, "m1")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pendingNow := func() int {
		sum := 0
		for p := range partitions {
			cons, err := f.js.Consumer(ctx, f.stream, PartitionDurable("grp", partitions, p))
			if err != nil {
				return -1
			}
			info, err := cons.Info(ctx)
			if err != nil {
				return -1
			}
			sum += info.NumAckPending
		}
		return sum
	}
	// Wait until the member stops taking deliveries: every worker stuck,
	// the budget full, the pull buffers full. Only once deliveries began:
	// before its first assignment (a MemberTTL after the start, later on a
	// loaded machine) the count also stands still, at 0.
	last, since := -1, time.Now()
	for ctx.Err() == nil && (last <= 0 || time.Since(since) < 2*time.Second) {
		if n := pendingNow(); n != last {
			last, since = n, time.Now()
		}
		time.Sleep(100 * time.Millisecond)
	}
	close(g.open)
	if last < pending || last > 2*pending {
		t.Errorf("the member's durables had %d deliveries unacknowledged with the handlers stuck; want between MaxAckPending %d and twice it", last, pending)
	}
	f.waitFor("all applied", time.Minute, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`) >= aggs
	})
	f.waitGroupSettled("grp", partitions, 30*time.Second)
	f.checkApplied("grp", aggs, 1)
}

// TestWorkerIndexSpreadsPartitions: the aggregates of one partition reach
// every worker. JetStream's partition transform puts a subject in
// partition fnv32a(wildcard tokens) mod partitions (nats-server
// subject_transform.go getHashPartition); a worker picked by FNV-1a as well
// shared its low bits, and a partition's aggregates met 2 of 8 workers.
func TestWorkerIndexSpreadsPartitions(t *testing.T) {
	for _, tc := range []struct{ partitions, workers int }{{4, 8}, {12, 8}, {12, 24}, {8, 16}} {
		t.Run(fmt.Sprintf("%d partitions %d workers", tc.partitions, tc.workers), func(t *testing.T) {
			c := &Consumer{cfg: Config{Workers: tc.workers}}
			used := make([]map[int]bool, tc.partitions)
			for i := range 2000 {
				typ, id := "order", fmt.Sprintf("agg-%d", i)
				h := fnv.New32a()
				_, _ = h.Write([]byte(typ + id))
				p := int(h.Sum32() % uint32(tc.partitions))
				if used[p] == nil {
					used[p] = map[int]bool{}
				}
				used[p][c.workerIndex(typ+"\x00"+id)] = true
			}
			for p, ws := range used {
				if len(ws) < tc.workers*9/10 {
					t.Errorf("partition %d's aggregates reach %d of %d workers", p, len(ws), tc.workers)
				}
			}
		})
	}
}

// failFirst fails the first delivery of the given events, for a retry.
type failFirst struct {
	next Handler
	ids  map[string]bool
}

func (h failFirst) Handle(ctx context.Context, tx pgx.Tx, m *Message) error {
	if h.ids[m.Event.ID] && m.Deliveries == 1 {
		return Transient(errors.New("first delivery fails"))
	}
	return h.next.Handle(ctx, tx, m)
}

// TestGroupBudgetHeldBehindRetries: the member's budget fills with two
// retried messages (one per partition) and their aggregates' later
// messages held behind them, while both partitions' pull buffers hold new
// deliveries ahead of the retries' redeliveries. A feed waiting for a slot
// then never reads the redelivery that would free one; the budget must see
// that nothing it holds can settle and let deliveries through.
func TestGroupBudgetHeldBehindRetries(t *testing.T) {
	f := newFixture(t)
	const partitions, pending = 2, 8
	f.partitionedStream(partitions)
	in0 := f.aggregatesIn(partitions, 0, 6)
	in1 := f.aggregatesIn(partitions, 1, 6)
	cfg := groupConfig(f, partitions)
	cfg.Workers, cfg.MaxAckPending, cfg.BatchSize = 4, pending, 1
	cfg.RetryBase, cfg.RetryMax = 300*time.Millisecond, 300*time.Millisecond
	n := 0
	var evs []event
	ids := map[string]bool{}
	add := func(agg string, versions int, failV1 bool) {
		for v := 1; v <= versions; v++ {
			n++
			evs = append(evs, event{ID: uuidN(n), AggID: agg, Version: int64(v)})
			if v == 1 && failV1 {
				ids[uuidN(n)] = true
			}
		}
	}
	add(in0[0], 6, true) // 1 retried + 5 held: with in1[0]'s, more than the budget
	add(in1[0], 6, true)
	for _, agg := range append(in0[1:], in1[1:]...) {
		add(agg, 4, false)
	}
	f.publish(evs...)
	f.runMember(cfg, failFirst{next: newRecorder("grp"), ids: ids}, "m1")
	f.waitFor("all applied", time.Minute, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`) >= int64(len(evs))
	})
	f.waitGroupSettled("grp", partitions, 30*time.Second)
	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`); n != int64(len(evs)) {
		t.Errorf("applied %d rows, want %d", n, len(evs))
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM (
		SELECT version, row_number() OVER (PARTITION BY aggregate_id ORDER BY n) AS pos
		FROM applied WHERE consumer = 'grp') o WHERE version <> pos`); n != 0 {
		t.Errorf("%d applications out of version order", n)
	}
}

// retryEvery fails the first delivery of every third event for a retry,
// and takes a few milliseconds over each, so that a member holds queued
// messages, retried ones and those held behind them at any moment.
type retryEvery struct{ next Handler }

func (h retryEvery) Handle(ctx context.Context, tx pgx.Tx, m *Message) error {
	time.Sleep(3 * time.Millisecond)
	var n int
	_, _ = fmt.Sscanf(m.Event.ID[len(m.Event.ID)-6:], "%d", &n)
	if n%3 == 0 && m.Deliveries == 1 {
		return Transient(errors.New("first delivery fails"))
	}
	return h.next.Handle(ctx, tx, m)
}

// TestAttackBudgetLeakAfterHandOff hands a partition off and back, four
// times, while a member's deliveries of it are queued in its workers,
// naked for a retry and held behind retried ones. Every slot of the
// member's budget must come back: once the group is idle the budget has
// none in use, and the member goes on consuming with the whole of it.
func TestAttackBudgetLeakAfterHandOff(t *testing.T) {
	f, cfg, rec := newUnversionedGroup(t, 2)
	const pending = 8
	cfg.Workers, cfg.MaxAckPending, cfg.BatchSize = 4, pending, 1
	cfg.RetryBase, cfg.RetryMax = 400*time.Millisecond, 400*time.Millisecond
	inUse := budgetInUse(t, "m1")
	var handOffs, busyHandOffs atomic.Int32 // m1's, and those with slots in use
	group.HookHandOffUnpin = func(member, _, _ string) {
		if member == "m1" {
			if n := inUse(); n > 0 {
				t.Logf("m1 hands a partition off with %d budget slots in use", n)
				busyHandOffs.Add(1)
			}
			handOffs.Add(1)
		}
	}
	t.Cleanup(func() { group.HookHandOffUnpin = nil })
	h := retryEvery{next: rec}
	f.runMember(cfg, h, "m1", WithRegisterer(f.reg))
	const aggs, rounds = 12, 4
	v := 0
	publish := func() {
		v++
		f.publishVersions(aggs, v, v)
	}
	for i := range int32(rounds) {
		f.waitOwns(f.reg, func(n float64) bool { return n == 2 })
		publish()
		publish()
		reg2 := prometheus.NewRegistry()
		stop := f.runMember(cfg, h, "m2", WithRegisterer(reg2))
		f.waitFor("m1 hands a partition off", 30*time.Second, func() bool { return handOffs.Load() > i })
		f.waitOwns(reg2, func(n float64) bool { return n == 1 })
		publish()
		stop()
		publish()
	}
	if busyHandOffs.Load() == 0 {
		t.Errorf("none of m1's %d hand-offs had budget slots in use: the test proves nothing", handOffs.Load())
	}
	f.waitApplied(aggs * v)
	f.waitGroupSettled("grp", 2, 30*time.Second)
	if !testenv.WaitFor(30*time.Second, func() bool { return inUse() == 0 }) {
		t.Errorf("member m1's budget has %d of %d slots in use with the group idle, want 0", inUse(), pending)
	}
	// Going on: more than the budget at once, applied.
	for range 3 {
		publish()
	}
	f.waitApplied(aggs * v)
	f.waitGroupSettled("grp", 2, 30*time.Second)
	f.checkApplied("grp", aggs, v)
	if !testenv.WaitFor(30*time.Second, func() bool { return inUse() == 0 }) {
		t.Errorf("member m1's budget has %d slots in use at the end, want 0", inUse())
	}
}

// budgetInUse returns a function reading the slots in use of member's
// budget (-1 before the member runs).
func budgetInUse(t *testing.T, member string) func() int {
	var mu sync.Mutex
	var b *budget
	hookGroupBudget = func(m string, got *budget) {
		if m == member {
			mu.Lock()
			b = got
			mu.Unlock()
		}
	}
	t.Cleanup(func() { hookGroupBudget = nil })
	return func() int {
		mu.Lock()
		defer mu.Unlock()
		if b == nil {
			return -1
		}
		return b.inUse()
	}
}

// TestGroupBudgetRetriedMessageLeftStream: two messages naked for a retry
// leave the stream before they come back (deleted here; a retention limit
// or a purge does the same). The worker releases their aggregates once it
// learns they are gone; their budget slots must come back too. Before, the
// feed kept them until the partition was handed off: 2 of 8 slots in use
// with the member idle, and each such message one slot less for good.
func TestGroupBudgetRetriedMessageLeftStream(t *testing.T) {
	f, cfg, rec := newUnversionedGroup(t, 2)
	cfg.Workers, cfg.MaxAckPending, cfg.BatchSize = 4, 8, 1
	cfg.RetryBase, cfg.RetryMax = 2*time.Second, 2*time.Second
	inUse := budgetInUse(t, "m1")
	f.runMember(cfg, retryEvery{next: rec}, "m1")
	f.publishVersions(6, 1, 1) // the third and sixth fail first (stream sequences 3 and 6)
	f.waitApplied(4)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	strm, err := f.js.Stream(ctx, f.stream)
	testenv.Must(t, err, "stream")
	for _, seq := range []uint64{3, 6} {
		testenv.Must(t, strm.DeleteMsg(ctx, seq), "delete a retried message")
	}
	if !testenv.WaitFor(30*time.Second, func() bool { return inUse() == 0 }) {
		t.Errorf("member m1's budget has %d of %d slots in use with the member idle, want 0", inUse(), cfg.MaxAckPending)
	}
	f.publishVersions(6, 2, 2)
	f.waitApplied(10)
}
