package consumer

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// overrunOnce overruns HandlerTimeout in Go on the first call, with no
// statement in flight, after writing through tx (so the transaction holds
// locks), and records the backend it ran on.
type overrunOnce struct {
	calls atomic.Int32
	pid   atomic.Uint32
	wait  time.Duration
}

func (h *overrunOnce) Handle(ctx context.Context, tx pgx.Tx, m *Message) error {
	if h.calls.Add(1) > 1 {
		return nil
	}
	h.pid.Store(tx.Conn().PgConn().PID())
	select {
	case <-ctx.Done():
	case <-time.After(h.wait):
	}
	return nil
}

// A transaction whose attempt overran its deadline in Go is rolled back,
// not dropped with its connection: the ROLLBACK is sent on a context of
// its own, so its locks (the dedup row) are released before the retry and
// the connection stays in the pool. On the expired ctx the ROLLBACK was
// never sent and pgx closed the connection, leaving the server to find out
// (on a loaded machine, after the retry had waited past its deadline).
func TestOverrunRollsBackOnItsConnection(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{1, 8} {
		t.Run(map[int]string{1: "alone", 8: "batch"}[batch], func(t *testing.T) {
			t.Parallel()
			f := newFixture(t)
			h := &overrunOnce{wait: 2 * time.Second}
			name := map[int]string{1: "overrunalone", 8: "overrunbatch"}[batch]
			cfg := f.baseConfig(name)
			cfg.Workers, cfg.BatchSize = 1, batch
			cfg.HandlerTimeout = 300 * time.Millisecond
			f.start(cfg, h)
			f.publish(event{ID: uuidN(1), AggID: "a", Version: 1})
			f.waitSettled(name, 30*time.Second)
			if n := queryInt(t, f.pool, `SELECT count(*) FROM consumed_message WHERE consumer = $1`, name); n != 1 {
				t.Fatalf("%d dedup rows, want 1", n)
			}
			pid := h.pid.Load()
			if pid == 0 {
				t.Fatal("the handler never ran")
			}
			// The overrun attempt's backend lives on as an idle pooled
			// connection; dropped, it would exit within milliseconds.
			if gone := testenv.WaitFor(2*time.Second, func() bool {
				return queryInt(t, f.pool, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid) == 0
			}); gone {
				t.Fatalf("the backend %d of the overrun attempt exited: its connection was dropped instead of rolled back", pid)
			}
		})
	}
}
