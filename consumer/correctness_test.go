package consumer

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/contract"
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

// Issue 15, case 3: while NATS is unreachable the failed message cannot come
// back, so its aggregate stays held however long the outage lasts. The
// heartbeat used to release it after the retry delay plus 2×AckWait, and a
// later event was applied first.
func TestHeldAggregateKeptThroughNATSOutage(t *testing.T) {
	if testing.Short() {
		t.Skip("fault test")
	}
	t.Parallel()
	env := testenv.Get(t)
	f := newFixture(t)
	proxy, err := testenv.StartProxy(strings.TrimPrefix(env.NATS.URL, "nats://"))
	testenv.Must(t, err, "start proxy")
	t.Cleanup(proxy.Close)
	nc, err := nats.Connect("nats://"+proxy.Addr, nats.MaxReconnects(-1))
	testenv.Must(t, err, "connect through proxy")
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	testenv.Must(t, err, "jetstream")

	var stalled atomic.Bool
	r := newRecorder("outage-order")
	r.fail = func(m *Message, call int) error {
		if m.AggregateVersion == 1 && call == 1 {
			proxy.Stall(testenv.Both) // the NATS link stops, the database works
			stalled.Store(true)
			return Transient(errors.New("downstream busy"))
		}
		return nil
	}
	cfg := f.baseConfig("outage-order")
	cfg.AckWait = time.Second // the old release came after the retry delay + 2 s
	cfg.HandlerTimeout = 500 * time.Millisecond
	cfg.GapWait = 2 * time.Second
	f.publish(event{ID: uuidN(1), AggID: "a", Version: 1}, event{ID: uuidN(2), AggID: "a", Version: 2})
	c, err := New(f.pool, js, cfg, r, WithLogger(zaptest.NewLogger(t)), WithRegisterer(f.reg))
	testenv.Must(t, err, "new consumer")
	f.run(c)
	f.waitFor("version 1 failing", 15*time.Second, stalled.Load)
	// The outage itself is the scenario: several release periods long.
	time.Sleep(5 * time.Second)
	if got := appliedVersions(t, f, "outage-order", "a"); len(got) != 0 {
		t.Fatalf("applied %v during the NATS outage, want nothing (version 1 has not come back)", got)
	}
	proxy.Heal()
	f.waitFor("both versions applied", 30*time.Second, func() bool {
		return len(appliedVersions(t, f, "outage-order", "a")) >= 2
	})
	if got := appliedVersions(t, f, "outage-order", "a"); fmt.Sprint(got) != "[1 2]" {
		t.Fatalf("applied %v, want [1 2]", got)
	}
}

// The other side of case 3: a retried message that left the stream (deleted
// by an operator, or aged out) cannot come back, and its aggregate is
// released.
func TestHeldAggregateReleasedWhenFailedMessageLeftTheStream(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	var failedSeq atomic.Uint64
	r := newRecorder("left")
	r.fail = func(m *Message, call int) error {
		if m.AggregateVersion == 1 {
			failedSeq.Store(m.StreamSeq)
			return Transient(errors.New("downstream busy"))
		}
		return nil
	}
	cfg := f.baseConfig("left")
	cfg.AckWait = time.Second
	cfg.HandlerTimeout = 500 * time.Millisecond
	cfg.RetryBase, cfg.RetryMax = 4*time.Second, 4*time.Second // the retry waits; the test deletes it meanwhile
	cfg.GapWait = 5 * time.Second
	f.publish(event{ID: uuidN(1), AggID: "a", Version: 1}, event{ID: uuidN(2), AggID: "a", Version: 2})
	f.start(cfg, r)
	f.waitFor("version 1 failing", 15*time.Second, func() bool { return failedSeq.Load() != 0 })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := f.js.Stream(ctx, f.stream)
	testenv.Must(t, err, "stream")
	testenv.Must(t, s.DeleteMsg(ctx, failedSeq.Load()), "delete the failed message")
	f.waitFor("version 2 applied", 20*time.Second, func() bool {
		return fmt.Sprint(appliedVersions(t, f, "left", "a")) == "[2]"
	})
}

// Issue 15, case 4: a second service with the same Name, another database
// and another filter is refused instead of taking over the durable
// consumer (which used to rewrite its filter, so the first service received
// none of its own events and applied the other's with its handler).
func TestDurableNameClashIsRefused(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	other := newFixture(t) // another database; its stream is not used
	regs, pays := newRecorder("clash"), newRecorder("clash")
	cfg := f.baseConfig("clash")
	cfg.FilterSubjects = []string{f.stream + ".registration.>"}
	f.start(cfg, regs)
	f.publish(event{ID: uuidN(1), AggID: "r1", Version: 1})
	f.waitSettled("clash", 15*time.Second)

	runFor := func(db DB, cfg Config) error {
		c, err := New(db, f.js, cfg, pays, WithLogger(zaptest.NewLogger(t)), WithRegisterer(other.reg))
		testenv.Must(t, err, "new consumer")
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return c.Run(ctx)
	}
	clash := cfg
	clash.FilterSubjects = []string{f.stream + ".payment.>"}
	if err := runFor(other.pool, clash); !errors.Is(err, ErrDurableClash) || !strings.Contains(err.Error(), "belongs to database") {
		t.Fatalf("second service with the same name: Run = %v, want ErrDurableClash naming the database", err)
	}
	// The same service changing its filter must say so.
	if err := runFor(f.pool, clash); !errors.Is(err, ErrDurableClash) || !strings.Contains(err.Error(), "AllowFilterChange") {
		t.Fatalf("filter change without AllowFilterChange: Run = %v, want ErrDurableClash", err)
	}
	// Even allowed, a filter change never takes over another database's.
	clash.AllowFilterChange = true
	if err := runFor(other.pool, clash); !errors.Is(err, ErrDurableClash) {
		t.Fatalf("AllowFilterChange from another database: Run = %v, want ErrDurableClash", err)
	}

	f.publish(event{ID: uuidN(2), AggID: "r2", Version: 1}, event{ID: uuidN(3), AggType: "payment", AggID: "p1", Version: 1})
	f.waitFor("the first service's own event", 15*time.Second, func() bool { return regs.callCount(uuidN(2)) == 1 })
	if pays.callCount(uuidN(3)) != 0 || regs.callCount(uuidN(3)) != 0 {
		t.Fatalf("payment event handled: %d by the clashing service, %d by the first", pays.callCount(uuidN(3)), regs.callCount(uuidN(3)))
	}
}

// Issue 15, case 5: a dead letter the database cannot store as is (invalid
// UTF-8 or NUL in a reason or header, a class outside the table's CHECK) is
// still recorded, sanitised or escaped, instead of being retried forever
// while its aggregate stalls.
func TestUnstorableDeadLettersAreRecorded(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := newRecorder("unstorable")
	r.fail = func(m *Message, _ int) error {
		switch m.AggregateID {
		case "reason":
			return Permanent(errors.New("bad byte \xff and a \x00 in the reason"))
		case "header":
			return Permanent(errors.New("header case"))
		case "class":
			return &ClassError{Class: "business-hold", Err: errors.New("custom class")}
		case "caf\u00e9":
			return Permanent(errors.New("refused subject case"))
		}
		return nil
	}
	// A constraint the library does not know stands for any refusal that
	// sanitising cannot prevent: the record is then stored escaped.
	mustExec(t, f.pool, `ALTER TABLE consumer_dead_letter ADD CONSTRAINT ascii_subject CHECK (subject ~ '^[ -~]*$')`)
	f.start(f.baseConfig("unstorable"), r)
	f.publish(event{ID: uuidN(6), AggID: "caf\u00e9", Version: 1})
	f.publish(event{ID: uuidN(1), AggID: "reason", Version: 1})
	m := event{ID: uuidN(2), AggID: "header", Version: 1}.msg(f.stream)
	m.Header.Set("Outbox-Extra-Note", "caf\xe9 with \x00")
	_, err := f.js.PublishMsg(context.Background(), m)
	testenv.Must(t, err, "publish")
	m = event{ID: uuidN(5), AggID: "type", Version: 1}.msg(f.stream)
	m.Header.Set(contract.EventType, "Type\xff") // the dedup row could never hold it
	_, err = f.js.PublishMsg(context.Background(), m)
	testenv.Must(t, err, "publish")
	f.publish(event{ID: uuidN(3), AggID: "class", Version: 1}, event{ID: uuidN(4), AggID: "class", Version: 2})
	f.waitSettled("unstorable", 20*time.Second)

	for _, tc := range []struct{ id, class, reason string }{
		{uuidN(1), "permanent", "bad byte"},
		{uuidN(2), "permanent", "header case"},
		{uuidN(3), "unknown", `class "business-hold" is not a dead-letter class`},
		{uuidN(5), "permanent", `header Outbox-Event-Type "Type\xff" is not valid UTF-8 text`},
		{uuidN(6), "permanent", `dead letter stored escaped: the database refused it as is (SQLSTATE 23514`},
	} {
		var class, reason string
		err := f.pool.QueryRow(context.Background(), `SELECT failure_class, reason FROM consumer_dead_letter
			WHERE consumer = 'unstorable' AND event_id = $1`, tc.id).Scan(&class, &reason)
		testenv.Must(t, err, "dead letter of %s", tc.id)
		if class != tc.class || !strings.Contains(reason, tc.reason) {
			t.Errorf("dead letter of %s: class %q reason %q, want %s containing %q", tc.id, class, reason, tc.class, tc.reason)
		}
	}
	if n := r.callCount(uuidN(4)); n != 1 {
		t.Errorf("the next version of the custom-class aggregate was handled %d times, want 1", n)
	}

	// Replays failing the same way are reopened, not left 'replaying'.
	mustExec(t, f.pool, `UPDATE consumer_dead_letter SET status = 'replaying', replay_requested_by = 'test'
		WHERE consumer = 'unstorable' AND event_id = ANY($1)`, []string{uuidN(1), uuidN(3)})
	f.waitFor("failed replays reopened", 15*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'unstorable'
			AND event_id = ANY($1) AND status = 'open' AND reason LIKE 'replay failed: %'`, []string{uuidN(1), uuidN(3)}) == 2
	})
}

// An install made with an earlier sql/consumer.sql is upgraded in place,
// by Migrate (which Run calls) and by running the file again.
func TestMigrateUpgradesAnEarlierSchema(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	downgrade := func() {
		mustExec(t, f.pool, `DELETE FROM consumed_message WHERE outcome = 'discarded'`)
		mustExec(t, f.pool, `DROP INDEX consumer_dead_letter_event_key`)
		mustExec(t, f.pool, `CREATE UNIQUE INDEX consumer_dead_letter_message_key ON consumer_dead_letter (consumer, stream, stream_seq)
			WHERE status IN ('open', 'replaying')`)
		mustExec(t, f.pool, `ALTER TABLE consumed_message DROP CONSTRAINT consumed_message_outcome_check,
			ADD CONSTRAINT consumed_message_outcome_check CHECK (outcome IN ('applied', 'rejected'))`)
	}
	check := func(how string) {
		t.Helper()
		if n := queryInt(t, f.pool, `SELECT count(*) FROM pg_class WHERE relname = 'consumer_dead_letter_message_key'`); n != 0 {
			t.Errorf("%s: the old dead-letter key is still there", how)
		}
		if n := queryInt(t, f.pool, `SELECT count(*) FROM pg_class WHERE relname = 'consumer_dead_letter_event_key'`); n != 1 {
			t.Errorf("%s: the dead-letter key by event is missing", how)
		}
		mustExec(t, f.pool, `INSERT INTO consumed_message (consumer, event_id, outcome) VALUES ($1, 'e', 'discarded')`, how)
	}
	ctx := context.Background()
	downgrade()
	// Processes starting together: one upgrades, the others wait and see it done.
	errs := make(chan error, 4)
	for range cap(errs) {
		go func() { errs <- Migrate(ctx, f.pool) }()
	}
	for range cap(errs) {
		testenv.Must(t, <-errs, "concurrent migrate")
	}
	testenv.Must(t, Migrate(ctx, f.pool), "migrate again")
	check("Migrate")
	downgrade()
	f.db.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "consumer.sql"))
	check("sql/consumer.sql")
}

// commitLiar is a database whose commits go through but report an error,
// as when the deadline expires or the connection breaks just after the
// server committed.
type commitLiar struct{ *pgxpool.Pool }

func (d commitLiar) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := d.Pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return lyingTx{tx}, nil
}

type lyingTx struct{ pgx.Tx }

func (t lyingTx) Commit(ctx context.Context) error {
	if err := t.Tx.Commit(ctx); err != nil {
		return err
	}
	return fmt.Errorf("commit: %w", context.DeadlineExceeded)
}

// Issue 15, case 7: a commit that went through but reported an error is
// recognised by its dedup row and acknowledged as applied. On the last
// allowed attempt it used to be dead-lettered as well as applied.
func TestCommitErrorAfterCommitIsApplied(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := newRecorder("liar")
	cfg := f.baseConfig("liar")
	cfg.MaxAttempts = 1
	c, err := New(commitLiar{f.pool}, f.js, cfg, r, WithLogger(zaptest.NewLogger(t)), WithRegisterer(f.reg))
	testenv.Must(t, err, "new consumer")
	f.run(c)
	e := event{ID: uuidN(1), AggID: "a", Version: 1}
	f.publish(e)
	f.waitSettled("liar", 15*time.Second)
	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE event_id = $1`, e.ID); n != 1 {
		t.Fatalf("applied %d times, want 1", n)
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'liar'`); n != 0 {
		t.Fatalf("%d dead letters for an applied event, want 0", n)
	}
	if got := metricValue(t, mustVec(t, f).processed.WithLabelValues("liar", "applied")); got != 1 {
		t.Fatalf("applied = %v, want 1", got)
	}
}

// Issue 15, likely case: on shutdown the messages held behind a failed one
// come back only after it can have been applied. They used to be nak'ed at
// once, so in a rolling deploy the next process applied the later event
// while the failed one still waited out its retry delay.
func TestShutdownKeepsHeldMessagesBehindTheFailedOne(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	var failed atomic.Bool
	first := newRecorder("rolling")
	first.fail = func(m *Message, call int) error {
		if m.AggregateVersion == 1 {
			failed.Store(true)
			return Transient(errors.New("downstream busy"))
		}
		return nil
	}
	cfg := f.baseConfig("rolling")
	cfg.AckWait = time.Second
	cfg.HandlerTimeout = 500 * time.Millisecond
	cfg.RetryBase, cfg.RetryMax = 2*time.Second, 2*time.Second
	f.publish(event{ID: uuidN(1), AggID: "a", Version: 1}, event{ID: uuidN(2), AggID: "a", Version: 2})
	stop := f.run(f.newConsumer(cfg, first))
	f.waitFor("version 1 failed and version 2 delivered", 15*time.Second, func() bool {
		info, ok := f.consumerInfo("rolling")
		return ok && failed.Load() && info.Delivered.Stream >= 2
	})
	testenv.Must(t, stop(), "first process")
	f.run(f.newConsumer(cfg, newRecorder("rolling"))) // the next process of a rolling deploy
	f.waitFor("both versions applied", 20*time.Second, func() bool {
		return len(appliedVersions(t, f, "rolling", "a")) >= 2
	})
	if got := appliedVersions(t, f, "rolling", "a"); fmt.Sprint(got) != "[1 2]" {
		t.Fatalf("applied %v, want [1 2]", got)
	}
}

// Issue 15, likely case: a handler that ignores its context and hangs
// delays the aggregates of its own worker only. The dispatcher used to block
// on that worker's full channel, stalling every worker, and the worker's
// queued messages lost their progress acks.
func TestHungHandlerDelaysOnlyItsWorker(t *testing.T) {
	if testing.Short() {
		t.Skip("waits two ack waits")
	}
	t.Parallel()
	f := newFixture(t)
	unhang := make(chan struct{})
	r := newRecorder("hung")
	r.fail = func(m *Message, call int) error {
		if m.AggregateID == "hang" && call == 1 {
			<-unhang // ignores ctx
		}
		return nil
	}
	cfg := f.baseConfig("hung")
	cfg.Workers = 2
	cfg.MaxAckPending = 1000
	// Progress acks go every AckWait/3: 4 s leaves a loaded CI machine
	// (the race detector, every package at once) room to send them.
	cfg.AckWait = 4 * time.Second
	cfg.HandlerTimeout = time.Second
	c := f.newConsumer(cfg, r)
	released := false
	release := func() {
		if !released {
			released = true
			close(unhang)
		}
	}
	hung := c.workerIndex("registration\x00hang")
	evs := []event{{ID: "hang-1", AggID: "hang", Version: 1}}
	others := 0
	for i := range 300 {
		e := event{ID: fmt.Sprintf("ev-%d", i), AggID: fmt.Sprintf("a%d", i), Version: 1}
		evs = append(evs, e)
		if c.workerIndex("registration\x00"+e.AggID) != hung {
			others++
		}
	}
	f.publish(evs...)
	f.run(c)
	t.Cleanup(release) // runs before the cleanup that waits for Run
	applied := func() int64 { return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'hung'`) }
	f.waitFor("the other worker's events applied", 30*time.Second, func() bool { return applied() >= int64(others) })
	// The hung worker's queue is kept alive: nothing but the hung message
	// itself is redelivered over two ack waits.
	deadline := time.Now().Add(2*cfg.AckWait + cfg.AckWait/2)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		cons, err := f.js.Consumer(ctx, f.stream, "hung")
		testenv.Must(t, err, "consumer")
		info, err := cons.Info(ctx)
		cancel()
		testenv.Must(t, err, "consumer info")
		if info.NumRedelivered > 1 {
			t.Fatalf("%d messages redelivered while the handler hung, want at most the hung one", info.NumRedelivered)
		}
		time.Sleep(200 * time.Millisecond) // polling interval
	}
	release()
	f.waitFor("every event applied", 30*time.Second, func() bool { return applied() == int64(len(evs)) })
	f.waitSettled("hung", 20*time.Second)
}

// reopenFails is a database on which, while on, reopening a failed replay
// fails, as when the database goes away between the replay and the reopen.
type reopenFails struct {
	*pgxpool.Pool
	on *atomic.Bool
}

func (d reopenFails) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := d.Pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return failingReopenTx{tx, d.on}, nil
}

type failingReopenTx struct {
	pgx.Tx
	on *atomic.Bool
}

func (t failingReopenTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if t.on.Load() && strings.Contains(sql, "SET status = 'open', failure_class") {
		return pgconn.CommandTag{}, Transient(errors.New("injected: connection lost"))
	}
	return t.Tx.Exec(ctx, sql, args...)
}

// Issue 15, likely case: when a replay fails and reopening its record fails
// too, the aggregate's later records of the same batch wait for the next
// poll. They used to be applied ahead of the earlier record.
func TestFailedReplayHoldsLaterRecordsOfTheBatch(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	var fixed, reopenBroken atomic.Bool
	r := newRecorder("replay-order")
	r.fail = func(m *Message, _ int) error {
		if m.AggregateVersion == 1 || !fixed.Load() {
			return Permanent(errors.New("account missing"))
		}
		return nil
	}
	c, err := New(reopenFails{f.pool, &reopenBroken}, f.js, f.baseConfig("replay-order"), r,
		WithLogger(zaptest.NewLogger(t)), WithRegisterer(f.reg))
	testenv.Must(t, err, "new consumer")
	f.run(c)
	f.publish(event{ID: uuidN(1), AggID: "a", Version: 1}, event{ID: uuidN(2), AggID: "a", Version: 2})
	f.waitFor("two dead letters", 15*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'replay-order'`) == 2
	})
	fixed.Store(true) // version 2 would apply now, version 1 still fails
	reopenBroken.Store(true)
	mustExec(t, f.pool, `UPDATE consumer_dead_letter SET status = 'replaying', replay_requested_by = 'test' WHERE consumer = 'replay-order'`)
	f.waitFor("version 1 replayed three times", 15*time.Second, func() bool { return r.callCount(uuidN(1)) >= 4 })
	if got := appliedVersions(t, f, "replay-order", "a"); len(got) != 0 {
		t.Fatalf("applied %v while version 1's replay keeps failing, want nothing", got)
	}
	reopenBroken.Store(false)
	f.waitFor("both records open again", 15*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'replay-order' AND status = 'open'`) == 2
	})
	if got := appliedVersions(t, f, "replay-order", "a"); len(got) != 0 {
		t.Fatalf("applied %v, want nothing (version 1 failed)", got)
	}
}

// An aggregate without a type (legal in the header contract; its dead
// letters store NULL) is held behind its dead-lettered earlier version like
// any other: the later version is dead-lettered at once, naming the record
// to replay first, instead of waiting out GapWait as an ordinary gap.
func TestUntypedAggregateWaitsForItsDeadLetteredVersion(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := newRecorder("untyped")
	r.fail = func(m *Message, _ int) error {
		if m.AggregateVersion == 2 {
			return Permanent(errors.New("cannot apply version 2"))
		}
		return nil
	}
	cfg := f.baseConfig("untyped")
	cfg.VersionCheck = true
	cfg.AckWait = time.Second
	cfg.GapWait = 30 * time.Second
	f.start(cfg, r)
	for v := int64(1); v <= 3; v++ {
		m := event{ID: uuidN(int(v)), AggID: "u", Version: v}.msg(f.stream)
		m.Header.Del(contract.AggregateType)
		_, err := f.js.PublishMsg(context.Background(), m)
		testenv.Must(t, err, "publish")
	}
	var reason string
	f.waitFor("version 3 dead-lettered behind version 2", 10*time.Second, func() bool {
		return f.pool.QueryRow(context.Background(), `SELECT reason FROM consumer_dead_letter WHERE consumer = 'untyped' AND event_id = $1`,
			uuidN(3)).Scan(&reason) == nil
	})
	if !strings.Contains(reason, "replay it first") {
		t.Fatalf("version 3's reason %q, want it to name the dead-lettered version 2", reason)
	}
}

// Two processes share a durable. This one's attempt of h fails and is
// naked; the redelivery goes to the other process, which applies and
// acknowledges it. A lower message still unacknowledged keeps the
// durable's ack floor below h, and h is still in the stream: the source
// cannot tell that h is settled, and the aggregate's later message stayed
// held behind it until the floor passed h — on a busy shared durable under
// load, minutes ("retried message not redelivered yet"). h's own dedup row
// tells: the overdue block is released.
func TestRetriedMessageAppliedElsewhereReleasesItsAggregate(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	cfg := f.baseConfig("elsewhere")
	here := f.newConsumer(cfg, newRecorder("elsewhere"))
	there := f.newConsumer(cfg, newRecorder("elsewhere"), WithRegisterer(prometheus.NewRegistry()))
	f.publish(event{ID: "low", AggID: "low", Version: 1}, event{ID: "h", AggID: "x", Version: 1}, event{ID: "h2", AggID: "x", Version: 2})
	jc := f.durable(cfg.Name, 30*time.Second)
	ctx := context.Background()
	strm, err := f.js.Stream(ctx, f.stream)
	testenv.Must(t, err, "stream")
	its := f.fetch(here, jc, 3, 5*time.Second) // "low" stays unacknowledged
	w := newWorker(here, &durableSource{c: here, strm: strm, cons: jc}, 0)
	w.finish(ctx, its[1], result{kind: resFailed, class: ClassTransient, err: Transient(errors.New("x moved concurrently"))})
	w.queue = append(w.queue, its[2])
	if got := w.take(); len(got) != 0 {
		t.Fatalf("took %d messages; h2 should be held behind h", len(got))
	}
	again := f.fetch(there, jc, 1, 10*time.Second) // the retry, pulled by the other process
	if again[0].m.ID != "h" {
		t.Fatalf("redelivered %s, want h", again[0].m.ID)
	}
	drive(there, newWorker(there, nil, 0), again)
	if queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE event_id = 'h'`) != 1 {
		t.Fatalf("the other process did not apply h")
	}
	b := w.blocked[its[1].key]
	b.until = time.Now().Add(-time.Second) // overdue: as 2×AckWait later
	w.heartbeat(ctx)
	w.settleOverdue(<-w.answers) // the look-up's answer, as run takes it
	if w.blocked[its[1].key] != nil {
		t.Fatalf("aggregate x still held behind h, which the other process applied")
	}
	if got := w.take(); len(got) != 1 || got[0].m.ID != "h2" {
		t.Fatalf("took %d messages after the release, want h2", len(got))
	}
}

// batchTakenOver is a database whose first batch transaction (a dedup
// statement over several events) does not commit: as when the process
// stalled past its deadline, another group member took the partition over
// and applied the batch's first event, and this transaction's backend was
// ended as a zombie. Its Commit rolls back, commits the first event's dedup
// row and effect as that member would, and returns an error.
type batchTakenOver struct {
	*pgxpool.Pool
	name string
	lied atomic.Bool
}

func (d *batchTakenOver) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := d.Pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &takenOverTx{Tx: tx, d: d}, nil
}

type takenOverTx struct {
	pgx.Tx
	d     *batchTakenOver
	first []any // the dedup statement's values of the batch's first event
}

func (t *takenOverTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if strings.Contains(sql, "unnest") && len(args) >= 7 {
		if ids, _ := args[1].([]string); len(ids) > 1 {
			t.first = []any{args[1].([]string)[0], args[2].([][]byte)[0], args[3].([]string)[0], args[4].([]string)[0],
				args[5].([]string)[0], args[6].([]int64)[0]}
		}
	}
	return t.Tx.Query(ctx, sql, args...)
}

func (t *takenOverTx) Commit(ctx context.Context) error {
	if t.first == nil || !t.d.lied.CompareAndSwap(false, true) {
		return t.Tx.Commit(ctx)
	}
	if err := t.Tx.Rollback(ctx); err != nil {
		return err
	}
	other, err := t.d.Pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = other.Rollback(ctx) }()
	if _, err := other.Exec(ctx, `INSERT INTO consumed_message (consumer, event_id, content_hash, event_type, aggregate_type,
		aggregate_id, aggregate_version, outcome) VALUES ($1, $2, $3, $4, $5, $6, $7, 'applied')`, append([]any{t.d.name}, t.first...)...); err != nil {
		return err
	}
	if _, err := other.Exec(ctx, `INSERT INTO applied (consumer, event_id, aggregate_id, version) VALUES ($1, $2, $3, $4)`,
		"other member", t.first[0], t.first[4], t.first[5]); err != nil {
		return err
	}
	if err := other.Commit(ctx); err != nil {
		return err
	}
	return fmt.Errorf("commit: %w", context.DeadlineExceeded)
}

// A batch whose commit failed is applied only if every event it wrote is
// recorded. The dedup row of one event does not tell: another member that
// took the partition over (the process had stalled) may have applied that
// event in a transaction of its own while this one rolled back. Reading
// the batch as committed then acknowledged its other events unapplied, and
// the stalled member went on with their aggregates' later events, ahead of
// the new owner (internal/grouptest TestGroupMemberPaused, out of order).
func TestBatchCommitErrorAfterTakeoverIsNotApplied(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := newRecorder("takeover")
	r.fail = func(m *Message, call int) error {
		if m.AggregateID == "slow" {
			time.Sleep(300 * time.Millisecond) // the others queue up behind it
		}
		return nil
	}
	evs := []event{{ID: uuidN(1), AggID: "slow", Version: 1}}
	for i := range 4 {
		evs = append(evs, event{ID: uuidN(10 + i), AggID: fmt.Sprintf("agg-%d", i), Version: 1})
	}
	f.publish(evs...)
	cfg := f.baseConfig("takeover")
	cfg.Workers = 1
	db := &batchTakenOver{Pool: f.pool, name: "takeover"}
	c, err := New(db, f.js, cfg, r, WithLogger(zaptest.NewLogger(t)), WithRegisterer(f.reg))
	testenv.Must(t, err, "new consumer")
	f.run(c)
	f.waitSettled("takeover", 20*time.Second)
	if !db.lied.Load() {
		t.Fatal("no batch transaction of several events was committed: the test did not run its case")
	}
	for _, e := range evs {
		if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE event_id = $1`, e.ID); n != 1 {
			t.Errorf("event %s (%s) applied %d times, want 1", e.ID, e.AggID, n)
		}
	}
}
