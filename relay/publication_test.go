package relay_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
)

// Regression (issue 16, case 6): with a slot made by hand and a publication
// without the outbox, run reported ready and the slot confirmed past every
// insert. Run refuses such a publication naming the ALTER PUBLICATION, and
// a publication broken while streaming makes the relay not ready until it
// is fixed.
func TestRelayChecksPublication(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	pub := `"` + f.Cfg.Replication.Publication + `"`
	exec := sqlExec(t, ctx, f.DB.Pool)
	exec(`CREATE TABLE other (id int)`)
	exec(`CREATE PUBLICATION ` + pub + ` FOR TABLE other WITH (publish = 'insert')`)
	exec(`SELECT pg_create_logical_replication_slot('` + f.Cfg.Replication.Slot + `', 'pgoutput')`)

	rl, err := relay.New(f.Cfg, f.NC, relay.WithLogger(zaptest.NewLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err = rl.Run(rctx)
	fix := `ALTER PUBLICATION ` + pub + ` ADD TABLE "public"."outbox"`
	if !errors.Is(err, replication.ErrPublicationMismatch) || !strings.Contains(err.Error(), fix) {
		t.Fatalf("run: %v, want a refusal naming %s", err, fix)
	}
	exec(fix)

	f.Cfg.PublicationCheck = 100 * time.Millisecond
	var ready atomic.Bool
	rl, _ = f.Start(ctx, relay.WithReadiness(ready.Store))
	if !testenv.WaitFor(30*time.Second, ready.Load) {
		t.Fatal("never ready with the right publication")
	}
	// Broken while streaming: not ready, then ready again once fixed.
	exec(`ALTER PUBLICATION ` + pub + ` SET (publish = 'insert, update, delete')`)
	if !testenv.WaitFor(10*time.Second, func() bool { return !ready.Load() }) {
		t.Fatal("still ready with a publication that publishes updates")
	}
	if p := rl.PublicationProblem(); !errors.Is(p, replication.ErrPublicationMismatch) || !strings.Contains(p.Error(), `SET (publish = 'insert')`) {
		t.Fatalf("problem %v", p)
	}
	exec(`ALTER PUBLICATION ` + pub + ` SET (publish = 'insert')`)
	if !testenv.WaitFor(10*time.Second, ready.Load) || rl.PublicationProblem() != nil {
		t.Fatalf("not ready after the fix: %v", rl.PublicationProblem())
	}
	exec(`INSERT INTO outbox (event_id, aggregate_id, aggregate_version, event_type, payload) VALUES (gen_random_uuid(), 'a', 1, 'T', '{}')`)
	f.WaitCount(ctx, f.Stream, 1, 30*time.Second)
}
