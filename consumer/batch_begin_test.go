package consumer

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// poolOnlyDB is a pool seen through the DB interface alone: not a
// *pgxpool.Pool, so a transaction is begun with Begin and its dedup
// statement sent after it (the path of any other DB implementation).
type poolOnlyDB struct{ *pgxpool.Pool }

// A batch whose dedup statement waits for a row held by another open
// transaction, on a consumer whose pool has one connection. With a
// *pgxpool.Pool the batch's BEGIN and its dedup statement go in one round
// trip (beginBatch), so it is BEGIN's answer that does not come before
// HandlerTimeout; with any other DB it is the dedup statement's. Either
// way the batch ends broken and overran, every message goes back to be
// taken one at a time, nothing of it is applied, and the pool's one
// connection is given back: the next batch (the holder gone) gets a
// connection and commits, with a duplicate inside it, a handler's
// rejection (redone with the dedup statement that records outcomes) and
// an aggregate's two versions applied once each, in order.
func TestBatchBeginBlockedGivesTheConnectionBack(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		pipeline bool
	}{{"pool, BEGIN with the dedup statement", true}, {"other DB, BEGIN alone", false}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t)
			name := "blockedbegin"
			pcfg, err := pgxpool.ParseConfig(f.db.URL)
			testenv.Must(t, err, "parse pool config")
			pcfg.MaxConns = 1
			pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
			testenv.Must(t, err, "open a pool of one connection")
			t.Cleanup(func() {
				// Close waits for every connection to be given back: a
				// leaked one would hang the test instead of failing it.
				closed := make(chan struct{})
				go func() { pool.Close(); close(closed) }()
				select {
				case <-closed:
				case <-time.After(10 * time.Second):
					t.Error("the pool did not close in 10 s: a connection was never given back")
				}
			})
			var db DB = pool
			if !tc.pipeline {
				db = poolOnlyDB{pool}
			}
			r := newRecorder(name)
			r.fail = func(m *Message, _ int) error {
				if m.ID == "bb-b-1" {
					return Reject("no such account")
				}
				return nil
			}
			cfg := f.baseConfig(name)
			cfg.HandlerTimeout = 2 * time.Second
			c, err := New(db, f.js, cfg, r, WithLogger(zaptest.NewLogger(t)), WithRegisterer(f.reg))
			testenv.Must(t, err, "new consumer")
			ctx := context.Background()

			a1, a2 := event{ID: "bb-a-1", AggID: "a", Version: 1}, event{ID: "bb-a-2", AggID: "a", Version: 2}
			holder, err := openZombie(ctx, f.db.URL, name, a2.ID) // an open transaction holding a2's dedup row
			testenv.Must(t, err, "hold a dedup row")
			t.Cleanup(func() { holder.Close(context.Background()) })

			out := c.processBatch(ctx, f.items(c, a1, a2, event{ID: "bb-c-1", AggID: "c", Version: 1}))
			if want := []resultKind{resRequeue, resRequeue, resRequeue}; fmt.Sprint(kinds(out.res)) != fmt.Sprint(want) || !out.solo || !out.overran {
				t.Fatalf("blocked batch: results %v solo %v overran %v, want %v, solo and overran", kinds(out.res), out.solo, out.overran, want)
			}
			if !testenv.WaitFor(10*time.Second, func() bool { return pool.Stat().AcquiredConns() == 0 }) {
				t.Fatalf("%d connections still acquired after the blocked batch ended", pool.Stat().AcquiredConns())
			}
			if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = $1`, name); n != 0 {
				t.Fatalf("%d effects of the blocked batch", n)
			}

			// The holder goes, and with it the wait of the broken
			// connection's backend (the server ends it once it can answer).
			_, err = holder.Exec(ctx, `ROLLBACK`)
			testenv.Must(t, err, "release the dedup row")
			if !testenv.WaitFor(10*time.Second, func() bool {
				return queryInt(t, f.pool, `SELECT count(*) FROM pg_stat_activity
					WHERE datname = current_database() AND (wait_event_type = 'Lock' OR state = 'idle in transaction')`) == 0
			}) {
				t.Fatalf("a backend still waits for a lock or idles in a transaction")
			}

			evs := []event{a1, a2, a1, {ID: "bb-b-1", AggID: "b", Version: 1}, {ID: "bb-c-1", AggID: "c", Version: 1}}
			out = c.processBatch(ctx, f.items(c, evs...))
			want := []resultKind{resApplied, resApplied, resDuplicate, resRejected, resApplied}
			if got := kinds(out.res); fmt.Sprint(got) != fmt.Sprint(want) || out.solo {
				var errs []error
				for _, r := range out.res {
					errs = append(errs, r.err)
				}
				t.Fatalf("batch after the holder went: results %v solo %v (%v), want %v in one batch", got, out.solo, errors.Join(errs...), want)
			}
			if got := queryStrings(t, f.pool, `SELECT event_id FROM applied WHERE consumer = $1 ORDER BY n`, name); got != "bb-a-1 bb-a-2 bb-c-1" {
				t.Errorf("effects %q, want bb-a-1 bb-a-2 bb-c-1 (once each, a in version order, none for the rejection)", got)
			}
			if got := queryStrings(t, f.pool, `SELECT event_id || ':' || outcome FROM consumed_message WHERE consumer = $1 ORDER BY 1`, name); got != "bb-a-1:applied bb-a-2:applied bb-b-1:rejected bb-c-1:applied" {
				t.Errorf("dedup rows %s", got)
			}
			if n := pool.Stat().AcquiredConns(); n != 0 {
				t.Errorf("%d connections acquired after the batch committed", n)
			}
		})
	}
}

// stallingBatchHandler is a setHandler whose first HandleBatch reports its
// batch's size on entered and waits for gate before its statement.
type stallingBatchHandler struct {
	setHandler
	entered chan int
	gate    chan struct{}
	first   atomic.Bool
}

func (h *stallingBatchHandler) HandleBatch(ctx context.Context, tx pgx.Tx, ms []*Message) error {
	if h.first.CompareAndSwap(false, true) {
		h.entered <- len(ms)
		select {
		case <-h.gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return h.setHandler.HandleBatch(ctx, tx, ms)
}

// PostgreSQL stops (fast: every backend ends) while a batch transaction,
// begun with its dedup statement in one round trip, waits in HandleBatch,
// and starts again once attempts have failed for it: the batch's effects
// and dedup rows were never committed, its messages and the rest are
// retried as transient, never dead-lettered, and every event is applied
// once, each aggregate's in version order.
func TestBatchDatabaseRestartedMidBatchAppliesOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("fault test")
	}
	t.Parallel()
	f, pg := privateFixture(t)
	name := "restartbatch"
	cfg := f.baseConfig(name)
	cfg.Workers, cfg.BatchSize = 1, 32
	cfg.RetryMax, cfg.HandlerTimeout = 500*time.Millisecond, 3*time.Second
	h := &stallingBatchHandler{setHandler: setHandler{recorder: newRecorder(name)}, entered: make(chan int, 1), gate: make(chan struct{})}
	const aggs, versions = 4, 10
	var evs []event
	for v := 1; v <= versions; v++ {
		for a := range aggs {
			evs = append(evs, event{ID: uuidN(len(evs)), AggID: fmt.Sprintf("r%d", a), Version: int64(v)})
		}
	}
	f.publish(evs...) // queued before the run starts: batches from the first take
	f.start(cfg, h)
	select {
	case n := <-h.entered:
		t.Logf("a batch of %d waits in HandleBatch", n)
	case <-time.After(30 * time.Second):
		t.Fatal("no batch reached HandleBatch in 30 s")
	}
	testenv.Must(t, pg.Stop("fast"), "stop postgres")
	close(h.gate)
	vec := mustVec(t, f)
	f.waitFor("transient retries while the database is down", 20*time.Second, func() bool {
		return metricValue(t, vec.retries.WithLabelValues(name, "transient")) >= 1
	})
	testenv.Must(t, pg.Start(), "start postgres")
	f.waitFor("every event applied", 60*time.Second, func() bool {
		return queryIntOK(f, `SELECT count(DISTINCT event_id) FROM applied WHERE consumer = $1`, name) == int64(len(evs))
	})
	f.waitSettled(name, 30*time.Second)
	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = $1`, name); n != int64(len(evs)) {
		t.Errorf("%d effects of %d events, want one each", n, len(evs))
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumed_message WHERE consumer = $1`, name); n != int64(len(evs)) {
		t.Errorf("%d dedup rows of %d events", n, len(evs))
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter`); n != 0 {
		t.Errorf("%d dead letters: a database restart must not dead-letter", n)
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM (SELECT version < lag(version) OVER (PARTITION BY aggregate_id ORDER BY n) AS back
		FROM applied WHERE consumer = $1) s WHERE back`, name); n != 0 {
		t.Errorf("%d effects applied before an earlier version of their aggregate", n)
	}
}

// queryStrings is the one text column of sql's rows, joined by spaces.
func queryStrings(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) string {
	t.Helper()
	rows, err := pool.Query(context.Background(), sql, args...)
	testenv.Must(t, err, "query")
	var out []string
	for rows.Next() {
		var s string
		testenv.Must(t, rows.Scan(&s), "scan")
		out = append(out, s)
	}
	testenv.Must(t, rows.Err(), "rows")
	return strings.Join(out, " ")
}
