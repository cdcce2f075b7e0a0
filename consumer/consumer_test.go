package consumer

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Acceptance 1 (in process; the crash between commit and ack is in
// cmd/reward-consumer): the same event delivered three times is applied once.
func TestSameEventDeliveredThreeTimesIsAppliedOnce(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := newRecorder("dup")
	f.start(f.baseConfig("dup"), r)
	e := event{ID: uuidN(1), AggID: "r1", Version: 1}
	for i := range 3 {
		e.MsgID = fmt.Sprintf("%s/%d", e.ID, i) // stored three times despite JetStream's dedup
		f.publish(e)
	}
	f.waitSettled("dup", 15*time.Second)
	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE event_id = $1`, e.ID); n != 1 {
		t.Fatalf("applied %d times, want 1", n)
	}
	if n := r.callCount(e.ID); n != 1 {
		t.Fatalf("handler called %d times, want 1 (duplicates must not reach it)", n)
	}
	if got := metricValue(t, mustVec(t, f).idempotency.WithLabelValues("dup")); got != 2 {
		t.Fatalf("idempotency hits = %v, want 2", got)
	}
}

// Acceptance 2: the same id with another payload is a conflict in the DLQ and
// is not applied.
func TestSameIDDifferentPayloadIsAConflict(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := newRecorder("conf")
	f.start(f.baseConfig("conf"), r)
	e := event{ID: uuidN(2), AggID: "r2", Version: 1, Payload: `{"registrationId": "r2", "version": 1}`}
	f.publish(e)
	f.waitSettled("conf", 15*time.Second)
	e.MsgID, e.Payload = e.ID+"/again", `{"registrationId": "r2", "version": 1, "points": 1000}`
	f.publish(e)
	f.waitSettled("conf", 15*time.Second)
	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE event_id = $1`, e.ID); n != 1 {
		t.Fatalf("applied %d times, want 1", n)
	}
	var class, reason, payload string
	err := f.pool.QueryRow(context.Background(), `
		SELECT failure_class, reason, convert_from(payload, 'UTF8') FROM consumer_dead_letter
		WHERE consumer = 'conf' AND event_id = $1`, e.ID).Scan(&class, &reason, &payload)
	testenv.Must(t, err, "read dead letter")
	if class != string(ClassConflict) || !strings.Contains(reason, "payload differs") || payload != e.Payload {
		t.Fatalf("dead letter class %q reason %q payload %q", class, reason, payload)
	}
	if got := metricValue(t, mustVec(t, f).conflicts.WithLabelValues("conf")); got != 1 {
		t.Fatalf("conflicts = %v, want 1", got)
	}
}

// Acceptance 3: versions 6, 8, 7 arriving for an aggregate at version 5 are
// applied as 6, 7, 8; a gap that never fills is dead-lettered after GapWait.
func TestVersionsAppliedInOrderAndGapDeadLettered(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := newRecorder("ver")
	cfg := f.baseConfig("ver")
	cfg.VersionCheck = true
	cfg.AckWait = time.Second // GapWait ≥ RetryMax + AckWait
	cfg.GapWait = 1500 * time.Millisecond
	f.start(cfg, r)
	f.publish(event{ID: uuidN(5), AggID: "agg", Version: 5})
	f.waitSettled("ver", 15*time.Second)
	f.publish(event{ID: uuidN(6), AggID: "agg", Version: 6}, event{ID: uuidN(8), AggID: "agg", Version: 8},
		event{ID: uuidN(7), AggID: "agg", Version: 7})
	f.waitSettled("ver", 15*time.Second)
	if got := appliedVersions(t, f, "ver", "agg"); fmt.Sprint(got) != "[5 6 7 8]" {
		t.Fatalf("applied versions %v, want [5 6 7 8]", got)
	}
	if got := metricValue(t, mustVec(t, f).gaps.WithLabelValues("ver")); got < 1 {
		t.Fatalf("version gaps = %v, want at least 1 (version 8 came before 7)", got)
	}

	// Version 9 never comes: 10 waits GapWait, then goes to the DLQ.
	start := time.Now()
	f.publish(event{ID: uuidN(10), AggID: "agg", Version: 10})
	var class, reason string
	f.waitFor("gap dead letter", 15*time.Second, func() bool {
		err := f.pool.QueryRow(context.Background(), `SELECT failure_class, reason FROM consumer_dead_letter
			WHERE consumer = 'ver' AND event_id = $1`, uuidN(10)).Scan(&class, &reason)
		return err == nil
	})
	if waited := time.Since(start); waited < cfg.GapWait {
		t.Fatalf("dead-lettered after %s, before GapWait %s", waited, cfg.GapWait)
	}
	if class != string(ClassGap) || !strings.Contains(reason, "at version 8, received version 10") || !strings.Contains(reason, "missing version 9") {
		t.Fatalf("gap dead letter class %q reason %q", class, reason)
	}
	f.waitSettled("ver", 10*time.Second)
	if v := queryInt(t, f.pool, `SELECT version FROM consumer_aggregate_position WHERE consumer = 'ver' AND aggregate_id = 'agg'`); v != 8 {
		t.Fatalf("position %d, want 8", v)
	}

	// The same version with another identity is a conflict.
	f.publish(event{ID: uuidN(99), AggID: "agg", Version: 8})
	f.waitFor("version conflict dead letter", 10*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'ver' AND event_id = $1 AND failure_class = 'conflict'`, uuidN(99)) == 1
	})
}

func appliedVersions(t *testing.T, f *fixture, consumer, agg string) []int64 {
	t.Helper()
	rows, err := f.pool.Query(context.Background(), `SELECT version FROM applied WHERE consumer = $1 AND aggregate_id = $2 ORDER BY n`, consumer, agg)
	testenv.Must(t, err, "query applied")
	defer rows.Close()
	var vs []int64
	for rows.Next() {
		var v int64
		testenv.Must(t, rows.Scan(&v), "scan")
		vs = append(vs, v)
	}
	return vs
}

// Acceptance 5: permanent error → DLQ record with all context; business
// rejection → acked, recorded, not retried; unknown → retried N times then
// DLQ; panic → unknown. Once per message, once with batches: a batch whose
// message fails is rolled back and tried again without it, so there a
// neighbour that succeeded before the failure is called again (its effect
// of the rolled-back try never committed). Its attempts, what the retry
// metrics count, are the same in both modes.
func TestErrorClasses(t *testing.T) {
	for _, batch := range []int{1, DefaultBatchSize} {
		t.Run(fmt.Sprintf("batch_size=%d", batch), func(t *testing.T) { errorClasses(t, batch) })
	}
}

func errorClasses(t *testing.T, batchSize int) {
	t.Parallel()
	f := newFixture(t)
	r := newRecorder("cls")
	r.fail = classFailure
	cfg := f.baseConfig("cls")
	cfg.MaxAttempts = 3
	cfg.BatchSize = batchSize
	f.start(cfg, r)
	evs := map[string]event{}
	for i, agg := range []string{"perm", "reject", "unknown", "panic", "flaky"} {
		evs[agg] = event{ID: uuidN(100 + i), AggID: agg, Version: 1}
		f.publish(evs[agg])
	}
	f.waitSettled("cls", 20*time.Second)

	if n := r.callCount(evs["perm"].ID); n != 1 {
		t.Errorf("permanent: handler called %d times, want 1", n)
	}
	if n := r.callCount(evs["reject"].ID); n != 1 {
		t.Errorf("rejected: handler called %d times, want 1", n)
	}
	if n := r.callCount(evs["unknown"].ID); n != 3 {
		t.Errorf("unknown: handler called %d times, want MaxAttempts 3", n)
	}
	if n := r.callCount(evs["panic"].ID); n != 3 {
		t.Errorf("panic: handler called %d times, want MaxAttempts 3", n)
	}
	// Two failed calls, then the one that succeeds; in a batch, the
	// successful call may be redone when a later neighbour fails.
	if n := r.callCount(evs["flaky"].ID); n != 3 && (batchSize == 1 || n < 3) {
		t.Errorf("transient: handler called %d times, want 3", n)
	}
	// Only the transient one's effect committed; the rejection's effect
	// was rolled back but its dedup row says why.
	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied`); n != 1 {
		t.Errorf("%d effects committed, want 1 (the transient one, on its third call)", n)
	}
	var outcome, reason string
	err := f.pool.QueryRow(context.Background(), `SELECT outcome, reason FROM consumed_message WHERE consumer = 'cls' AND event_id = $1`,
		evs["reject"].ID).Scan(&outcome, &reason)
	testenv.Must(t, err, "read rejected dedup row")
	if outcome != "rejected" || reason != "registration was cancelled" {
		t.Errorf("rejected dedup row: outcome %q reason %q", outcome, reason)
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE event_id = $1`, evs["reject"].ID); n != 0 {
		t.Errorf("a business rejection was dead-lettered")
	}

	f.checkClassDeadLetters(evs)
	vec := mustVec(t, f)
	if got := metricValue(t, vec.retries.WithLabelValues("cls", "unknown")); got != 4 {
		t.Errorf("unknown retries = %v, want 4 (2 each for the error and the panic)", got)
	}
	if got := metricValue(t, vec.retries.WithLabelValues("cls", "transient")); got != 2 {
		t.Errorf("transient retries = %v, want 2", got)
	}
	if got := metricValue(t, vec.deadLettered.WithLabelValues("cls", "team-rewards", "unknown")); got != 2 {
		t.Errorf("unknown dead letters = %v, want 2", got)
	}
	if got := metricValue(t, vec.processed.WithLabelValues("cls", "rejected")); got != 1 {
		t.Errorf("rejected = %v, want 1", got)
	}
	f.waitFor("open dead-letter gauge", 5*time.Second, func() bool {
		return metricValue(t, vec.openDLQ.WithLabelValues("cls", "team-rewards")) == 3
	})
}

// classFailure is TestErrorClasses's handler outcome per aggregate: one of
// each class, and a transient failure that succeeds on the third call.
func classFailure(m *Message, call int) error {
	switch m.AggregateID {
	case "perm":
		return Permanent(errors.New("payload schema v2 is not supported"))
	case "reject":
		return Reject("registration was cancelled")
	case "unknown":
		return errors.New("something odd")
	case "panic":
		panic("kaboom")
	case "flaky":
		if call < 3 {
			return Transient(errors.New("downstream busy"))
		}
	}
	return nil
}

// checkClassDeadLetters checks TestErrorClasses's dead letters: the
// permanent one with all its context, the unknown and the panic after
// MaxAttempts.
func (f *fixture) checkClassDeadLetters(evs map[string]event) {
	t := f.t
	t.Helper()
	type record struct {
		class, reason, subject, stream, owner, consumer, eventID, eventType, aggType, aggID string
		version                                                                             int64
		seq, deliveries                                                                     int64
		attempts                                                                            int
		headers                                                                             map[string][]string
		payload                                                                             []byte
		first, last                                                                         time.Time
	}
	read := func(id string) record {
		var rec record
		err := f.pool.QueryRow(context.Background(), `
			SELECT failure_class, reason, subject, stream, owner, consumer, event_id, event_type, aggregate_type,
				aggregate_id, aggregate_version, stream_seq, deliveries, attempts, headers, payload, first_failed_at, last_failed_at
			FROM consumer_dead_letter WHERE event_id = $1`, id).Scan(&rec.class, &rec.reason, &rec.subject, &rec.stream,
			&rec.owner, &rec.consumer, &rec.eventID, &rec.eventType, &rec.aggType, &rec.aggID, &rec.version, &rec.seq,
			&rec.deliveries, &rec.attempts, &rec.headers, &rec.payload, &rec.first, &rec.last)
		testenv.Must(t, err, "read dead letter of %s", id)
		return rec
	}
	perm := read(evs["perm"].ID)
	want := evs["perm"].msg(f.stream)
	if perm.class != "permanent" || !strings.Contains(perm.reason, "payload schema v2 is not supported") ||
		perm.subject != want.Subject || perm.stream != f.stream || perm.seq == 0 || perm.deliveries != 1 ||
		perm.owner != "team-rewards" || perm.consumer != "cls" || perm.eventID != evs["perm"].ID ||
		perm.eventType != "RegistrationConfirmed" || perm.aggType != "registration" || perm.aggID != "perm" ||
		perm.version != 1 || perm.attempts != 1 || string(perm.payload) != string(want.Data) ||
		perm.headers[contract.EventID][0] != evs["perm"].ID || perm.headers[contract.CommitLSN][0] != "0/16B3748" ||
		perm.first.IsZero() || perm.last.Before(perm.first) {
		t.Errorf("permanent dead letter lacks context: %+v", perm)
	}
	unk := read(evs["unknown"].ID)
	if unk.class != "unknown" || unk.attempts != 3 || !strings.Contains(unk.reason, "something odd") || !unk.last.After(unk.first) {
		t.Errorf("unknown dead letter: %+v", unk)
	}
	pan := read(evs["panic"].ID)
	if pan.class != "unknown" || pan.attempts != 3 || !strings.Contains(pan.reason, "handler panicked: kaboom") || !strings.Contains(pan.reason, "goroutine") {
		t.Errorf("panic dead letter: class %q attempts %d reason %q", pan.class, pan.attempts, pan.reason)
	}
}

// A message that breaks the header contract is dead-lettered as permanent
// with its headers and payload, without reaching the handler.
func TestInvalidMessageIsDeadLettered(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := newRecorder("inv")
	f.start(f.baseConfig("inv"), r)
	m := event{ID: uuidN(300), AggID: "x", Version: 1}.msg(f.stream)
	m.Header.Set(contract.AggregateVersion, "seven")
	_, err := f.js.PublishMsg(context.Background(), m)
	testenv.Must(t, err, "publish")
	f.waitSettled("inv", 10*time.Second)
	var class, reason string
	var headers map[string][]string
	err = f.pool.QueryRow(context.Background(), `SELECT failure_class, reason, headers FROM consumer_dead_letter WHERE consumer = 'inv'`).Scan(&class, &reason, &headers)
	testenv.Must(t, err, "read dead letter")
	if class != "permanent" || !strings.Contains(reason, "Outbox-Aggregate-Version") || headers[contract.AggregateVersion][0] != "seven" {
		t.Fatalf("class %q reason %q headers %v", class, reason, headers)
	}
	if n := r.callCount(uuidN(300)); n != 0 {
		t.Fatalf("handler was called for an invalid message")
	}
}

// Acceptance 7: 20,000 events over 500 aggregates with 8 workers, with some
// transient failures on the way: every aggregate's events are applied in
// version order, each exactly once. Version checking is off, so the order
// comes from the workers alone.
func TestManyAggregatesAppliedInOrderExactlyOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	f := newFixture(t)
	const aggregates, versions = 500, 40
	r := newRecorder("bulk")
	r.fail = func(m *Message, call int) error {
		// About 1% of the events fail once: their successors must wait.
		if call == 1 && crc32.ChecksumIEEE([]byte(m.ID))%100 == 0 {
			return Transient(errors.New("injected"))
		}
		return nil
	}
	cfg := f.baseConfig("bulk")
	cfg.Workers = 8

	// Publish first, in windows of 1,000 unacknowledged messages.
	start := time.Now()
	for v := 1; v <= versions; v++ {
		for a := range aggregates {
			e := event{ID: fmt.Sprintf("ev-%d-%d", a, v), AggID: fmt.Sprintf("a%d", a), Version: int64(v)}
			if _, err := f.js.PublishMsgAsync(e.msg(f.stream)); err != nil {
				t.Fatal(err)
			}
		}
		if v%2 == 0 {
			select {
			case <-f.js.PublishAsyncComplete():
			case <-time.After(30 * time.Second):
				t.Fatal("publishing timed out")
			}
		}
	}
	t.Logf("published %d events in %s", aggregates*versions, time.Since(start))
	start = time.Now()
	f.start(cfg, r)
	f.waitFor("20,000 events applied", 4*time.Minute, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM consumed_message WHERE consumer = 'bulk'`) == aggregates*versions
	})
	t.Logf("applied in %s", time.Since(start))
	f.waitSettled("bulk", 30*time.Second)

	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied`); n != aggregates*versions {
		t.Fatalf("%d applications, want %d", n, aggregates*versions)
	}
	if n := queryInt(t, f.pool, `SELECT count(DISTINCT event_id) FROM applied`); n != aggregates*versions {
		t.Fatalf("%d distinct events applied, want %d", n, aggregates*versions)
	}
	// In each aggregate, the k-th application (by commit order of the
	// serial) must be version k.
	if n := queryInt(t, f.pool, `
		SELECT count(*) FROM (
			SELECT version, row_number() OVER (PARTITION BY aggregate_id ORDER BY n) AS k FROM applied
		) s WHERE version <> k`); n != 0 {
		t.Fatalf("%d applications out of version order", n)
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter`); n != 0 {
		t.Fatalf("%d dead letters", n)
	}
	if got := metricValue(t, mustVec(t, f).retries.WithLabelValues("bulk", "transient")); got == 0 {
		t.Fatalf("no injected failure happened")
	}
}

func mustVec(t *testing.T, f *fixture) *metricVecs {
	t.Helper()
	m, err := newMetrics(f.reg, "probe", "")
	testenv.Must(t, err, "metrics")
	return m.vecs
}

// metricValue reads a counter or gauge.
func metricValue(t *testing.T, m prometheus.Metric) float64 {
	t.Helper()
	var d dto.Metric
	testenv.Must(t, m.Write(&d), "read metric")
	switch {
	case d.Counter != nil:
		return d.Counter.GetValue()
	case d.Gauge != nil:
		return d.Gauge.GetValue()
	}
	t.Fatalf("metric is neither counter nor gauge")
	return 0
}

// TransientAttempts bounds transient retries; InitialVersion makes a new
// aggregate wait for its first version; EventTypes skips other events
// without a transaction.
func TestLimitsAndFilters(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	down := newRecorder("lim")
	down.fail = func(m *Message, _ int) error {
		if m.AggregateID == "down" {
			return Transient(errors.New("partner API unavailable"))
		}
		return nil
	}
	cfg := f.baseConfig("lim")
	cfg.TransientAttempts = 2
	cfg.VersionCheck = true
	cfg.InitialVersion = 1
	cfg.AckWait = time.Second
	cfg.GapWait = 1200 * time.Millisecond // RetryMax + AckWait
	cfg.GapRecheck = 50 * time.Millisecond
	f.start(cfg, down)
	f.publish(event{ID: uuidN(1), AggID: "down", Version: 1}, event{ID: uuidN(2), AggID: "late", Version: 2})
	f.waitSettled("lim", 15*time.Second)
	var class string
	var attempts int
	testenv.Must(t, f.pool.QueryRow(context.Background(), `SELECT failure_class, attempts FROM consumer_dead_letter WHERE event_id = $1`,
		uuidN(1)).Scan(&class, &attempts), "transient dead letter")
	if class != "transient" || attempts != 2 || down.callCount(uuidN(1)) != 2 {
		t.Fatalf("transient: class %q attempts %d calls %d, want transient after 2", class, attempts, down.callCount(uuidN(1)))
	}
	var reason string
	testenv.Must(t, f.pool.QueryRow(context.Background(), `SELECT failure_class, reason FROM consumer_dead_letter WHERE event_id = $1`,
		uuidN(2)).Scan(&class, &reason), "gap dead letter")
	if class != "gap" || !strings.Contains(reason, "at version 0, received version 2") {
		t.Fatalf("initial version: class %q reason %q", class, reason)
	}

	skip := newRecorder("skip")
	cfg = f.baseConfig("skip")
	cfg.EventTypes = []string{"Wanted"}
	f.start(cfg, skip)
	f.publish(event{ID: uuidN(3), Type: "Wanted", AggID: "s", Version: 1}, event{ID: uuidN(4), Type: "Other", AggID: "s", Version: 2})
	f.waitSettled("skip", 15*time.Second)
	if skip.callCount(uuidN(3)) != 1 || skip.callCount(uuidN(4)) != 0 {
		t.Fatalf("EventTypes: calls %d and %d, want 1 and 0", skip.callCount(uuidN(3)), skip.callCount(uuidN(4)))
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumed_message WHERE consumer = 'skip'`); n != 1 {
		t.Fatalf("%d dedup rows, want 1 (skipped events get none)", n)
	}
	if got := metricValue(t, mustVec(t, f).processed.WithLabelValues("skip", "skipped")); got < 1 {
		t.Fatalf("skipped = %v", got)
	}
}

// The handler sees when JetStream stored the message, which splits an
// event's lag between the relay and the consumer.
func TestMessageCarriesStoreTime(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	stored := make(chan time.Time, 1)
	before := time.Now()
	f.start(f.baseConfig("stored"), HandlerFunc(func(_ context.Context, _ pgx.Tx, m *Message) error {
		select {
		case stored <- m.Stored:
		default:
		}
		return nil
	}))
	f.publish(event{ID: uuidN(1), AggID: "s1", Version: 1})
	select {
	case ts := <-stored:
		if ts.Before(before.Add(-time.Second)) || ts.After(time.Now()) {
			t.Fatalf("Stored = %v, want between %v and now", ts, before)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the handler was not called")
	}
}
