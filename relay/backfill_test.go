package relay_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
)

// insertVersions inserts versions from..to of one aggregate in one
// transaction.
func (f *fixture) insertVersions(ctx context.Context, agg string, from, to int) {
	f.T.Helper()
	if _, err := f.DB.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload)
		SELECT gen_random_uuid(), 'registration', $1, g, 'T', '{}' FROM generate_series($2::int, $3::int) g`, agg, from, to); err != nil {
		f.T.Fatal(err)
	}
}

// backfillAsync runs a backfill until ctx ends; wait returns its error.
func (f *fixture) backfillAsync(ctx context.Context) (wait func() error) {
	done := make(chan error, 1)
	go func() {
		_, err := relay.Backfill(ctx, f.Cfg, f.NC, zaptest.NewLogger(f.T).Named("backfill"), nil)
		done <- err
	}()
	return func() error { return <-done }
}

// versionsInOrder checks that the stream holds versions 1..n of agg, each
// once, in order.
func (f *fixture) versionsInOrder(ctx context.Context, agg string, n int) {
	f.T.Helper()
	var got []int64
	for _, m := range relaytest.ReadStream(ctx, f.T, f.JS, f.Stream) {
		if m.Event.AggregateID == agg {
			got = append(got, m.Event.AggregateVersion)
		}
	}
	for i, v := range got {
		if v != int64(i+1) {
			f.T.Fatalf("aggregate %s: stream position %d holds version %d (%d stored, want 1..%d in order)", agg, i, v, len(got), n)
		}
	}
	if len(got) != n {
		f.T.Fatalf("aggregate %s: %d versions stored, want %d", agg, len(got), n)
	}
}

// Regression (issue 16, case 3): a backfill cancelled half-way left a slot
// that the next backfill took as done and `run` streamed from, so the rest
// of the snapshot was never published (305 written, 224 received). Now
// `run` refuses the slot with the fix, and the next backfill starts again
// from a new snapshot.
func TestBackfillInterrupted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.Cfg.Publisher.MaxInFlight = 1 // slow enough to stop half-way
	const before = 3000
	f.insertVersions(ctx, "agg", 1, before)
	bctx, cancel := context.WithCancel(ctx)
	wait := f.backfillAsync(bctx)
	f.WaitCount(ctx, f.Stream, 50, 30*time.Second)
	cancel()
	if err := wait(); err == nil {
		t.Fatal("the cancelled backfill reported success")
	}

	rl, err := relay.New(f.Cfg, f.NC, relay.WithLogger(zaptest.NewLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	rctx, rcancel := context.WithTimeout(ctx, 30*time.Second)
	defer rcancel()
	if err := rl.Run(rctx); !errors.Is(err, replication.ErrBackfillIncomplete) || !replication.IsPermanent(err) {
		t.Fatalf("run after an interrupted backfill: %v, want ErrBackfillIncomplete", err)
	}
	if !rl.BackfillIncomplete() {
		t.Fatal("BackfillIncomplete not reported")
	}
	if st, err := replication.ReadBackfillState(ctx, f.Cfg.Replication); err != nil || !st.Incomplete() {
		t.Fatalf("backfill state %+v, %v", st, err)
	}

	f.insertVersions(ctx, "agg", before+1, before+5)
	f.Cfg.Publisher.MaxInFlight = 0
	rep, err := relay.Backfill(ctx, f.Cfg, f.NC, zaptest.NewLogger(t), nil)
	// What the interrupted attempt stored is skipped (issue 17, case 3).
	if err != nil || !rep.SlotCreated || rep.Rows+rep.AlreadyStreamed != before+5 || rep.AlreadyStreamed == 0 {
		t.Fatalf("backfill again: %+v, %v", rep, err)
	}
	f.start(ctx)
	f.insertVersions(ctx, "agg", before+6, before+10)
	f.WaitCount(ctx, f.Stream, before+10, 30*time.Second)
	f.versionsInOrder(ctx, "agg", before+10)
	if st, err := replication.ReadBackfillState(ctx, f.Cfg.Replication); err != nil || !st.Known || !st.Finished {
		t.Fatalf("backfill state %+v, %v", st, err)
	}
}

// Regression (issue 16, case 4): on the first deploy of an HA pair the
// walsender let go of the new slot while the active instance was still
// publishing its snapshot; the second instance streamed the later
// versions and stored them ahead of the backfill's. It now waits for the
// backfill lock.
func TestBackfillHoldsStandbyBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.Cfg.Publisher.MaxInFlight = 1 // one aggregate, one message at a time
	const before = 10000
	f.insertVersions(ctx, "hot", 1, before)
	wait := f.backfillAsync(ctx)
	f.WaitCount(ctx, f.Stream, 20, 30*time.Second)
	if !testenv.WaitFor(10*time.Second, func() bool { return f.slot(ctx).Exists }) {
		t.Fatal("no slot")
	}
	f.insertVersions(ctx, "hot", before+1, before+10)
	f.start(ctx) // the standby: streams once the backfill is done
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	f.WaitCount(ctx, f.Stream, before+10, 60*time.Second)
	f.versionsInOrder(ctx, "hot", before+10)
}

// Regression (issue 25): a backfilled row without a usable event id got
// the dead-letter id of its position in the read order. A re-run reads a
// new snapshot: a row inserted in between shifted every position, and its
// record was dropped as a duplicate of another row's. Ids now come from
// the row's values, whatever the read order.
func TestBackfillDeadLetterIDsSurviveRerun(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.relayTable(ctx, "loose_outbox", "id bigserial, event_id text, aggregate_id text, aggregate_version bigint, event_type text, payload jsonb")
	insert := func(agg string, n int) {
		t.Helper()
		if _, err := f.DB.Pool.Exec(ctx, `INSERT INTO loose_outbox (aggregate_id, aggregate_version, event_type, payload)
			SELECT $1 || '-' || lpad(g::text, 3, '0'), 1, 'T', '{}' FROM generate_series(1, $2::int) g`, agg, n); err != nil {
			t.Fatal(err)
		}
	}
	backfill := func() {
		t.Helper()
		if _, err := relay.Backfill(ctx, f.Cfg, f.NC, zaptest.NewLogger(t).Named("backfill"), nil); err != nil {
			t.Fatal(err)
		}
	}
	insert("b", 200)
	backfill()
	f.WaitCount(ctx, f.DLQ, 200, 30*time.Second)
	if _, err := replication.DropSlot(ctx, f.Cfg.Replication); err != nil {
		t.Fatal(err)
	}
	insert("a", 1) // first in (aggregate id, version) order: every position shifts
	backfill()
	var found bool
	dl := relaytest.ReadStream(ctx, t, f.JS, f.DLQ)
	for _, m := range dl {
		found = found || strings.Contains(string(m.Data), `"a-001"`)
	}
	if len(dl) != 201 || !found {
		t.Fatalf("%d dead-letter records (the new row's among them: %v), want 201 with it", len(dl), found)
	}
}
