package consumer

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestPrunerRefusesShortRetentionAndKeepsOpenDeadLetters(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := context.Background()

	// f.stream keeps messages forever: no retention is safe.
	p, err := NewPruner(f.pool, f.js, PruneConfig{Consumer: "pr", Stream: f.stream, Retention: 24 * time.Hour})
	testenv.Must(t, err, "new pruner")
	if _, err := p.PruneOnce(ctx); !errors.Is(err, ErrRetentionTooShort) {
		t.Fatalf("stream without max_age: err %v, want ErrRetentionTooShort", err)
	}

	aged := testenv.UniqueName("AGED")
	_, err = f.js.CreateStream(ctx, jetstream.StreamConfig{Name: aged, Subjects: []string{aged + ".>"}, MaxAge: time.Hour, Storage: jetstream.MemoryStorage})
	testenv.Must(t, err, "create stream")
	t.Cleanup(func() { _ = f.js.DeleteStream(context.Background(), aged) })

	for _, tc := range []struct {
		retention, replay time.Duration
		ok                bool
	}{
		{30 * time.Minute, 0, false},          // shorter than max_age
		{2 * time.Hour, 0, true},              // covers max_age
		{2 * time.Hour, 5 * time.Hour, false}, // shorter than the replay window
	} {
		p, err := NewPruner(f.pool, f.js, PruneConfig{Consumer: "pr", Stream: aged, Retention: tc.retention, ReplayWindow: tc.replay})
		testenv.Must(t, err, "new pruner")
		if err := p.Check(ctx); (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrRetentionTooShort)) {
			t.Errorf("retention %s replay %s: Check = %v, want ok=%v", tc.retention, tc.replay, err, tc.ok)
		}
	}

	mustExec(t, f.pool, `INSERT INTO consumed_message (consumer, event_id, consumed_at) VALUES
		('pr', 'old', now() - interval '3 hours'),
		('pr', 'old-with-dead-letter', now() - interval '3 hours'),
		('pr', 'recent', now()),
		('other', 'old', now() - interval '3 hours')`)
	mustExec(t, f.pool, `INSERT INTO consumer_dead_letter (consumer, event_id, subject, stream, stream_seq, headers, payload,
		failure_class, reason, attempts, first_failed_at, last_failed_at)
		VALUES ('pr', 'old-with-dead-letter', 's', 'S', 1, '{}', '', 'conflict', 'x', 1, now(), now())`)
	p, err = NewPruner(f.pool, f.js, PruneConfig{Consumer: "pr", Stream: aged, Retention: 2 * time.Hour, Batch: 1})
	testenv.Must(t, err, "new pruner")
	n, err := p.PruneOnce(ctx)
	testenv.Must(t, err, "prune")
	if n != 1 {
		t.Fatalf("pruned %d rows, want 1", n)
	}
	if left := queryInt(t, f.pool, `SELECT count(*) FROM consumed_message`); left != 3 {
		t.Fatalf("%d rows left, want 3 (the open dead letter's, the recent one, the other consumer's)", left)
	}
}

// A message redelivered after its dead letter was written (the process died
// before terminating it) updates the open record instead of adding one.
func TestDeadLetterOfARedeliveryUpdatesTheOpenRecord(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	c, err := New(f.pool, f.js, f.baseConfig("upsert"), newRecorder("upsert"))
	testenv.Must(t, err, "new")
	m := event{ID: uuidN(1), AggID: "a", Version: 1}.msg(f.stream)
	it := &item{m: Message{Subject: m.Subject, Header: m.Header, Stream: f.stream, StreamSeq: 7, Deliveries: 1}}
	c.parse(it, m.Data)
	now := time.Now()
	id1, err := c.insertDeadLetter(context.Background(), it, ClassUnknown, errors.New("first"), &failState{attempts: 3, first: now, last: now})
	testenv.Must(t, err, "first dead letter")
	it.m.Deliveries = 4
	id2, err := c.insertDeadLetter(context.Background(), it, ClassPermanent, errors.New("second"), &failState{attempts: 1, first: now, last: now.Add(time.Second)})
	testenv.Must(t, err, "second dead letter")
	if id1 != id2 {
		t.Fatalf("second dead letter %d, want the open record %d", id2, id1)
	}
	var attempts int
	var deliveries int64
	var reason string
	testenv.Must(t, f.pool.QueryRow(context.Background(), `SELECT attempts, deliveries, reason FROM consumer_dead_letter WHERE id = $1`, id1).
		Scan(&attempts, &deliveries, &reason), "read")
	if attempts != 4 || deliveries != 4 || reason != "second" {
		t.Fatalf("attempts %d deliveries %d reason %q", attempts, deliveries, reason)
	}
}
