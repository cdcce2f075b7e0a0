package consumer

import (
	"context"
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/consumer/internal/group"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// A repetition of a delivery still in a worker (a reset by someone else,
// or a hung message's ack_wait running out) must not hold the feed, and so
// the other workers' aggregates, for one worker's progress: a hanging
// handler "delays this worker's aggregates only, never the dispatcher and
// so never the other workers" (worker.run). A pacing of repetitions that
// waited for the progress of all the workers together (7232c59, reverted)
// failed these tests: a hung handler stopped every worker's supply, and a
// merely slow one made a later version's gap wait run out.

// aggsOnWorker returns n aggregate ids, prefix0, prefix1, … as found, whose
// messages (of the test events' aggregate type) go to worker w of c.
func aggsOnWorker(c *Consumer, w, n int, prefix string) []string {
	var ids []string
	for i := 0; len(ids) < n; i++ {
		id := fmt.Sprintf("%s%d", prefix, i)
		if c.workerIndex("registration\x00"+id) == w {
			ids = append(ids, id)
		}
	}
	return ids
}

// TestARepetitionBehindAHungHandlerStallsNoOtherWorker: one worker's
// handler hangs (it ignores its context), ten messages of that worker's
// aggregates are queued behind it, and then a repetition of a delivery
// still in that worker reaches the feed: a reset made by another party, or
// the hung message's own redelivery once its ack_wait ran out (a single
// message in flight is not kept alive, worker.run). Events of the other
// worker's aggregates published afterwards must still be applied: that
// worker is idle.
func TestARepetitionBehindAHungHandlerStallsNoOtherWorker(t *testing.T) {
	for _, tc := range []struct {
		name         string
		reset, group bool
	}{
		{"reset by another party", true, false},
		{"the hung message's ack_wait ran out", false, false},
		{"group partition reset by another party", true, true},
		{"group partition, the hung message's ack_wait ran out", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) { repetitionBehindHungHandler(t, tc.reset, tc.group) })
	}
}

func repetitionBehindHungHandler(t *testing.T, reset, grouped bool) {
	const queued, others = 10, 5
	f := newFixture(t)
	cfg := f.baseConfig("hungpace")
	if grouped {
		f.partitionedStream(1)
		cfg = f.baseConfig(testenv.UniqueName("hungpace")) // a group bucket of its own
		cfg.Group = &GroupConfig{Partitions: 1, MemberTTL: 2 * time.Second}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = f.js.DeleteKeyValue(ctx, GroupBucket(cfg.Name))
		})
	}
	cfg.Workers = 2
	cfg.BatchSize = 1 // pace: at most 4 unsettled
	cfg.AckWait = 30 * time.Second
	if !reset {
		cfg.AckWait = 2 * time.Second // HandlerTimeout 1 s: the hung message is redelivered after 2 s
	}
	hang := uuidN(0)
	h := newHangingHandler(cfg.Name, hang)
	durable := cfg.Name
	if grouped {
		durable = group.PartitionDurable(cfg.Name, 1, 0)
		f.runMember(cfg, h, "m1", WithRegisterer(f.reg))
	} else {
		f.start(cfg, h)
	}
	t.Cleanup(h.free)        // runs before the consumer is stopped: Run waits for the handler
	c := &Consumer{cfg: cfg} // workerIndex depends on Workers only
	hung := c.workerIndex("registration\x00hang")
	f.publish(event{ID: hang, AggID: "hang", Version: 1})
	for i, a := range aggsOnWorker(c, hung, queued, "s") {
		f.publish(event{ID: uuidN(100 + i), AggID: a, Version: 1})
	}
	h.waitEntered(t)
	f.waitFor("every message delivered", 30*time.Second, func() bool {
		info, ok := f.consumerInfo(durable)
		return ok && info.Delivered.Stream == 1+queued
	})
	if reset {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := f.js.ResetConsumer(ctx, f.stream, durable)
		cancel()
		testenv.Must(t, err, "reset the durable")
		f.waitFor("the reset adopted", 30*time.Second, func() bool { return resumesByReason(t, f.reg)[resumeAdopted] >= 1 })
	} else {
		f.waitFor("the hung message redelivered", 30*time.Second, func() bool {
			info, ok := f.consumerInfo(durable)
			return ok && info.NumRedelivered >= 1
		})
	}

	otherAggs := aggsOnWorker(c, 1-hung, others, "o")
	for i, a := range otherAggs {
		f.publish(event{ID: uuidN(200 + i), AggID: a, Version: 1})
	}
	countOthers := func() int64 {
		return queryInt(t, f.pool, `SELECT count(DISTINCT event_id) FROM applied WHERE aggregate_id LIKE 'o%'`)
	}
	const within = 15 * time.Second
	if !testenv.WaitFor(within, func() bool { return countOthers() == others }) {
		info, _ := f.consumerInfo(durable)
		var delivered uint64
		if info != nil {
			delivered = info.Delivered.Stream
		}
		t.Errorf("worker %d's handler hung with %d messages queued behind it; the idle worker %d applied %d of its %d events published since within %s (the server delivered up to stream sequence %d): the feed waits for the hung worker",
			hung, queued, 1-hung, countOthers(), others, within, delivered)
	}
	h.free()
	f.waitFor("every event applied", time.Minute, func() bool {
		return queryInt(t, f.pool, `SELECT count(DISTINCT event_id) FROM applied WHERE consumer = $1`, cfg.Name) == 1+queued+others
	})
	f.waitSettled(durable, time.Minute)
	if twice := queryInt(t, f.pool, `SELECT count(*) - count(DISTINCT event_id) FROM applied WHERE consumer = $1`, cfg.Name); twice != 0 {
		t.Errorf("%d events applied twice", twice)
	}
}

// TestARepetitionBehindASlowWorkerDeadLettersNoGap: with VersionCheck,
// version 3 of aggregate g waits for version 2 (a gap, GapWait 7 s); a
// worker other than g's has twelve messages to apply, two seconds each
// (below HandlerTimeout: slow, not hung), when another party resets the
// durable; version 2 is published right after. Version 2 must be applied
// and version 3 after it, well within GapWait of the gap. Held at the
// reset's repetitions until the slow worker is down to four unsettled
// (about 14 s), the feed received version 3's next gap redelivery, and
// then version 2, only after GapWait: version 3 is dead-lettered as a gap
// although its predecessor was in the stream for most of GapWait.
func TestARepetitionBehindASlowWorkerDeadLettersNoGap(t *testing.T) {
	const slow = 12
	f := newFixture(t)
	r := newRecorder("slowgap")
	cfg := f.baseConfig("slowgap")
	cfg.Workers = 2
	cfg.BatchSize = 1 // pace: at most 4 unsettled
	cfg.VersionCheck = true
	cfg.AckWait = 6 * time.Second
	cfg.HandlerTimeout = 5 * time.Second
	cfg.GapWait = 7 * time.Second // at least RetryMax + AckWait
	c := f.start(cfg, r)
	gw := c.workerIndex("registration\x00g")
	slowAggs := aggsOnWorker(c, 1-gw, slow, "s")
	isSlow := map[string]bool{}
	for _, a := range slowAggs {
		isSlow[a] = true
	}
	r.mu.Lock()
	r.fail = func(m *Message, call int) error {
		if isSlow[m.AggregateID] {
			time.Sleep(2 * time.Second) // the stimulus: a slow handler, below HandlerTimeout
		}
		return nil
	}
	r.mu.Unlock()

	f.publish(event{ID: uuidN(1), AggID: "g", Version: 1})
	f.waitFor("version 1 applied", 30*time.Second, func() bool { return r.callCount(uuidN(1)) >= 1 && f.isAcked(cfg.Name, 1) })
	f.publish(event{ID: uuidN(3), AggID: "g", Version: 3}) // stream sequence 2
	for i, a := range slowAggs {
		f.publish(event{ID: uuidN(100 + i), AggID: a, Version: 1}) // 3 to 14
	}
	f.waitFor("every message delivered", 30*time.Second, func() bool {
		info, ok := f.consumerInfo(cfg.Name)
		return ok && info.Delivered.Stream == 2+slow
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	_, err := f.js.ResetConsumer(ctx, f.stream, cfg.Name)
	cancel()
	testenv.Must(t, err, "reset the durable")
	resetAt := time.Now()
	f.waitFor("the reset adopted", 30*time.Second, func() bool { return resumesByReason(t, f.reg)[resumeAdopted] >= 1 })
	// The reset's run is stream sequences 2 to 14, consumer sequences 1 to
	// 13; version 3's next gap redelivery is sent after it.
	f.waitFor("version 3 deferred again after the reset", 30*time.Second, func() bool {
		info, ok := f.consumerInfo(cfg.Name)
		return ok && info.Delivered.Consumer >= 1+slow+1
	})
	f.publish(event{ID: uuidN(2), AggID: "g", Version: 2}) // stream sequence 15
	published := time.Since(resetAt)

	f.waitFor("every event settled", 2*time.Minute, func() bool {
		info, ok := f.consumerInfo(cfg.Name)
		return ok && info.AckFloor.Stream >= 3+slow && info.NumAckPending == 0
	})
	dead := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = $1`, cfg.Name)
	g := queryStrings(t, f.pool, `SELECT event_id FROM applied WHERE consumer = $1 AND aggregate_id = 'g' ORDER BY n`, cfg.Name)
	t.Logf("version 2 published %s after the reset; g's applications in order: %s; dead letters %d", published.Round(time.Millisecond), g, dead)
	if dead != 0 {
		t.Errorf("%d dead-lettered (version 3 as a gap, though version 2 was published %s after the reset, GapWait %s): the feed held version 2 behind the slow worker's queue",
			dead, published.Round(time.Millisecond), cfg.GapWait)
	}
}

// isAcked reports whether the durable's ack floor reached stream sequence seq.
func (f *fixture) isAcked(name string, seq uint64) bool {
	info, ok := f.consumerInfo(name)
	return ok && info.AckFloor.Stream >= seq
}

// TestRunCancelledWhileTheFeedIsHeldAtARepetition: a Run is cancelled
// while its feed waits at a reset's repetition (pace) for a worker whose
// handler hangs with ten messages queued behind it. Run must return once
// the handler has, with every goroutine it started ended, and the next run
// must apply every event once.
func TestRunCancelledWhileTheFeedIsHeldAtARepetition(t *testing.T) {
	const queued = 10
	f := newFixture(t)
	cfg := f.baseConfig("pacestop")
	cfg.Workers = 2
	cfg.BatchSize = 1 // pace: at most 4 unsettled
	cfg.AckWait = 10 * time.Second
	hang := uuidN(0)
	h := newHangingHandler(cfg.Name, hang)
	t.Cleanup(h.free)
	c, err := New(f.pool, f.js, cfg, h, WithLogger(zaptest.NewLogger(t)), WithRegisterer(f.reg))
	testenv.Must(t, err, "new consumer")
	hung := c.workerIndex("registration\x00hang")
	f.publish(event{ID: hang, AggID: "hang", Version: 1})
	for i, a := range aggsOnWorker(c, hung, queued, "s") {
		f.publish(event{ID: uuidN(100 + i), AggID: a, Version: 1})
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	label := t.Name()
	done := runLabelled(ctx, c, label)
	h.waitEntered(t)
	f.waitFor("every message delivered", 30*time.Second, func() bool {
		info, ok := f.consumerInfo(cfg.Name)
		return ok && info.Delivered.Stream == 1+queued
	})
	rctx, rcancel := context.WithTimeout(context.Background(), 10*time.Second)
	_, err = f.js.ResetConsumer(rctx, f.stream, cfg.Name)
	rcancel()
	testenv.Must(t, err, "reset the durable")
	f.waitFor("the reset adopted", 30*time.Second, func() bool { return resumesByReason(t, f.reg)[resumeAdopted] >= 1 })
	cancel()
	h.releaseLater(time.Second)
	waitRun(t, done, h)
	checkNoneLeft(t, label)

	f.start(cfg, h)
	f.waitAppliedBy(cfg.Name, 1+queued)
	f.waitSettled(cfg.Name, 30*time.Second)
	if twice := queryInt(t, f.pool, `SELECT count(*) - count(DISTINCT event_id) FROM applied WHERE consumer = $1`, cfg.Name); twice != 0 {
		t.Errorf("%d events applied twice", twice)
	}
}
