package consumer

import (
	"context"
	"fmt"
	"net"
	"sync/atomic"
	"testing"
	"time"

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
	var writes atomic.Int64
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
		return &writeCounter{Conn: conn, n: &writes}, nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	testenv.Must(t, err, "open the counting pool")
	t.Cleanup(pool.Close)

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
