package consumer

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Attacks on the version gap's wait for a missing version this worker has
// (worker.settle, behindMissing, gapFilled), by a helper, where it meets
// fallen-back batches, dead letters, processes sharing the durable,
// rolling restarts and groups.

// TestAttackGapInAFallenBackBatchStaysOneAtATime: a batch [x, 9, 8] broke
// for no single message (HandleBatch failed, or its deadline passed): the
// three go back to be taken one at a time (worker.solo = 3, BatchHandler's
// contract). 9, taken alone, is a gap behind 8, the last of the
// one-at-a-time messages, and goes back behind it. It must keep its turn
// alone: taken in a batch with the messages queued after it, a 9 that
// breaks HandleBatch breaks that batch too
// (TestRedeliveryAheadOfAFallenBackBatchKeepsItOneAtATime).
func TestAttackGapInAFallenBackBatchStaysOneAtATime(t *testing.T) {
	c, _, version := handConsumer(t)
	w := newWorker(c, nil, 0)
	batch := []*item{version("x", 10, 1), version("agg", 11, 9), version("agg", 12, 8)}
	w.queue = []*item{version("y1", 13, 1), version("y2", 14, 1)}
	w.finishAll(context.Background(), batch, oneByOne(batchOutcome{res: make([]result, len(batch))}, batch, []int{0, 1, 2}))

	var takes []string
	for len(w.queue) > 0 {
		its := w.take()
		takes = append(takes, itemIDs(its))
		res := make([]result, len(its))
		for i, it := range its {
			switch {
			case it.key == "agg" && it.m.AggregateVersion == 9 && !strings.Contains(strings.Join(takes, " "), "agg@12"):
				res[i] = result{kind: resGap, current: 7, received: 9}
			default:
				res[i] = result{kind: resApplied}
			}
		}
		w.finishAll(context.Background(), its, batchOutcome{res: res})
	}
	for _, take := range takes {
		if (strings.Contains(take, "x@") || strings.Contains(take, "agg@")) && strings.Contains(take, " ") {
			t.Errorf("a fallen-back message was taken in a batch %s; takes %v: want x, 9 and 8 each alone", take, takes)
		}
	}
}

// TestAttackGapBehindADeadLetteredHead: version 8 comes before 7 in the
// stream; 7 fails until MaxAttempts and is dead-lettered while 8 waits for
// its retries. 8 must then be dead-lettered naming 7's record (not lost,
// not applied, not left to GapWait, a minute here), and once both are
// replayed the aggregate has [5 6 7 8], each once, in order.
func TestAttackGapBehindADeadLetteredHead(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := newRecorder("gapdl")
	var fixed atomic.Bool
	r.fail = func(m *Message, call int) error {
		if m.AggregateVersion == 7 && !fixed.Load() {
			return errors.New("unknown failure")
		}
		return nil
	}
	cfg := f.baseConfig("gapdl")
	cfg.VersionCheck = true
	cfg.MaxAttempts = 4
	cfg.RetryBase, cfg.RetryMax = 200*time.Millisecond, 400*time.Millisecond
	cfg.GapWait, cfg.GapRecheck = time.Minute, time.Second
	f.start(cfg, r)
	f.publish(event{ID: uuidN(5), AggID: "agg", Version: 5})
	f.waitSettled("gapdl", 15*time.Second)
	start := time.Now()
	f.publish(event{ID: uuidN(6), AggID: "agg", Version: 6}, event{ID: uuidN(8), AggID: "agg", Version: 8},
		event{ID: uuidN(7), AggID: "agg", Version: 7})
	var id7 int64
	var reason8 string
	f.waitFor("7 and 8 dead-lettered", 30*time.Second, func() bool {
		return f.pool.QueryRow(context.Background(), `SELECT id FROM consumer_dead_letter WHERE consumer = 'gapdl' AND event_id = $1`, uuidN(7)).Scan(&id7) == nil &&
			f.pool.QueryRow(context.Background(), `SELECT reason FROM consumer_dead_letter WHERE consumer = 'gapdl' AND event_id = $1`, uuidN(8)).Scan(&reason8) == nil
	})
	if took := time.Since(start); took > 20*time.Second {
		t.Errorf("dead-lettered after %s: 8 waited out GapWait rather than its dead-lettered predecessor's record", took)
	}
	if !strings.Contains(reason8, "replay it first") || !strings.Contains(reason8, fmt.Sprintf("record %d", id7)) {
		t.Errorf("8's reason %q: want it to name 7's record %d", reason8, id7)
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'gapdl'`); n != 2 {
		t.Errorf("%d dead letters, want 2", n)
	}
	f.waitSettled("gapdl", 15*time.Second)
	if got := appliedVersions(t, f, "gapdl", "agg"); fmt.Sprint(got) != "[5 6]" {
		t.Fatalf("applied %v before the replay, want [5 6]", got)
	}
	fixed.Store(true)
	mustExec(t, f.pool, `UPDATE consumer_dead_letter SET status = 'replaying', replay_requested_by = 'test' WHERE consumer = 'gapdl'`)
	f.waitFor("both replayed", 20*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'gapdl' AND status IN ('open', 'replaying')`) == 0
	})
	if got := appliedVersions(t, f, "gapdl", "agg"); fmt.Sprint(got) != "[5 6 7 8]" {
		t.Fatalf("applied %v after the replay, want [5 6 7 8]", got)
	}
}

// TestAttackGapBelowAHeadDeadLetteredElsewhere: two processes share the
// durable (a rolling restart). Version 8 (stream sequence 2) comes before
// 7 (3): here, a batch [6, 8, 7] applies 6, 7 fails and is naked for a
// retry, and 8, a gap, waits for 7's retries. Both come back to the other
// process, which dead-letters 7 (a permanent failure there) and then 8,
// naming 7's record. The block here must then see 7 gone. When 8 was held
// here below the block's head (f4a154a), it kept the durable's ack floor
// under 7 for good: the look-up never saw 7 gone, and 8 was held and kept
// alive forever.
func TestAttackGapBelowAHeadDeadLetteredElsewhere(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	cfg := f.baseConfig("dlelse")
	cfg.VersionCheck = true
	cfg.RetryBase, cfg.RetryMax = 50*time.Millisecond, 50*time.Millisecond
	cfg.GapWait, cfg.GapRecheck = time.Minute, 300*time.Millisecond
	rHere, rThere := newRecorder("dlelse"), newRecorder("dlelse")
	rHere.fail = func(m *Message, _ int) error {
		if m.AggregateVersion == 7 {
			return Transient(errors.New("serialization failure"))
		}
		return nil
	}
	rThere.fail = func(m *Message, _ int) error {
		if m.AggregateVersion == 7 {
			return Permanent(errors.New("account missing"))
		}
		return nil
	}
	here := f.newConsumer(cfg, rHere)
	there := f.newConsumer(cfg, rThere, WithRegisterer(prometheus.NewRegistry()))
	f.publish(event{ID: uuidN(6), AggID: "agg", Version: 6}, event{ID: uuidN(8), AggID: "agg", Version: 8},
		event{ID: uuidN(7), AggID: "agg", Version: 7})
	jc := f.durable(cfg.Name, 30*time.Second)
	ctx := context.Background()
	strm, err := f.js.Stream(ctx, f.stream)
	testenv.Must(t, err, "stream")
	its := f.fetch(here, jc, 3, 5*time.Second)
	w := newWorker(here, &durableSource{c: here, strm: strm, cons: jc}, 0)
	w.finishAll(ctx, its, here.processItems(ctx, its))
	b := w.blocked[its[2].key]
	if b == nil || b.head != its[2].m.StreamSeq {
		t.Fatalf("blocked %+v: want 7 the head", b)
	}
	for _, want := range []int{7, 8} { // 7's retry, then 8's recheck
		again := f.fetch(there, jc, 1, 10*time.Second)
		if again[0].m.ID != uuidN(want) {
			t.Fatalf("redelivered %s, want %d", again[0].m.ID, want)
		}
		drive(there, newWorker(there, nil, 0), again)
	}
	id7 := queryInt(t, f.pool, `SELECT id FROM consumer_dead_letter WHERE consumer = 'dlelse' AND event_id = $1`, uuidN(7))
	if reason := queryStrings(t, f.pool, `SELECT reason FROM consumer_dead_letter WHERE consumer = 'dlelse' AND event_id = $1`, uuidN(8)); !strings.Contains(reason, fmt.Sprintf("record %d", id7)) {
		t.Fatalf("8's dead letter reason %q: want it to name 7's record %d", reason, id7)
	}
	if !f.acked(jc, 3) {
		t.Fatalf("the ack floor did not pass 7")
	}
	b.until = time.Now().Add(-time.Second) // overdue: the heartbeat asks
	w.heartbeat(ctx)
	w.settleOverdue(<-w.answers)
	if w.blocked[its[2].key] != nil {
		t.Fatalf("7 still blocks its aggregate here after the other process dead-lettered it")
	}
}

// TestAttackGapAcrossARollingRestart: the old process has 8 (a gap, before
// 7 in the stream) waiting for 7's retry, whose backoff is 3 s, when it
// stops; the new process, where 7 succeeds, starts at once. Both must be
// applied in order, once, and nothing dead-lettered.
func TestAttackGapAcrossARollingRestart(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	cfg := f.baseConfig("gaproll")
	cfg.VersionCheck = true
	cfg.AckWait = 2 * time.Second
	cfg.RetryBase, cfg.RetryMax = 3*time.Second, 3*time.Second
	cfg.GapWait = 10 * time.Second
	old := newRecorder("gaproll")
	old.fail = func(m *Message, _ int) error {
		if m.AggregateVersion == 7 {
			return Transient(errors.New("serialization failure"))
		}
		return nil
	}
	regOld := prometheus.NewRegistry()
	stopOld := f.run(f.newConsumer(cfg, old, WithRegisterer(regOld)))
	f.publish(event{ID: uuidN(6), AggID: "agg", Version: 6})
	f.waitSettled("gaproll", 15*time.Second)
	f.publish(event{ID: uuidN(8), AggID: "agg", Version: 8}, event{ID: uuidN(7), AggID: "agg", Version: 7})
	f.waitFor("7 failed and 8 waits for it", 10*time.Second, func() bool {
		return old.callCount(uuidN(7)) >= 1 && gapsCounted(t, regOld, "gaproll") >= 1
	})
	if err := stopOld(); err != nil {
		t.Fatalf("old process: %v", err)
	}
	if old.callCount(uuidN(7)) != 1 {
		t.Skipf("7's backoff ended before the old process stopped (%d calls)", old.callCount(uuidN(7)))
	}
	f.startStoppable(cfg, newRecorder("gaproll"), "new")
	f.waitSettled("gaproll", 30*time.Second)
	checkGapOutcome(t, f, "gaproll", "[6 7 8]")
}

// TestAttackGapWhileAGroupMemberLeaves: in a one-partition group, member a
// has version 3 (a gap, before 2 in the stream) waiting for 2's retry,
// whose backoff is 3 s, when it leaves (the partition is handed off at
// shutdown, then worker.release). Member b, where 2 succeeds, takes the
// partition over: [1 2 3] applied once, in order, nothing dead-lettered.
func TestAttackGapWhileAGroupMemberLeaves(t *testing.T) {
	f := newFixture(t)
	f.partitionedStream(1)
	cfg := groupConfig(f, 1)
	cfg.RetryBase, cfg.RetryMax = 3*time.Second, 3*time.Second
	recA := newRecorder("grp")
	recA.fail = func(m *Message, _ int) error {
		if m.AggregateVersion == 2 {
			return Transient(errors.New("serialization failure"))
		}
		return nil
	}
	regA := prometheus.NewRegistry()
	stopA := f.runMember(cfg, recA, "a", WithRegisterer(regA))
	f.waitMembers("grp", 1)
	f.publish(event{ID: uuidN(1), AggID: "agg", Version: 1})
	f.waitFor("1 applied", 20*time.Second, func() bool { return len(appliedVersions(t, f, "grp", "agg")) == 1 })
	f.publish(event{ID: uuidN(3), AggID: "agg", Version: 3}, event{ID: uuidN(2), AggID: "agg", Version: 2})
	f.waitFor("2 failed and 3 waits for it", 10*time.Second, func() bool {
		return recA.callCount(uuidN(2)) >= 1 && gapsCounted(t, regA, "grp") >= 1
	})
	f.runMember(cfg, newRecorder("grp"), "b", WithRegisterer(prometheus.NewRegistry()))
	stopA()
	if recA.callCount(uuidN(2)) != 1 {
		t.Skipf("2's backoff ended before a left (%d calls)", recA.callCount(uuidN(2)))
	}
	f.waitGroupSettled("grp", 1, time.Minute)
	checkGapOutcome(t, f, "grp", "[1 2 3]")
}

// gapsCounted reads the version gaps a consumer on reg counted.
func gapsCounted(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	m, err := newMetrics(reg, "probe", "")
	testenv.Must(t, err, "metrics")
	return metricValue(t, m.vecs.gaps.WithLabelValues(name))
}
