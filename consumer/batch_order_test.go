package consumer

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestBatchTwoFailuresOfOneAggregateKeepOrder: in one batch, a later
// message H of an aggregate fails; the batch is redone without it, and
// there the aggregate's earlier message E fails too. Both are naked for
// a retry, and the worker's block for the aggregate names one head.
// Whichever of the two comes back first must not be applied ahead of
// the other: E (version 1) before H (version 2), always. finishAll
// settles E first (block head E), then H: `case retry` moves the head
// to H, so E is no longer held and H's redelivery goes first whenever
// its jittered backoff is the shorter one (about half the pairs).
func TestBatchTwoFailuresOfOneAggregateKeepOrder(t *testing.T) {
	const pairs = 10
	f := newFixture(t)
	cfg := f.baseConfig("batchpair")
	cfg.Workers = 1
	cfg.BatchSize = 2
	cfg.AckWait = 10 * time.Second
	cfg.RetryBase = time.Second
	cfg.RetryMax = time.Second
	cfg.GapWait = time.Minute
	gate := make(chan struct{})
	var entered atomic.Bool
	r := newRecorder(cfg.Name)
	r.fail = func(m *Message, call int) error {
		switch {
		case m.AggregateID == "x":
			entered.Store(true)
			<-gate
		case strings.HasPrefix(m.AggregateID, "p") && m.AggregateVersion == 2 && call == 1:
			return Transient(errors.New("H fails on its first call"))
		case strings.HasPrefix(m.AggregateID, "p") && m.AggregateVersion == 1 && call == 2:
			return Transient(errors.New("E fails on its second call"))
		}
		return nil
	}
	f.start(cfg, r)
	// A blocker alone in flight, so that the pairs queue up behind it and
	// are taken two at a time: [E1 H1] [E2 H2] ...
	f.publish(event{ID: uuidN(999), AggID: "x", Version: 1})
	f.waitFor("the blocker in its handler", 30*time.Second, entered.Load)
	for a := range pairs {
		f.publish(event{ID: uuidN(a*10 + 1), AggID: fmt.Sprintf("p%d", a), Version: 1},
			event{ID: uuidN(a*10 + 2), AggID: fmt.Sprintf("p%d", a), Version: 2})
	}
	f.waitFor("every pair delivered", 30*time.Second, func() bool {
		info, ok := f.consumerInfo(cfg.Name)
		return ok && info.Delivered.Stream == 2*pairs+1
	})
	close(gate)
	f.waitFor("every event applied", 2*time.Minute, func() bool {
		return queryInt(t, f.pool, `SELECT count(DISTINCT event_id) FROM applied`) == 2*pairs+1
	})
	f.waitSettled(cfg.Name, time.Minute)
	both := 0
	for a := range pairs {
		if r.callCount(uuidN(a*10+1)) >= 2 && r.callCount(uuidN(a*10+2)) >= 1 {
			both++
		}
	}
	disorder := queryInt(t, f.pool, `SELECT count(DISTINCT aggregate_id) FROM (
		SELECT aggregate_id, version, row_number() OVER (PARTITION BY aggregate_id ORDER BY n) AS pos FROM applied) o WHERE version <> pos`)
	twice := queryInt(t, f.pool, `SELECT count(*) - count(DISTINCT event_id) FROM applied`)
	dead := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter`)
	t.Logf("%d pairs, %d with both messages failed in one batch: %d aggregates applied out of version order, %d twice, %d dead-lettered", pairs, both, disorder, twice, dead)
	if disorder != 0 || twice != 0 || dead != 0 {
		t.Errorf("%d aggregates applied out of version order, %d twice, %d dead-lettered; want none", disorder, twice, dead)
	}
}
