package consumer

import (
	"context"
	"fmt"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestRoundTripsPerMessage: with a *pgxpool.Pool, a message alone in its
// transaction and a handler of one statement cost three round trips to
// PostgreSQL: BEGIN with the dedup INSERT, the handler's statement,
// COMMIT. The old step sent BEGIN on its own: four. The pool's connections
// count their writes, one per round trip, over messages applied after a
// warm-up (prepared statements cached, connections open).
func TestRoundTripsPerMessage(t *testing.T) {
	f := newFixture(t)
	pool, writes := countingPool(t, f)

	cfg := f.baseConfig("trips")
	cfg.Workers, cfg.BatchSize = 1, 1
	cfg.ReplayPollInterval, cfg.StatsInterval = time.Hour, time.Hour // no other traffic
	counted := *f                                                    // the same fixture, but the consumer's pool counts
	counted.pool = pool
	counted.start(cfg, newRecorder(cfg.Name))

	publish := func(from, n int) {
		for i := from; i < from+n; i++ {
			f.publish(event{ID: uuidN(i), AggID: fmt.Sprintf("agg-%d", i), Version: 1})
		}
		f.waitFor(fmt.Sprintf("%d events applied", from+n), time.Minute, func() bool {
			return queryInt(t, f.pool, `SELECT count(*) FROM applied`) == int64(from+n)
		})
		f.waitSettled(cfg.Name, time.Minute)
	}
	const warm, n = 30, 200
	publish(0, warm)
	before := writes.Load()
	publish(warm, n)
	perMessage := float64(writes.Load()-before) / n
	t.Logf("%.2f round trips per message", perMessage)
	if perMessage > 3.05 {
		t.Errorf("%.2f round trips per message, want 3 (BEGIN with the dedup INSERT, the handler's, COMMIT)", perMessage)
	}
}

// countingPool is a pool to the fixture's database whose connections
// count their writes in writes.
func countingPool(t *testing.T, f *fixture) (*pgxpool.Pool, *atomic.Int64) {
	writes := new(atomic.Int64)
	pcfg, err := pgxpool.ParseConfig(f.db.URL)
	testenv.Must(t, err, "parse pool config")
	pcfg.MaxConns = 2
	pcfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	pcfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		var d net.Dialer
		conn, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &writeCounter{Conn: conn, n: writes}, nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	testenv.Must(t, err, "open the counting pool")
	t.Cleanup(pool.Close)
	return pool, writes
}

// TestRoundTripsPerBatch: a batch's transaction costs the same three round
// trips as a message alone with a handler of one statement (HandleBatch's):
// BEGIN with the batch's dedup INSERT, the handler's statement, COMMIT.
// BEGIN sent on its own made it four. In each round a gate holds the
// transaction of the round's first message until all of the round's
// messages are published, so the rest queue behind it and go in batches;
// the first round warms the connections and their statement caches.
func TestRoundTripsPerBatch(t *testing.T) {
	f := newFixture(t)
	pool, writes := countingPool(t, f)
	cfg := f.baseConfig("batchtrips")
	cfg.Workers, cfg.BatchSize = 1, 64
	cfg.ReplayPollInterval, cfg.StatsInterval = time.Hour, time.Hour // no other traffic
	const warm, n = 200, 400
	h := &gatedSetHandler{setHandler: setHandler{recorder: newRecorder(cfg.Name)},
		gates: map[string]chan struct{}{uuidN(0): make(chan struct{}), uuidN(warm): make(chan struct{})}}
	counted := *f // the same fixture, but the consumer's pool counts
	counted.pool = pool
	counted.start(cfg, h)

	round := func(from, n int) {
		for i := from; i < from+n; i++ {
			f.publish(event{ID: uuidN(i), AggID: fmt.Sprintf("agg-%d", i), Version: 1})
		}
		close(h.gates[uuidN(from)])
		f.waitFor(fmt.Sprintf("%d events applied", from+n), time.Minute, func() bool {
			return queryInt(t, f.pool, `SELECT count(*) FROM applied`) == int64(from+n)
		})
		f.waitSettled(cfg.Name, time.Minute)
	}
	round(0, warm)
	before, txsBefore, batchesBefore := writes.Load(), h.txs.Load(), h.batches.Load()
	round(warm, n)
	trips, txs, batches := writes.Load()-before, h.txs.Load()-txsBefore, h.batches.Load()-batchesBefore
	t.Logf("%d round trips for %d transactions (%d of them batches) of %d messages", trips, txs, batches, n)
	// The slack is for a statement prepared on a connection the warm-up
	// did not use; each batch with BEGIN alone costs one more than it.
	const slack = 4
	if batches <= slack {
		t.Fatalf("%d batches: the gate should have made more than %d", batches, slack)
	}
	if trips > 3*txs+slack {
		t.Errorf("%d round trips for %d transactions, want at most 3 each (BEGIN with the dedup INSERT, the handler's, COMMIT)", trips, txs)
	}
}

// gatedSetHandler is a setHandler that counts its transactions, and whose
// transaction with a message of gates waits until that gate is closed.
type gatedSetHandler struct {
	setHandler
	gates map[string]chan struct{} // by event id; read-only once running
	txs   atomic.Int64
}

func (h *gatedSetHandler) wait(ctx context.Context, ms ...*Message) error {
	for _, m := range ms {
		if gate, ok := h.gates[m.ID]; ok {
			select {
			case <-gate:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	}
	return nil
}

func (h *gatedSetHandler) Handle(ctx context.Context, tx pgx.Tx, m *Message) error {
	h.txs.Add(1)
	if err := h.wait(ctx, m); err != nil {
		return err
	}
	return h.setHandler.Handle(ctx, tx, m)
}

func (h *gatedSetHandler) HandleBatch(ctx context.Context, tx pgx.Tx, ms []*Message) error {
	h.txs.Add(1)
	if err := h.wait(ctx, ms...); err != nil {
		return err
	}
	return h.setHandler.HandleBatch(ctx, tx, ms)
}

// writeCounter counts the writes on a connection to PostgreSQL: pgx sends
// each round trip's messages in one write.
type writeCounter struct {
	net.Conn
	n *atomic.Int64
}

func (w *writeCounter) Write(b []byte) (int, error) {
	w.n.Add(1)
	return w.Conn.Write(b)
}
