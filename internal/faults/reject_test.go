package faults

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// insertEvents commits one transaction of rows (aggregate type, id,
// version, payload) and returns their event ids.
func (s *scenario) insertEvents(ctx context.Context, rows ...[4]any) []string {
	s.t.Helper()
	tx, err := s.db.Pool.Begin(ctx)
	if err != nil {
		s.t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var ids []string
	for _, r := range rows {
		id := uuid.NewString()
		if _, err := tx.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ($1, $2, $3, $4, 'Test', $5)`,
			id, r[0], r[1], r[2], r[3]); err != nil {
			s.t.Fatal(err)
		}
		ids = append(ids, id)
	}
	if err := tx.Commit(ctx); err != nil {
		s.t.Fatal(err)
	}
	return ids
}

// createStreams creates the event and dead-letter streams the way an
// operator would, with a small max_msg_size on the event stream; the relay
// then runs with create_streams: false.
func (s *scenario) createStreams(ctx context.Context, maxMsgSize int32) {
	s.t.Helper()
	for _, c := range []jetstream.StreamConfig{
		{Name: s.stream, Subjects: []string{s.name + ".>"}, Storage: jetstream.FileStorage, Duplicates: 2 * time.Minute, MaxMsgSize: maxMsgSize},
		{Name: s.dlq, Subjects: []string{s.name + "_dlq.>"}, Storage: jetstream.FileStorage, Duplicates: 2 * time.Minute},
	} {
		if _, err := s.js.CreateStream(ctx, c); err != nil {
			s.t.Fatalf("create stream %s: %v", c.Name, err)
		}
	}
	s.set("nats.create_streams", false)
}

func bigPayload(n int) string {
	return `{"blob": "` + strings.Repeat("x", n) + `"}`
}

// dlqRecord finds the dead-letter record of an event id.
func dlqRecord(msgs []storedMsg, id string) (storedMsg, bool) {
	for _, m := range msgs {
		if m.Header[contract.EventID] != nil && m.Header[contract.EventID][0] == id {
			return m, true
		}
	}
	return storedMsg{}, false
}

// The broker rejects a message for good because it is larger than the
// stream's max_msg_size: the row is dead-lettered with the reason, its
// aggregate's later events follow in order, and the relay carries on.
func TestBrokerRejectsTooLarge(t *testing.T) {
	t.Parallel()
	env := testenv.Get(t)
	s := newScenario(t, env.PG, env.NATS.URL)
	ctx := context.Background()
	s.createStreams(ctx, 4096)
	s.sample()
	s.startRelay()
	ld := startLoad(t, s.db.Pool, loadSpec{Writers: 2, Aggregates: 50, Pause: 5 * time.Millisecond})
	s.waitCount(s.stream, 100, 30*time.Second)
	// The middle event of a transaction exceeds max_msg_size.
	big := s.insertEvents(ctx,
		[4]any{"registration", "big", 1, `{"n": 1}`},
		[4]any{"registration", "big", 2, bigPayload(8000)},
		[4]any{"registration", "big", 3, `{"n": 3}`})
	s.insertEvents(ctx, [4]any{"registration", "big", 4, `{"n": 4}`})
	s.waitCount(s.dlq, 1, 30*time.Second)
	time.Sleep(500 * time.Millisecond)
	ld.stop()
	o := s.verify(time.Minute, big[1])
	checkDeadLetter(t, o, big[1], "too_large")
	// The big aggregate: 1, 3, 4 in order (2 was dead-lettered).
	var versions []int64
	for _, m := range o.Stream {
		if m.Aggregate == "big" {
			versions = append(versions, m.Version)
		}
	}
	if fmt.Sprint(versions) != "[1 3 4]" {
		t.Errorf("aggregate big in the stream: versions %v, want [1 3 4]", versions)
	}
	s.mustHold("broker rejects: over max_msg_size", o, 0, "dead-lettered (too_large), relay carried on")
}

// checkDeadLetter checks the dead-letter record of an event: its reason
// class, a reason text and the row's LSN.
func checkDeadLetter(t *testing.T, o outcome, id, class string) {
	t.Helper()
	m, ok := dlqRecord(o.DLQ, id)
	if !ok {
		t.Fatalf("no dead-letter record for event %s (%d records)", id, len(o.DLQ))
	}
	if got := strings.Join(m.Header[contract.DLQReasonClass], ","); got != class {
		t.Errorf("event %s: reason class %q, want %q (reason %q)", id, got, class, m.Header[contract.DLQReason])
	}
	if len(m.Header[contract.DLQReason]) == 0 || m.Header[contract.DLQReason][0] == "" || len(m.Header[contract.DLQLSN]) == 0 {
		t.Errorf("event %s: dead-letter record lacks reason or LSN: %v", id, m.Header)
	}
}

// A subject bound to no stream (an operator narrowed the stream's
// subjects while the relay runs) is a permanent rejection: the row is
// dead-lettered as no_stream and the relay carries on.
func TestBrokerRejectsUnboundSubject(t *testing.T) {
	t.Parallel()
	env := testenv.Get(t)
	s := newScenario(t, env.PG, env.NATS.URL)
	ctx := context.Background()
	s.createStreams(ctx, 0)
	s.sample()
	r := s.startRelay()
	ld := startLoad(t, s.db.Pool, loadSpec{Writers: 2, Aggregates: 50, Pause: 5 * time.Millisecond})
	s.waitCount(s.stream, 100, 30*time.Second)
	info := s.streamInfo(ctx, s.stream)
	cfg := info.Config
	cfg.Subjects = []string{s.name + ".registration.>"}
	if _, err := s.js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	narrowed := time.Now()
	orphan := s.insertEvents(ctx, [4]any{"orphan", "lost", 1, `{"n": 1}`})
	if !testenv.WaitFor(20*time.Second, func() bool { n, _ := s.streamState(ctx, s.dlq); return n >= 1 }) {
		// Until e3b8845 the publisher shared nats.go's request-mux inbox
		// prefix and never saw the 503 'no responders' status.
		t.Fatalf("the event on an unbound subject was not dead-lettered within 20s; last warning: %q", lastWarn(r, narrowed))
	}
	time.Sleep(500 * time.Millisecond)
	ld.stop()
	o := s.verify(time.Minute, orphan[0])
	checkDeadLetter(t, o, orphan[0], "no_stream")
	s.mustHold("broker rejects: subject bound to no stream", o, 0, "dead-lettered (no_stream), relay carried on")
}

// lastWarn returns the last warning the relay logged after since.
func lastWarn(r *relayProc, since time.Time) string {
	last := ""
	for _, e := range r.entries() {
		if !e.TS.Before(since.Truncate(time.Millisecond)) && (e.Level == "warn" || e.Level == "error") {
			last = strings.TrimSpace(e.Msg + ": " + e.Error)
		}
	}
	return last
}

// The event stream is deleted while the relay runs. That is an outage, not
// a property of the events: nothing may be dead-lettered, the slot must not
// move past the first event that was not stored, the log must say why, and
// once the stream is back every event arrives.
func TestEventStreamDeleted(t *testing.T) {
	t.Parallel()
	env := testenv.Get(t)
	s := newScenario(t, env.PG, env.NATS.URL)
	ctx := context.Background()
	s.sample()
	r := s.startRelay()
	before := startLoad(t, s.db.Pool, loadSpec{Writers: 2, Aggregates: 50, Events: 200})
	before.wait()
	s.waitCount(s.stream, 200, 30*time.Second)
	if _, err := s.caughtUp(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	old := committedRows(ctx, t, s)
	info := s.streamInfo(ctx, s.stream)
	if err := s.js.DeleteStream(ctx, s.stream); err != nil {
		t.Fatal(err)
	}
	deleted := time.Now()
	ld := startLoad(t, s.db.Pool, loadSpec{Writers: 2, Aggregates: 50, Pause: 5 * time.Millisecond})
	outage := 4 * time.Second
	var maxConfirmed replication.LSN
	for end := time.Now().Add(outage); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		if sl, err := s.slot(ctx); err == nil {
			maxConfirmed = max(maxConfirmed, sl.ConfirmedFlushLSN)
		}
	}
	if dead, _ := s.streamState(ctx, s.dlq); dead > 0 {
		// A missing event stream is an outage, not a property of the
		// events: relay.streamLookup checks the configured stream first.
		t.Fatalf("with the event stream deleted: %d events dead-lettered", dead)
	}
	t.Run("logs why", func(t *testing.T) {
		if _, ok := r.waitLog(deleted, time.Second, func(e logEntry) bool {
			return (e.Level == "warn" || e.Level == "error") && strings.Contains(e.Msg+" "+e.Error, s.stream)
		}); !ok {
			t.Errorf("while the event stream is missing the relay logs only %q; it should say that stream %s does not exist", lastWarn(r, deleted), s.stream)
		}
	})
	if _, err := s.js.CreateStream(ctx, info.Config); err != nil {
		t.Fatal(err)
	}
	rec, err := s.caughtUp(60 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	ld.stop()
	var oldIDs []string
	for _, e := range old {
		oldIDs = append(oldIDs, e.ID)
	}
	// The events stored before the deletion went with the stream.
	o := s.verify(time.Minute, oldIDs...)
	if len(o.DLQ) != 0 {
		t.Errorf("%d events dead-lettered while the stream was missing", len(o.DLQ))
	}
	// The slot may confirm the server's WAL end while idle, but never the
	// first transaction written after the deletion (PostgreSQL re-sends a
	// transaction whose commit starts at or after the confirmed position).
	first := replication.LSN(0)
	for _, m := range o.Stream {
		if first == 0 || m.CommitLSN < first {
			first = m.CommitLSN
		}
	}
	if maxConfirmed > first {
		t.Errorf("the slot confirmed %s while the stream was missing, past the first unstored commit %s", maxConfirmed, first)
	}
	s.mustHold("event stream deleted, then recreated", o, rec, fmt.Sprintf("%s without the stream, nothing dead-lettered", outage))
}

// The dead-letter stream is unavailable when a row must be dead-lettered:
// the relay cannot settle that row, so the slot stays before its
// transaction, the aggregate's later events wait behind it, and the log
// says why; other aggregates keep flowing. When the stream is back the
// record lands and everything moves on.
func TestDeadLetterStreamUnavailable(t *testing.T) {
	t.Parallel()
	env := testenv.Get(t)
	s := newScenario(t, env.PG, env.NATS.URL)
	ctx := context.Background()
	s.createStreams(ctx, 4096)
	s.sample()
	r := s.startRelay()
	ld := startLoad(t, s.db.Pool, loadSpec{Writers: 2, Aggregates: 50, Pause: 5 * time.Millisecond})
	s.waitCount(s.stream, 100, 30*time.Second)
	dinfo := s.streamInfo(ctx, s.dlq)
	if err := s.js.DeleteStream(ctx, s.dlq); err != nil {
		t.Fatal(err)
	}
	gone := time.Now()
	bad := s.insertEvents(ctx, [4]any{"registration", "x", 1, bigPayload(8000)})
	next := s.insertEvents(ctx, [4]any{"registration", "x", 2, `{"n": 2}`})
	outage := 4 * time.Second
	var maxConfirmed replication.LSN
	for end := time.Now().Add(outage); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		if sl, err := s.slot(ctx); err == nil {
			maxConfirmed = max(maxConfirmed, sl.ConfirmedFlushLSN)
		}
	}
	n0, _ := s.streamState(ctx, s.stream)
	time.Sleep(time.Second)
	n1, _ := s.streamState(ctx, s.stream)
	if n1 <= n0 {
		t.Errorf("other aggregates stopped flowing while the dead-letter stream was missing")
	}
	for _, m := range readStream(ctx, t, s.js, s.stream) {
		if m.EventID == next[0] {
			t.Fatal("aggregate x version 2 was published before version 1 was settled")
		}
	}
	t.Run("logs why", func(t *testing.T) {
		if _, ok := r.waitLog(gone, time.Second, func(e logEntry) bool {
			return (e.Level == "warn" || e.Level == "error") && strings.Contains(e.Msg+" "+e.Error, s.name+"_dlq")
		}); !ok {
			t.Errorf("no warning naming the dead-letter subject within 1s of the failure (last warning: %q)", lastWarn(r, gone))
		}
	})
	if _, err := s.js.CreateStream(ctx, dinfo.Config); err != nil {
		t.Fatal(err)
	}
	s.waitCount(s.dlq, 1, 60*time.Second)
	rec, err := s.caughtUp(60 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	ld.stop()
	o := s.verify(time.Minute, bad[0])
	m, ok := dlqRecord(o.DLQ, bad[0])
	if !ok {
		t.Fatal("the oversized event never reached the dead-letter stream")
	}
	if got := strings.Join(m.Header[contract.DLQReasonClass], ","); got != "too_large" {
		t.Errorf("reason class %q, want too_large", got)
	}
	// The slot never passed the stuck transaction while it was unsettled.
	// PostgreSQL re-sends a transaction whose commit record starts at or
	// after confirmed_flush_lsn, so confirming exactly its commit LSN (the
	// end of the transaction before it) is still safe.
	if maxConfirmed > m.CommitLSN {
		t.Errorf("slot confirmed %s during the outage, past the unsettled transaction's commit %s", maxConfirmed, m.CommitLSN)
	}
	s.mustHold("dead-letter stream unavailable", o, rec, fmt.Sprintf("%s outage; slot held at %s <= commit %s", outage, maxConfirmed, m.CommitLSN))
}
