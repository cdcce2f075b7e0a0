package consumer

import (
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// fuse installs a deferred trigger that fires at the commit of a
// transaction that inserted into commit_fuse: mode 'kill' terminates the
// committing backend before its commit record (the transaction rolls back,
// the client sees the connection end), mode 'sleep' holds the commit for
// two seconds and then lets it commit, and mode 'stubborn' does so through
// cancel requests, as a commit waiting for its WAL flush does (pgx sends
// one when it loses a connection).
//
// A cancel caught in one block is not enough: PostgreSQL 15's postmaster
// delivers a cancel request as two SIGINTs (to the backend and to its
// process group), and when the second arrives after the first was caught,
// PL/pgSQL raises it at the handler's CHECK_FOR_INTERRUPTS, outside the
// block, and the commit rolls back ('canceling statement due to user
// request', STATEMENT: commit). hold_commit nests its waits depth+1 deep: a
// cancel that escapes one level's handler is caught by the level around
// it, so the commit outlasts depth such escapes
// (TestStubbornFuseOutlastsADoubledCancel).
func (f *fixture) fuse() {
	f.t.Helper()
	mustExec(f.t, f.pool, `CREATE TABLE commit_fuse (mode text NOT NULL)`)
	mustExec(f.t, f.pool, `CREATE FUNCTION hold_commit(until timestamptz, depth int) RETURNS void LANGUAGE plpgsql AS $$
		BEGIN
			WHILE clock_timestamp() < until LOOP
				BEGIN
					IF depth = 0 THEN
						PERFORM pg_sleep(EXTRACT(EPOCH FROM until - clock_timestamp()));
					ELSE
						PERFORM hold_commit(until, depth - 1);
					END IF;
				EXCEPTION WHEN query_canceled THEN NULL;
				END;
			END LOOP;
		END $$`)
	mustExec(f.t, f.pool, `CREATE FUNCTION blow_commit_fuse() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.mode = 'kill' THEN
				PERFORM pg_terminate_backend(pg_backend_pid());
				PERFORM pg_sleep(10); -- the termination lands here
			ELSIF NEW.mode = 'stubborn' THEN
				PERFORM hold_commit(clock_timestamp() + interval '2 seconds', 3);
			ELSE
				PERFORM pg_sleep(2);
			END IF;
			RETURN NULL;
		END $$`)
	mustExec(f.t, f.pool, `CREATE CONSTRAINT TRIGGER commit_fuse AFTER INSERT ON commit_fuse
		DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION blow_commit_fuse()`)
}

// fusedHandler records each application in the applied table and, on the
// first call for an event listed in fuses, arms the commit fuse with its mode.
type fusedHandler struct {
	*recorder
	fuses map[string]string // event id → mode
	slow  map[string]time.Duration
}

func (h *fusedHandler) Handle(ctx context.Context, tx pgx.Tx, m *Message) error {
	if err := h.recorder.Handle(ctx, tx, m); err != nil {
		return err
	}
	if mode := h.fuses[m.ID]; mode != "" && h.callCount(m.ID) == 1 {
		if _, err := tx.Exec(ctx, `INSERT INTO commit_fuse VALUES ($1)`, mode); err != nil {
			return err
		}
	}
	// A handler that overruns its deadline and returns nil, as one that
	// ignores its context does.
	time.Sleep(h.slow[m.ID])
	return nil
}

// durable creates a pull consumer named name on the fixture's stream.
func (f *fixture) durable(name string, ackWait time.Duration) jetstream.Consumer {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	jc, err := f.js.CreateOrUpdateConsumer(ctx, f.stream, jetstream.ConsumerConfig{
		Durable: name, AckPolicy: jetstream.AckExplicitPolicy, AckWait: ackWait, MaxDeliver: -1,
	})
	testenv.Must(f.t, err, "create durable")
	return jc
}

// fetch takes n deliveries from jc, waiting up to timeout for them.
func (f *fixture) fetch(c *Consumer, jc jetstream.Consumer, n int, timeout time.Duration) []*item {
	f.t.Helper()
	var its []*item
	deadline := time.Now().Add(timeout)
	for len(its) < n && time.Now().Before(deadline) {
		b, err := jc.Fetch(n-len(its), jetstream.FetchMaxWait(time.Until(deadline)))
		testenv.Must(f.t, err, "fetch")
		for m := range b.Messages() {
			its = append(its, c.newItem(m))
		}
	}
	if len(its) < n {
		f.t.Fatalf("%d of %d deliveries within %s", len(its), n, timeout)
	}
	return its
}

// drive settles its the way a worker does, and then whatever the worker
// takes from its queue (messages a batch gave back), until it takes
// nothing.
func drive(c *Consumer, w *worker, its []*item) {
	ctx := context.Background()
	for len(its) > 0 {
		w.finishAll(ctx, its, c.processItems(ctx, its))
		its = w.take()
	}
}

// acked waits until the durable's ack floor reaches seq (an ack is not
// confirmed to its sender) and reports whether it did.
func (f *fixture) acked(jc jetstream.Consumer, seq uint64) bool {
	f.t.Helper()
	return testenv.WaitFor(5*time.Second, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		info, err := jc.Info(ctx)
		return err == nil && info.AckFloor.Stream >= seq
	})
}

// Two deliveries of one stream message in one batch (a redelivery of a
// message still queued), and the batch's commit is lost: the backend ends
// during COMMIT and the transaction rolls back. The second delivery was a
// duplicate only of the dedup row its own first delivery wrote inside that
// transaction: acking it loses the event. Nothing from inside a transaction
// whose commit failed may be acknowledged.
func TestLostBatchCommitAcksNothingFromInside(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.fuse()
	h := &fusedHandler{recorder: newRecorder("lostcommit"), fuses: map[string]string{"lc-1": "kill"}}
	cfg := f.baseConfig("lostcommit")
	cfg.BatchSize = 8
	c := f.newConsumer(cfg, h)
	f.publish(event{ID: "lc-1", AggID: "a", Version: 1})
	jc := f.durable(cfg.Name, time.Second)
	first := f.fetch(c, jc, 1, 5*time.Second)
	again := f.fetch(c, jc, 1, 10*time.Second) // redelivered after AckWait, unacked
	its := append(first, again...)
	if its[0].m.StreamSeq != its[1].m.StreamSeq || its[1].m.Deliveries < 2 {
		t.Fatalf("want two deliveries of one message, got seq %d and %d (delivery %d)", its[0].m.StreamSeq, its[1].m.StreamSeq, its[1].m.Deliveries)
	}
	drive(c, newWorker(c, nil, 0), its)
	acked := f.acked(jc, its[0].m.StreamSeq)
	applied := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'lostcommit'`)
	recorded := queryInt(t, f.pool, `SELECT count(*) FROM consumed_message WHERE consumer = 'lostcommit'`)
	if acked && (applied != 1 || recorded != 1) {
		t.Fatalf("message acknowledged while the database holds %d effects and %d dedup rows: lost", applied, recorded)
	}
	if !acked {
		t.Fatalf("message not acknowledged")
	}
	if h.callCount("lc-1") < 2 {
		t.Fatalf("handler called %d times: the lost commit was not retried", h.callCount("lc-1"))
	}
	if applied != 1 || recorded != 1 {
		t.Fatalf("%d effects and %d dedup rows, want 1 and 1", applied, recorded)
	}
}

// A batch holds a slow message (its handler outlasts HandlerTimeout and
// returns nil) and a duplicate behind it. The deadline ran out in the slow
// message's handler: the duplicate's dedup statements then fail on it, and
// that failure is the batch's, not the duplicate's. The duplicate is
// acknowledged as one; the slow message is charged, on its own attempt.
func TestBatchDeadlineIsNotChargedToANeighbour(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	h := &fusedHandler{recorder: newRecorder("deadline"), slow: map[string]time.Duration{"dl-slow": 1300 * time.Millisecond}}
	cfg := f.baseConfig("deadline")
	cfg.BatchSize = 8
	cfg.HandlerTimeout = time.Second
	cfg.MaxAttempts = 1
	c := f.newConsumer(cfg, h)
	dup := event{ID: "dl-dup", AggID: "d", Version: 1}
	if res := c.process(context.Background(), f.items(c, dup)[0]); res.kind != resApplied {
		t.Fatalf("applying the duplicate's first delivery: %+v", res)
	}
	dup.MsgID = "dl-dup-again" // stored again, as after the dedup window
	f.publish(event{ID: "dl-slow", AggID: "s", Version: 1}, dup)
	jc := f.durable(cfg.Name, 30*time.Second)
	its := f.fetch(c, jc, 2, 5*time.Second)
	drive(c, newWorker(c, nil, 0), its)
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'deadline' AND event_id = 'dl-dup'`); n != 0 {
		t.Errorf("the duplicate was dead-lettered for its neighbour's deadline")
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'deadline' AND event_id = 'dl-slow'
		AND failure_class = 'unknown' AND reason LIKE 'handler returned after HandlerTimeout 1s: context deadline exceeded%'`); n != 1 {
		t.Errorf("the slow message was not charged with its deadline (dead letters: %d)", n)
	}
	if !f.acked(jc, its[1].m.StreamSeq) {
		t.Errorf("the duplicate (seq %d) was not acknowledged", its[1].m.StreamSeq)
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'deadline' AND event_id = 'dl-dup'`); n != 1 {
		t.Errorf("the duplicate applied %d times", n)
	}
}

// proxiedPool is a pool for the fixture's database through a TCP proxy.
func (f *fixture) proxiedPool() (*pgxpool.Pool, *testenv.Proxy) {
	f.t.Helper()
	pcfg, err := pgxpool.ParseConfig(f.db.URL)
	testenv.Must(f.t, err, "parse pool config")
	p, err := testenv.StartProxy(net.JoinHostPort(pcfg.ConnConfig.Host, strconv.Itoa(int(pcfg.ConnConfig.Port))))
	testenv.Must(f.t, err, "start proxy")
	f.t.Cleanup(p.Close)
	host, port, _ := net.SplitHostPort(p.Addr)
	pn, _ := strconv.Atoi(port)
	pcfg.ConnConfig.Host, pcfg.ConnConfig.Port = host, uint16(pn)
	pcfg.ConnConfig.Fallbacks = nil
	pcfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	testenv.Must(f.t, err, "open proxied pool")
	f.t.Cleanup(pool.Close)
	return pool, p
}

// The commit goes through on the server while the client loses the
// connection, and the database cannot be reached to ask whether it did: the
// outcome is unknown. With one transient attempt allowed, a "not committed"
// answer dead-letters an event that is applied; unknown must be retried,
// and the redelivery finds the event applied.
func TestCommitNobodyCanConfirmIsRetriedNotDeadLettered(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	c, h, proxy, jc, its := f.fusedCommit("indoubt", "id-1", "sleep")

	// While the commit waits in the fuse, the network to the database
	// fails: the connection is reset and new ones carry nothing.
	cut := f.cutInFuse(func() {
		proxy.Stall(testenv.Both)
		proxy.Cut()
	})
	w := newWorker(c, nil, 0)
	ctx := context.Background()
	out := c.processItems(ctx, its)
	if !<-cut {
		t.Fatalf("the commit was not seen waiting behind the fuse: %+v", out.res)
	}
	f.waitFor("the commit behind the fuse", 10*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM consumed_message WHERE consumer = 'indoubt'`) == 1
	})
	proxy.Heal()
	w.finishAll(ctx, its, out)
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'indoubt'`); n != 0 {
		reason := ""
		_ = f.pool.QueryRow(ctx, `SELECT reason FROM consumer_dead_letter WHERE consumer = 'indoubt'`).Scan(&reason)
		t.Fatalf("an applied event was dead-lettered after a commit of unknown outcome: %s", reason)
	}
	drive(c, w, f.fetch(c, jc, 1, 10*time.Second)) // the retry
	if !f.acked(jc, its[0].m.StreamSeq) {
		t.Fatalf("the retried message was not acknowledged")
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'indoubt'`); n != 1 {
		t.Fatalf("applied %d times", n)
	}
	if n := h.callCount("id-1"); n != 1 {
		t.Fatalf("the handler ran %d times for an event applied at once", n)
	}
}

// fusedCommit is a consumer name on the database through a proxy, with one
// transient or unknown attempt per message, and the delivery of one event
// id whose commit blows the fuse in mode.
func (f *fixture) fusedCommit(name, id, mode string) (*Consumer, *fusedHandler, *testenv.Proxy, jetstream.Consumer, []*item) {
	f.t.Helper()
	f.fuse()
	pool, proxy := f.proxiedPool()
	h := &fusedHandler{recorder: newRecorder(name), fuses: map[string]string{id: mode}}
	cfg := f.baseConfig(name)
	cfg.AckWait, cfg.HandlerTimeout = 10*time.Second, 4*time.Second // longer than the fuse
	cfg.TransientAttempts, cfg.MaxAttempts = 1, 1
	c, err := New(pool, f.js, cfg, h, WithRegisterer(f.reg))
	testenv.Must(f.t, err, "new consumer")
	f.publish(event{ID: id, AggID: "a", Version: 1})
	jc := f.durable(cfg.Name, 5*time.Second)
	return c, h, proxy, jc, f.fetch(c, jc, 1, 5*time.Second)
}

// cutInFuse runs cut once a commit waits in the fuse's sleep, and reports
// on the channel whether it saw one within 10 s.
func (f *fixture) cutInFuse(cut func()) <-chan bool {
	done := make(chan bool, 1)
	go func() {
		seen := testenv.WaitFor(10*time.Second, func() bool {
			var n int
			err := f.pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
				WHERE wait_event = 'PgSleep' AND datname = current_database()`).Scan(&n)
			return err == nil && n > 0
		})
		if seen {
			cut()
		}
		done <- seen
	}()
	return done
}

// The client loses its connection while the server is still committing
// (the fuse holds the commit for two seconds, through the cancel request
// pgx sends when it loses the connection), and the database is
// reachable at once on a new connection. A read there does not see the
// dedup row yet: answering "not committed" from it charges an attempt of
// an event that is about to be applied, and with one transient attempt
// allowed dead-letters it. The commit probe waits for the old transaction
// and finds it committed.
func TestCommitStillRunningIsNotJudgedAbsent(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	c, _, proxy, jc, its := f.fusedCommit("stillcommitting", "sc-1", "stubborn")
	cut := f.cutInFuse(proxy.Cut) // new connections are served
	ctx := context.Background()
	out := c.processItems(ctx, its)
	if !<-cut {
		t.Fatalf("the commit was not seen waiting behind the fuse: %+v", out.res)
	}
	if out.res[0].kind != resApplied {
		t.Errorf("result %v (%v), want applied: the commit went through", out.res[0].kind, out.res[0].err)
	}
	newWorker(c, nil, 0).finishAll(ctx, its, out)
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'stillcommitting'`); n != 0 {
		t.Fatalf("an event whose commit was still running was dead-lettered")
	}
	if !f.acked(jc, its[0].m.StreamSeq) {
		t.Fatalf("the applied message was not acknowledged")
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'stillcommitting'`); n != 1 {
		t.Fatalf("applied %d times", n)
	}
}
