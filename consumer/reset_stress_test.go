package consumer

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// TestResetsAgainstInFlightWork: while 3,000 events are consumed, something
// else (an operator, a takeover, another process on the durable) resets the
// durable every 300 ms. Some messages are slow (300 ms in the handler) and
// some fail once with a retry delay of up to 2 s, so resets meet deliveries
// still being applied and messages naked with a delay. Without VersionCheck
// nothing in the database keeps order: every event must be applied once and
// each aggregate in version order, and the durable must settle (acks of
// deliveries made before a reset are not lost).
//
// Each of those resets starts a run from the ack floor at consumer sequence
// 1, in stream order: the feed must adopt it, not answer it with a reset of
// its own. Answering it (settle, wait, reset) starved progress under CPU
// load (six busy loops, GOMAXPROCS=1: not done in 3 minutes), since resets
// came faster than a reset's worth settled; the count of the feed's own
// resets shows it whatever the machine's speed. ATTACK_RESETS=1 runs the
// original 6,000 events in three shapes.
func TestResetsAgainstInFlightWork(t *testing.T) {
	cases := []struct{ workers, batch, aggregates, versions int }{{8, 64, 50, 60}, {1, 1, 50, 40}}
	if os.Getenv("ATTACK_RESETS") != "" {
		cases = []struct{ workers, batch, aggregates, versions int }{{8, 64, 100, 60}, {1, 1, 100, 60}, {4, 1, 100, 60}}
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("workers=%d,batch=%d", tc.workers, tc.batch), func(t *testing.T) {
			resetsInFlight(t, tc.workers, tc.batch, tc.aggregates, tc.versions)
		})
	}
}

func resetsInFlight(t *testing.T, workers, batch, aggregates, versions int) {
	f := newFixture(t)
	r := newRecorder("resets")
	r.fail = func(m *Message, call int) error {
		h := crc32.ChecksumIEEE([]byte(m.ID)) % 100
		if h < 2 {
			time.Sleep(300 * time.Millisecond)
		}
		if call == 1 && h >= 2 && h < 4 {
			return Transient(errors.New("injected"))
		}
		return nil
	}
	cfg := f.baseConfig("resets")
	cfg.Workers = workers
	cfg.BatchSize = batch
	cfg.RetryBase = time.Second
	cfg.RetryMax = 2 * time.Second
	cfg.GapWait = 10 * time.Second
	f.start(cfg, r)
	var resets atomic.Int64
	stop := make(chan struct{})
	resetDone := make(chan struct{})
	go func() {
		defer close(resetDone)
		tick := time.NewTicker(300 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			if _, err := f.js.ResetConsumer(ctx, f.stream, cfg.Name); err == nil {
				resets.Add(1)
			}
			cancel()
		}
	}()
	for v := 1; v <= versions; v++ {
		for a := range aggregates {
			e := event{ID: uuidN(v*1000 + a), AggID: fmt.Sprintf("a%d", a), Version: int64(v)}
			if _, err := f.js.PublishMsgAsync(e.msg(f.stream)); err != nil {
				t.Fatal(err)
			}
		}
		<-f.js.PublishAsyncComplete()
		time.Sleep(20 * time.Millisecond)
	}
	f.waitFor("every event applied", 3*time.Minute, func() bool {
		return queryInt(t, f.pool, `SELECT count(DISTINCT event_id) FROM applied`) >= int64(aggregates*versions)
	})
	close(stop)
	<-resetDone
	f.waitSettled(cfg.Name, time.Minute)
	twice := queryInt(t, f.pool, `SELECT count(*) FROM (SELECT event_id FROM applied GROUP BY event_id HAVING count(*) > 1) d`)
	disorder := queryInt(t, f.pool, `SELECT count(*) FROM (
		SELECT version, row_number() OVER (PARTITION BY aggregate_id ORDER BY n) AS pos FROM applied) o WHERE version <> pos`)
	dead := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter`)
	own := resumesByReason(t, f.reg)
	t.Logf("%d events, %d external resets: applied twice %d, out of version order %d, dead-lettered %d; the feed's resets and adoptions %v",
		aggregates*versions, resets.Load(), twice, disorder, dead, own)
	if twice != 0 || disorder != 0 || dead != 0 {
		t.Errorf("resets broke the consumer: %d applied twice, %d out of version order, %d dead-lettered", twice, disorder, dead)
	}
	// A delivery lost in transit may still cost a reset; the others' resets
	// must not (the storm made more than ten).
	if mine := own[resumeGap] + own[resumeEnded]; mine > 2 || resets.Load() < 10 {
		t.Errorf("the feed answered %d external resets with %.0f of its own (%v); want them adopted, at most 2 resets of its own",
			resets.Load(), mine, own)
	}
}

// TestRetriedMessageGoesFirst: a message that failed comes back when its
// backoff ends, while the messages delivered after it wait in the worker's
// queue. Its redelivery must be applied next, not behind that queue: until
// it is, the ack floor stays below it, and every reset of the durable
// delivers all that is above the floor again. Behind the queue, under CPU
// load, TestResetsAgainstInFlightWork's resets kept the feed redelivering
// the same few hundred messages while the worker ran out of work and the
// rest of the stream was never reached.
//
// One worker takes one message at a time, and each application waits for
// a token from the test, so the order is the worker's choice alone: the
// failed message's redelivery arrives behind 38 queued messages, and must
// be applied within the first half of them (in practice next).
func TestRetriedMessageGoesFirst(t *testing.T) {
	const n = 40
	f := newFixture(t)
	cfg := f.baseConfig("first")
	cfg.Workers = 1
	cfg.BatchSize = 1
	cfg.AckWait = 30 * time.Second // HandlerTimeout 15 s: a handler waits for its token
	// Long enough for every message to be delivered and queued before the
	// failed one comes back.
	cfg.RetryBase = 4 * time.Second
	cfg.RetryMax = 4 * time.Second
	cfg.GapWait = 2 * time.Minute
	failing := uuidN(0)
	gate := make(chan struct{})
	var gateOnce sync.Once
	openGate := func() { gateOnce.Do(func() { close(gate) }) }
	t.Cleanup(openGate) // a handler waiting at shutdown would hold Run
	var failed atomic.Int64
	applied := make(chan string, 2*n)
	f.start(cfg, HandlerFunc(func(ctx context.Context, tx pgx.Tx, m *Message) error {
		if m.ID == failing && failed.Add(1) == 1 {
			return Transient(errors.New("injected"))
		}
		select {
		case <-gate:
		case <-ctx.Done():
			return ctx.Err()
		}
		if err := insertApplied(ctx, tx, "first", m); err != nil {
			return err
		}
		applied <- m.ID
		return nil
	}))
	for a := range n {
		f.publish(event{ID: uuidN(a), AggID: fmt.Sprintf("a%d", a), Version: 1})
	}
	// The failed message is naked for its backoff, the next one waits for
	// its token and the others are queued behind it.
	f.waitFor("the first message failed and every message delivered", 30*time.Second, func() bool {
		info, ok := f.consumerInfo(cfg.Name)
		return ok && failed.Load() == 1 && info.Delivered.Stream == n
	})
	f.waitFor("the failed message redelivered", 30*time.Second, func() bool {
		info, ok := f.consumerInfo(cfg.Name)
		return ok && info.Delivered.Consumer > n
	})
	var order []string
	for len(order) < n && !slices.Contains(order, failing) {
		select {
		case gate <- struct{}{}:
		case <-time.After(30 * time.Second):
			t.Fatalf("no message asked to be applied within 30 s; applied %v", order)
		}
		select {
		case id := <-applied:
			order = append(order, id)
		case <-time.After(30 * time.Second):
			t.Fatalf("an application did not commit within 30 s; applied %v", order)
		}
	}
	pos := slices.Index(order, failing)
	t.Logf("the failed message was applied as number %d of the %d applications after its redelivery", pos+1, len(order))
	if pos < 0 || pos >= n/2 {
		t.Errorf("the failed message's redelivery was applied as number %d, behind the queue; want it within the first %d", pos+1, n/2)
	}
	openGate()
	f.waitFor("every event applied", time.Minute, func() bool {
		return queryInt(t, f.pool, `SELECT count(DISTINCT event_id) FROM applied`) == n
	})
	f.waitSettled(cfg.Name, time.Minute)
	if twice := queryInt(t, f.pool, `SELECT count(*) - count(DISTINCT event_id) FROM applied`); twice != 0 {
		t.Errorf("%d applications twice", twice)
	}
}
