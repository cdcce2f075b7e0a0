package consumer

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// cancelAt is the fixture's database, except that a query containing at
// cancels the run's context first, as a shutdown arriving at that moment.
type cancelAt struct {
	DB
	at     string
	cancel context.CancelFunc
}

func (d *cancelAt) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if strings.Contains(sql, d.at) {
		d.cancel()
	}
	return d.DB.QueryRow(ctx, sql, args...)
}

// A shutdown during the set-up (here while the consumer reads its
// identity for the durable's metadata) is not a clean stop: nothing was
// consumed and the durable may not exist, so Run says so with ctx's error
// instead of returning nil.
func TestRunCancelledDuringSetUp(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	for _, tc := range []struct {
		name  string
		group bool
	}{{"durable", false}, {"group member", true}} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := f.baseConfig("setup-cancel")
			if tc.group {
				cfg.Name = "setup-cancel-group"
				cfg.Group = &GroupConfig{Partitions: 2}
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			db := &cancelAt{DB: f.pool, at: "current_database()", cancel: cancel}
			c, err := New(db, f.js, cfg, newRecorder(cfg.Name), WithRegisterer(f.reg))
			testenv.Must(t, err, "new consumer")
			runCancelled(t, ctx, c)
		})
	}
}
