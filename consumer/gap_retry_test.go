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
// version gap meets a batch and a block.
func TestGapWaitsInTheWorker(t *testing.T) {
	c, naks, versionOf := handConsumer(t)
	version := func(seq uint64, v int64) *item { return versionOf("agg", seq, v) }
	gap := func(current, received int64) result {
		return result{kind: resGap, current: current, received: received}
	}

	// A batch [9, 8] at version 7: 9 misses 8, which the batch sends back
	// unattempted. 9 goes back behind it, not to a redelivery.
	w := newWorker(c, nil, 0)
	w.queue = []*item{queuedItem("other", 30)}
	w.finishAll(context.Background(), []*item{version(20, 9), version(21, 8)}, batchOutcome{res: []result{gap(7, 9), {kind: resRequeue}}})
	if got := itemIDs(w.queue); got != "[agg@21 agg@20 other@30]" || len(naks) != 0 {
		t.Errorf("queue %s and naks %v after the batch: want 8, then 9, then the rest, and no nak", got, naks)
	}

	// The same batch where 8, checked after 9, was applied, or rejected:
	// 9 goes back to be tried again at once.
	for _, filled := range []resultKind{resApplied, resRejected} {
		w = newWorker(c, nil, 0)
		w.finishAll(context.Background(), []*item{version(20, 9), version(21, 8)}, batchOutcome{res: []result{gap(7, 9), {kind: filled}}})
		if got := itemIDs(w.queue); got != "[agg@20]" || len(naks) != 0 {
			t.Errorf("queue %s and naks %v after 8 came to %d in 9's batch: want 9 back, no nak", got, naks, filled)
		}
	}

	// Had 8 failed there, 9 waits for 8's retry: back a GapRecheck after
	// 8's backoff (10–20 s here) ends.
	w = newWorker(c, nil, 0)
	w.finishAll(context.Background(), []*item{version(20, 9), version(21, 8)},
		batchOutcome{res: []result{gap(7, 9), {kind: resFailed, class: ClassTransient, err: errors.New("serialization failure")}}})
	b := w.blocked["agg"]
	if b == nil || b.head != 21 || b.version != 8 {
		t.Fatalf("blocked %+v after 8 failed: want 8 the head", b)
	}
	if d, ok := naks[20]; !ok || d < naks[21]+c.cfg.GapRecheck-time.Second || d > naks[21]+c.cfg.GapRecheck {
		t.Errorf("9 naked for %v (ok %v), 8 for %v: want 9 back a GapRecheck after 8's retry", d, ok, naks[21])
	}

	// Past GapWait (9 has waited two minutes), 9 still waits for 8's
	// retries rather than being dead-lettered (which needs a database:
	// here it would fail the test).
	clear(naks)
	w.gaps[20].since = time.Now().Add(-2 * time.Minute)
	w.finishAll(context.Background(), []*item{version(20, 9)}, batchOutcome{res: []result{gap(7, 9)}})
	if _, ok := naks[20]; !ok {
		t.Errorf("9 not naked past GapWait while 8 is retried")
	}
}

// handConsumer is a consumer for a worker driven by hand: no servers,
// GapRecheck 1 s, retries after 10–20 s. Its items' deliveries record each
// nak's delay in naks by stream sequence.
func handConsumer(t *testing.T) (c *Consumer, naks map[uint64]time.Duration, version func(key string, seq uint64, v int64) *item) {
	t.Helper()
	met, err := newMetrics(prometheus.NewRegistry(), "hand", "team-rewards")
	if err != nil {
		t.Fatal(err)
	}
	c = &Consumer{cfg: Config{BatchSize: 4, HandlerTimeout: 10 * time.Second, GapWait: time.Minute, GapRecheck: time.Second,
		RetryBase: 20 * time.Second, RetryMax: 20 * time.Second}, met: met, log: zap.NewNop()}
	naks = map[uint64]time.Duration{}
	version = func(key string, seq uint64, v int64) *item {
		it := queuedItem(key, seq)
		it.msg = settleMsg{seq: seq, naks: naks}
		it.m.AggregateVersion = v
		return it
	}
	return c, naks, version
}

// settleMsg is a delivery the worker can acknowledge and nak; it records
// each nak's delay by stream sequence.
type settleMsg struct {
	jetstream.Msg
	seq  uint64
	naks map[uint64]time.Duration
}

func (settleMsg) Ack() error        { return nil }
func (settleMsg) InProgress() error { return nil }
func (m settleMsg) NakWithDelay(d time.Duration) error {
	m.naks[m.seq] = d
	return nil
}
