package failover

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

// cluster is a private primary with one physical standby, a test database
// on it, a private NATS server and a relay configuration whose URL lists
// both servers with target_session_attrs=read-write.
type cluster struct {
	t       *testing.T
	primary *testenv.Postgres
	standby *testenv.Standby
	db      string
	js      jetstream.JetStream
	nc      *nats.Conn
	natsURL string
	cfg     relay.Config
	stream  string
	prefix  string
}

type clusterOptions struct {
	standby      testenv.StandbyOptions
	failoverSlot bool
}

func newCluster(t *testing.T, o clusterOptions) *cluster {
	t.Helper()
	if testing.Short() {
		t.Skip("starts a primary and a standby (skipped with -short)")
	}
	// synchronous_commit on, as in production: an acknowledged commit is in
	// the primary's WAL, and what a failover loses is only what the
	// asynchronous standby had not received (the harness's default, off,
	// would lose the last 200 ms of commits on the primary itself).
	primary, err := testenv.StartPostgres(testenv.WithSetting("wal_sender_timeout", "'10s'"), testenv.WithSetting("synchronous_commit", "on"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(primary.Close)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := testenv.UniqueName("t")
	testenv.Must(t, primary.CreateDatabase(ctx, db), "create database")
	conn, err := pgx.Connect(ctx, primary.URL(db))
	testenv.Must(t, err, "connect")
	seed, err := os.ReadFile(filepath.Join(testenv.RepoRoot(t), "sql", "outbox.sql"))
	testenv.Must(t, err, "read outbox.sql")
	_, err = conn.PgConn().Exec(ctx, string(seed)).ReadAll()
	conn.Close(ctx)
	testenv.Must(t, err, "create the outbox")
	standby, err := primary.StartStandby(o.standby)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(standby.Close)
	ns, err := testenv.StartNATS()
	testenv.Must(t, err, "start nats")
	t.Cleanup(ns.Close)
	nc, err := nats.Connect(ns.URL, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	testenv.Must(t, err, "connect to nats")
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	testenv.Must(t, err, "jetstream")
	name := strings.ToUpper(testenv.UniqueName("F"))
	prefix := strings.ToLower(name)
	c := &cluster{t: t, primary: primary, standby: standby, db: db, js: js, nc: nc, natsURL: ns.URL, stream: name, prefix: prefix}
	c.cfg = relay.Config{
		Replication: replication.Config{
			URL:  c.multiHostURL(),
			Slot: "slot_" + prefix, Publication: "pub_" + prefix,
			Tables: []string{"public.outbox"}, StatusInterval: 100 * time.Millisecond,
			ReceiveTimeout: 3 * time.Second,
			FailoverSlot:   o.failoverSlot,
		},
		Router: router.Config{
			Tables:            []router.TableConfig{{Table: "public.outbox", Subject: prefix + ".{aggregate_type}.{aggregate_id}"}},
			DeadLetterSubject: prefix + "_dlq",
		},
		Publisher:        publisher.Config{AckTimeout: 2 * time.Second},
		Stream:           provision.StreamSpec{Name: name, Subjects: []string{prefix + ".>"}, Duplicates: 2 * time.Minute, AllowBatch: true},
		DeadLetterStream: provision.StreamSpec{Name: name + "_DLQ", Subjects: []string{prefix + "_dlq.>"}, Duplicates: 2 * time.Minute},
		CreateStreams:    true,
		// The relay's defaults (500ms, 30s): the backoff must not delay
		// streaming after a promotion however long the outage was.
	}
	testenv.Must(t, c.cfg.Router.Validate(), "router config")
	return c
}

// multiHostURL lists the primary, then the standby; the relay takes the
// first that accepts a read-write session.
func (c *cluster) multiHostURL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/%s?sslmode=disable&target_session_attrs=read-write",
		c.primary.Port(), c.standby.Port(), c.db)
}

// standbyURL connects to the standby alone (after promotion: the new primary).
func (c *cluster) standbyURL() string { return c.standby.URL(c.db) }

// runningRelay is an in-process relay and when it became ready.
type runningRelay struct {
	done   chan error
	cancel context.CancelFunc
	mu     sync.Mutex
	ready  []time.Time // each time it started streaming
	logs   *observer.ObservedLogs
}

// retryWaits returns the reconnect waits the relay logged after t.
func (r *runningRelay) retryWaits(after time.Time) []time.Duration {
	var out []time.Duration
	for _, e := range r.logs.All() {
		if e.Time.Before(after) || !strings.HasPrefix(e.Message, "replication interrupted") {
			continue
		}
		for _, f := range e.Context {
			if f.Key == "retry_in" {
				out = append(out, time.Duration(f.Integer))
			}
		}
	}
	return out
}

// startRelay runs a relay on c.cfg until the test ends or stop is called.
func (c *cluster) startRelay() *runningRelay {
	c.t.Helper()
	core, logs := observer.New(zapcore.InfoLevel)
	r := &runningRelay{done: make(chan error, 1), logs: logs}
	log := zap.New(zapcore.NewTee(zaptest.NewLogger(c.t).Core(), core)).Named("relay")
	rl, err := relay.New(c.cfg, c.nc, relay.WithLogger(log), relay.WithReadiness(func(ok bool) {
		if ok {
			r.mu.Lock()
			r.ready = append(r.ready, time.Now())
			r.mu.Unlock()
		}
	}))
	testenv.Must(c.t, err, "new relay")
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go func() { r.done <- rl.Run(ctx) }()
	c.t.Cleanup(func() { r.stop() })
	return r
}

// stop cancels the relay and returns its error (nil after a clean stop).
func (r *runningRelay) stop() error {
	r.cancel()
	err, ok := <-r.done
	if ok {
		close(r.done)
	}
	return err
}

// readyAfter returns the first time the relay started streaming after t.
func (r *runningRelay) readyAfter(t time.Time) (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, at := range r.ready {
		if at.After(t) {
			return at, true
		}
	}
	return time.Time{}, false
}

// writeLoad writes events in transactions of 1 and bigTx rows from writers
// goroutines, each owning its aggregates, through pool until total events
// are acknowledged. A transaction that fails (the primary died under it)
// is not retried: its outcome is unknown, and the new primary's table is
// the truth the stream is checked against. Versions are never reused, so
// what a failover loses leaves gaps, never a conflict.
type writeLoad struct {
	total, aggregates, writers, bigTx int
}

type writeStats struct {
	acked  atomic.Int64 // events of acknowledged commits
	failed atomic.Int64 // transactions that failed
	ids    sync.Map     // event id → struct{} of acknowledged commits
}

func (c *cluster) write(ctx context.Context, pool *pgxpool.Pool, l writeLoad) (*writeStats, func()) {
	st := &writeStats{}
	var wg sync.WaitGroup
	prefix := uuid.NewString()[:8]
	for w := 0; w < l.writers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 11))
			versions := map[string]int64{}
			var aggs []string
			for a := w; a < l.aggregates; a += l.writers {
				aggs = append(aggs, fmt.Sprintf("%s-agg-%d", prefix, a))
			}
			for txi := 0; st.acked.Load() < int64(l.total) && ctx.Err() == nil; txi++ {
				size := 1
				if txi%2 == 1 {
					size = l.bigTx
				}
				batch := &pgx.Batch{}
				ids := make([]string, 0, size)
				for i := 0; i < size; i++ {
					agg := aggs[rng.IntN(len(aggs))]
					versions[agg]++
					id := uuid.NewString()
					ids = append(ids, id)
					batch.Queue(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ($1, 'order', $2, $3, 'OrderPlaced', $4)`,
						id, agg, versions[agg], fmt.Sprintf(`{"aggregate": %q, "n": %d}`, agg, versions[agg]))
				}
				tctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				err := pgx.BeginFunc(tctx, pool, func(tx pgx.Tx) error { return tx.SendBatch(tctx, batch).Close() })
				cancel()
				if err != nil {
					st.failed.Add(1)
					// The primary is down or not yet replaced: the pool
					// reconnects on the next attempt; pace the attempts.
					select {
					case <-ctx.Done():
					case <-time.After(50 * time.Millisecond):
					}
					continue
				}
				for _, id := range ids {
					st.ids.Store(id, struct{}{})
				}
				st.acked.Add(int64(size))
			}
		}(w)
	}
	return st, wg.Wait
}

// pool opens a pool on url for the test's writers.
func (c *cluster) pool(ctx context.Context, url string) *pgxpool.Pool {
	c.t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	testenv.Must(c.t, err, "parse %s", url)
	cfg.MaxConns = 8
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	testenv.Must(c.t, err, "pool")
	c.t.Cleanup(pool.Close)
	return pool
}

// rows returns the outbox rows of the server at url in commit order
// (aggregate versions ascend in it), with payloads as stored.
func (c *cluster) rows(ctx context.Context, url string) []relaytest.Event {
	c.t.Helper()
	conn, err := pgx.Connect(ctx, url)
	testenv.Must(c.t, err, "connect to %s", url)
	defer conn.Close(ctx)
	rs, err := conn.Query(ctx, "SELECT event_id::text, aggregate_id, aggregate_version, payload::text FROM outbox ORDER BY aggregate_id, aggregate_version")
	testenv.Must(c.t, err, "read the outbox")
	var out []relaytest.Event
	for rs.Next() {
		var e relaytest.Event
		testenv.Must(c.t, rs.Scan(&e.ID, &e.Aggregate, &e.Version, &e.Payload), "scan")
		out = append(out, e)
	}
	testenv.Must(c.t, rs.Err(), "read the outbox")
	return out
}

// waitStream waits until the stream holds at least n messages.
func (c *cluster) waitStream(ctx context.Context, n int, timeout time.Duration) {
	c.t.Helper()
	var got uint64
	if !testenv.WaitFor(timeout, func() bool {
		got = relaytest.StreamCount(ctx, c.js, c.stream)
		return got >= uint64(n)
	}) {
		c.t.Fatalf("stream %s holds %d messages after %s, want %d", c.stream, got, timeout, n)
	}
}

// lsnSampler samples a server's confirmed_flush_lsn of the slot, then the
// stream's last sequence, every 100 ms. Afterwards every event committed
// at or below a sampled confirmed position must have been stored at or
// before that sample's sequence: the slot never passed an event that was
// not stored.
type lsnSampler struct {
	mu      sync.Mutex
	samples []lsnSample
	stop    func() error
}

type lsnSample struct {
	confirmed replication.LSN
	lastSeq   uint64
}

func (c *cluster) sampleSlot(url string) *lsnSampler {
	s := &lsnSampler{}
	s.stop = testenv.Background(context.Background(), c.t, func(ctx context.Context) error {
		for {
			// pg_replication_slots alone: a standby in recovery answers it.
			var confirmed string
			err := queryRow(ctx, url, "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1 AND confirmed_flush_lsn IS NOT NULL", []any{c.cfg.Replication.Slot}, &confirmed)
			if lsn, perr := replication.ParseLSN(confirmed); err == nil && perr == nil {
				if str, err := c.js.Stream(ctx, c.stream); err == nil {
					if info, err := str.Info(ctx); err == nil {
						s.mu.Lock()
						s.samples = append(s.samples, lsnSample{lsn, info.State.LastSeq})
						s.mu.Unlock()
					}
				}
			}
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(100 * time.Millisecond):
			}
		}
	})
	return s
}

// violations counts samples whose confirmed position covers an event stored
// after the sample; got must be the whole stream.
func (s *lsnSampler) violations(t *testing.T, got []relaytest.Received) (bad, samples int) {
	t.Helper()
	_ = s.stop()
	s.mu.Lock()
	defer s.mu.Unlock()
	type stored struct {
		lsn replication.LSN
		seq uint64
	}
	var msgs []stored
	for _, m := range got {
		if m.Event.CommitLSN == "" {
			continue // a repaired event has no commit LSN
		}
		lsn, err := replication.ParseLSN(m.Event.CommitLSN)
		if err != nil {
			t.Fatalf("message %d: commit LSN %q: %v", m.Seq, m.Event.CommitLSN, err)
		}
		msgs = append(msgs, stored{lsn, m.Seq})
	}
	for _, sm := range s.samples {
		for _, m := range msgs {
			if m.lsn <= sm.confirmed && m.seq > sm.lastSeq {
				bad++
				t.Errorf("slot confirmed %s while the event committed at %s was stored later (seq %d > %d)", sm.confirmed, m.lsn, m.seq, sm.lastSeq)
				break
			}
		}
	}
	return bad, len(s.samples)
}

// check compares the stream with the rows of the new primary: nothing
// missing, no duplicate, order per aggregate, same bytes, and no event the
// table does not hold (no phantom).
func check(t *testing.T, rows []relaytest.Event, got []relaytest.Received) relaytest.Report {
	t.Helper()
	rep := relaytest.Check(rows, got)
	if !rep.OK() {
		t.Errorf("stream against the new primary's outbox: %s", rep)
	}
	return rep
}

// queryRow runs one query on a fresh connection to url.
func queryRow(ctx context.Context, url, sql string, args []any, dest ...any) error {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(qctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.QueryRow(qctx, sql, args...).Scan(dest...)
}
