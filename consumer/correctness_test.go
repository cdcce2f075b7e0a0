package consumer

import (
	"context"
	"errors"

	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// newConsumer builds a consumer on the fixture without running it.
func (f *fixture) newConsumer(cfg Config, h Handler, opts ...Option) *Consumer {
	f.t.Helper()
	opts = append([]Option{WithLogger(zaptest.NewLogger(f.t)), WithRegisterer(f.reg)}, opts...)
	c, err := New(f.pool, f.js, cfg, h, opts...)
	testenv.Must(f.t, err, "new consumer")
	return c
}

// run runs c until stop is called (or the test ends) and returns stop,
// which waits for Run and returns its error.
func (f *fixture) run(c *Consumer) (stop func() error) {
	f.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var err error
	stopped := false
	stop = func() error {
		if !stopped {
			stopped = true
			cancel()
			err = <-done
		}
		return err
	}
	f.t.Cleanup(func() { _ = stop() })
	return stop
}

// recreateStream deletes the fixture's stream and creates it again, empty:
// its sequences start at 1 again.
func (f *fixture) recreateStream() {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	testenv.Must(f.t, f.js.DeleteStream(ctx, f.stream), "delete stream")
	_, err := f.js.CreateStream(ctx, jetstream.StreamConfig{Name: f.stream, Subjects: []string{f.stream + ".>"}, Storage: jetstream.MemoryStorage})
	testenv.Must(f.t, err, "create stream")
}

// Issue 15, case 1: after the stream is recreated, a new message failing at
// the sequence of a still-open dead letter gets its own record; it used to be
// merged into the old one, losing its event id, payload and headers.
func TestDeadLetterNotMergedAcrossStreamRecreation(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := newRecorder("recreate")
	r.fail = func(m *Message, _ int) error { return Permanent(fmt.Errorf("cannot apply %s", m.ID)) }
	c := f.newConsumer(f.baseConfig("recreate"), r)
	records := func() int64 {
		return queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'recreate'`)
	}

	stop := f.run(c)
	e1 := event{ID: uuidN(1), AggID: "one", Version: 1, Payload: `{"n": 1}`}
	f.publish(e1)
	f.waitFor("first dead letter", 15*time.Second, func() bool { return records() == 1 })
	testenv.Must(t, stop(), "first run")

	f.recreateStream()
	f.run(c) // the same Consumer: no state of the first run may survive
	e2 := event{ID: uuidN(2), AggID: "two", Version: 1, Payload: `{"n": 2}`}
	f.publish(e2)
	f.waitFor("second dead letter", 15*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'recreate' AND event_id = $1`, e2.ID) == 1
	})
	if n := records(); n != 2 {
		t.Fatalf("%d dead letters, want 2 (one per event)", n)
	}
	for _, e := range []event{e1, e2} {
		var seq int64
		var payload, reason string
		err := f.pool.QueryRow(context.Background(), `SELECT stream_seq, convert_from(payload, 'UTF8'), reason
			FROM consumer_dead_letter WHERE consumer = 'recreate' AND event_id = $1`, e.ID).Scan(&seq, &payload, &reason)
		testenv.Must(t, err, "read dead letter of %s", e.ID)
		if seq != 1 || payload != e.Payload || !strings.Contains(reason, e.ID) {
			t.Errorf("dead letter of %s: seq %d payload %q reason %q", e.ID, seq, payload, reason)
		}
	}
}

// Issue 15, case 2: each failure class counts against its own limit. A
// message that failed transiently five times (an outage) used to be
// dead-lettered on its first unclassified error.
func TestAttemptsCountedPerClass(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := newRecorder("perclass")
	r.fail = func(m *Message, call int) error {
		if call <= 5 {
			return Transient(errors.New("database failing over"))
		}
		return errors.New("odd state")
	}
	cfg := f.baseConfig("perclass")
	cfg.MaxAttempts = 2
	f.start(cfg, r)
	e := event{ID: uuidN(1), AggID: "a", Version: 1}
	f.publish(e)
	f.waitSettled("perclass", 20*time.Second)
	if n := r.callCount(e.ID); n != 7 {
		t.Fatalf("handler called %d times, want 7 (5 transient, then MaxAttempts 2 unknown)", n)
	}
	var class, reason string
	var attempts int
	testenv.Must(t, f.pool.QueryRow(context.Background(), `SELECT failure_class, reason, attempts FROM consumer_dead_letter
		WHERE consumer = 'perclass' AND event_id = $1`, e.ID).Scan(&class, &reason, &attempts), "read dead letter")
	if class != "unknown" || attempts != 7 || !strings.Contains(reason, "gave up after 2 unknown attempts, 7 in all") {
		t.Fatalf("dead letter class %q attempts %d reason %q", class, attempts, reason)
	}
}
