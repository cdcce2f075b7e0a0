package consumer

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// TestGapBehindARetriedVersion: with VersionCheck, a version whose
// predecessor is in this worker (being retried, or queued behind it) waits
// for it, not GapWait, which is for versions that have not arrived.
func TestGapBehindARetriedVersion(t *testing.T) {
	// Version 8 comes before 7 in the stream, and 7 fails ten times
	// (two seconds of backoff at least): under GapWait's 1.5 s, 8 was
	// dead-lettered as a gap while 7 was being retried. On a loaded machine
	// one timeout of 7 did the same within TestVersionsAppliedInOrderAnd
	// GapDeadLettered's budget.
	t.Run("retried", func(t *testing.T) {
		t.Parallel()
		f := newFixture(t)
		r := newRecorder("gapr")
		r.fail = func(m *Message, call int) error {
			if m.AggregateVersion == 7 && call <= 10 {
				return Transient(errors.New("serialization failure"))
			}
			return nil
		}
		cfg := f.baseConfig("gapr")
		cfg.VersionCheck = true
		cfg.AckWait = time.Second
		cfg.RetryBase, cfg.RetryMax = 300*time.Millisecond, 400*time.Millisecond
		cfg.GapWait = 1500 * time.Millisecond // ≥ RetryMax + AckWait
		f.start(cfg, r)
		f.publish(event{ID: uuidN(5), AggID: "agg", Version: 5})
		f.waitSettled("gapr", 15*time.Second)
		f.publish(event{ID: uuidN(6), AggID: "agg", Version: 6}, event{ID: uuidN(8), AggID: "agg", Version: 8},
			event{ID: uuidN(7), AggID: "agg", Version: 7})
		f.waitSettled("gapr", 30*time.Second)
		checkGapOutcome(t, f, "gapr", "[5 6 7 8]")
		if n := r.callCount(uuidN(7)); n != 11 {
			t.Fatalf("version 7's handler called %d times, want 11", n)
		}
	})
	// Held behind 7's retry, 9 and 8 (in that stream order) are released
	// together when 7 is applied: 9 then misses 8, which is right behind it
	// in the queue. It goes back behind 8 rather than wait GapRecheck
	// (a minute here) for its redelivery.
	t.Run("queued", func(t *testing.T) {
		t.Parallel()
		f := newFixture(t)
		r := newRecorder("gapq")
		r.fail = func(m *Message, call int) error {
			if m.AggregateVersion == 7 && call == 1 {
				return Transient(errors.New("serialization failure"))
			}
			return nil
		}
		cfg := f.baseConfig("gapq")
		cfg.VersionCheck = true
		cfg.RetryBase, cfg.RetryMax = time.Second, time.Second
		cfg.GapWait, cfg.GapRecheck = time.Minute, time.Minute
		f.start(cfg, r)
		f.publish(event{ID: uuidN(6), AggID: "agg", Version: 6})
		f.waitSettled("gapq", 15*time.Second)
		f.publish(event{ID: uuidN(7), AggID: "agg", Version: 7}, event{ID: uuidN(9), AggID: "agg", Version: 9},
			event{ID: uuidN(8), AggID: "agg", Version: 8})
		f.waitSettled("gapq", 30*time.Second)
		checkGapOutcome(t, f, "gapq", "[6 7 8 9]")
	})
}

// checkGapOutcome checks the versions consumer applied to aggregate "agg",
// in order, and that nothing was dead-lettered.
func checkGapOutcome(t *testing.T, f *fixture, consumer, want string) {
	t.Helper()
	if got := appliedVersions(t, f, consumer, "agg"); fmt.Sprint(got) != want {
		t.Fatalf("applied versions %v, want %s", got, want)
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = $1`, consumer); n != 0 {
		t.Fatalf("%d dead letters, want none", n)
	}
}

// TestGapWaitsInTheWorker drives a worker by hand, without servers, where a
// version gap meets a batch and a block. Without waitForMissing each gap
// here was naked for a redelivery, and the queues below miss it.
func TestGapWaitsInTheWorker(t *testing.T) {
	met, err := newMetrics(prometheus.NewRegistry(), "gapw", "team-rewards")
	if err != nil {
		t.Fatal(err)
	}
	c := &Consumer{cfg: Config{BatchSize: 4, HandlerTimeout: 10 * time.Second, GapWait: time.Minute, GapRecheck: time.Minute,
		RetryBase: time.Second, RetryMax: time.Second}, met: met, log: zap.NewNop()}
	naks := 0
	version := func(seq uint64, v int64) *item {
		it := queuedItem("agg", seq)
		it.msg = settleMsg{naks: &naks}
		it.m.AggregateVersion = v
		return it
	}
	gap := func(current, received int64) result {
		return result{kind: resGap, current: current, received: received}
	}

	// A batch [9, 8] at version 7: 9 misses 8, which the batch sends back
	// unattempted. 9 goes back behind it, not to a redelivery.
	w := newWorker(c, nil, 0)
	w.queue = []*item{queuedItem("other", 30)}
	v9, v8 := version(20, 9), version(21, 8)
	w.finishAll(context.Background(), []*item{v9, v8}, batchOutcome{res: []result{gap(7, 9), {kind: resRequeue}}})
	if got := itemIDs(w.queue); got != "[agg@21 agg@20 other@30]" {
		t.Errorf("queue %s after the batch: want 8, then 9, then the rest", got)
	}

	// The same batch where 8, checked after 9, was applied: 9 goes back to
	// be tried again at once. Had 8 failed, 9 waits behind its retry.
	w = newWorker(c, nil, 0)
	v9, v8 = version(20, 9), version(21, 8)
	w.finishAll(context.Background(), []*item{v9, v8}, batchOutcome{res: []result{gap(7, 9), {kind: resApplied}}})
	if got := itemIDs(w.queue); got != "[agg@20]" {
		t.Errorf("queue %s after 8 was applied in 9's batch: want 9 back", got)
	}
	w = newWorker(c, nil, 0)
	v9, v8 = version(20, 9), version(21, 8)
	w.finishAll(context.Background(), []*item{v9, v8}, batchOutcome{res: []result{gap(7, 9), {kind: resFailed, class: ClassTransient, err: errors.New("serialization failure")}}})
	if b := w.blocked["agg"]; b == nil || itemIDs(b.held) != "[agg@20]" {
		t.Errorf("blocked %+v after 8 failed in 9's batch: want 9 held behind 8", b)
	}
	naks-- // 8's, for its retry

	// 7 (stream sequence 30) is being retried, 9 (31) is held behind it,
	// and 8 (25, before 7 in the stream) misses 7: it is held too, first.
	w = newWorker(c, nil, 0)
	w.blocked["agg"] = &block{head: 30, version: 7, held: []*item{version(31, 9)}}
	w.finishAll(context.Background(), []*item{version(25, 8)}, batchOutcome{res: []result{gap(6, 8)}})
	if got := itemIDs(w.blocked["agg"].held); got != "[agg@25 agg@31]" {
		t.Errorf("held %s: want 8, then 9", got)
	}
	// 7 applied: both go to the front of the queue in that order.
	w.queue = []*item{queuedItem("x", 40)}
	w.finishAll(context.Background(), []*item{version(30, 7)}, batchOutcome{res: []result{{kind: resApplied}}})
	if got := itemIDs(w.queue); got != "[agg@25 agg@31 x@40]" {
		t.Errorf("queue %s after 7 was applied: want 8, then 9, then the rest", got)
	}
	if naks != 0 {
		t.Errorf("%d naks: a gap whose version the worker has waits for it, not for a redelivery", naks)
	}
}

// settleMsg is a delivery the worker can acknowledge and nak; it counts
// the naks.
type settleMsg struct {
	jetstream.Msg
	naks *int
}

func (settleMsg) Ack() error        { return nil }
func (settleMsg) InProgress() error { return nil }
func (m settleMsg) NakWithDelay(time.Duration) error {
	*m.naks++
	return nil
}
