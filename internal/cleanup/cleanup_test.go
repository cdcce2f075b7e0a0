package cleanup_test

import (
	"context"
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/cleanup"
	"github.com/outbox-relay/outbox-relay/internal/opstest"
	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

func remainingIDs(t *testing.T, f *opstest.Fixture) map[string]bool {
	t.Helper()
	rows, err := f.DB.Pool.Query(context.Background(), "SELECT event_id::text FROM outbox")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]bool{}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		out[id] = true
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// Acceptance 4: cleanup running again and again while writers insert,
// while the relay runs and while it is stopped, and after events were
// deleted from the stream, never removes a row whose event is not in the
// stream.
func TestCleanupUnderLoadNeverRemovesUnpublishedRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := opstest.New(t, "", 0)
	f.Setup(ctx)
	_, stop := f.Start(ctx)
	w := f.NewWriter(40)

	// Phase A: published, then some of its events lost from the stream.
	written := w.Write(ctx, 600, 10)
	f.WaitCount(ctx, f.Stream, 600, 30*time.Second)
	lost := map[string]bool{}
	for i := 5; i < len(written); i += 50 {
		lost[written[i].ID] = true
	}
	if n := f.DeleteFromStream(ctx, lost); n != len(lost) {
		t.Fatalf("deleted %d of %d", n, len(lost))
	}

	// Cleanup loops from now on, with every row old enough.
	cctx, stopCleanup := context.WithCancel(ctx)
	var runs, deleted atomic.Int64
	cerr := make(chan error, 1)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for cctx.Err() == nil {
			rep, err := cleanup.Run(cctx, f.DB.Pool, f.JS, cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, BatchSize: 50})
			if err != nil {
				if cctx.Err() == nil {
					cerr <- err
				}
				return
			}
			runs.Add(1)
			deleted.Add(rep.Tables[0].Deleted)
		}
	}()

	// Phase B: writes while the relay publishes; phase C: while it is
	// stopped, so these rows stay unpublished.
	written = append(written, w.Write(ctx, 600, 5)...)
	f.WaitCount(ctx, f.Stream, uint64(1200-len(lost)), 30*time.Second)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	unpublished := w.Write(ctx, 300, 5)
	written = append(written, unpublished...)
	// Let cleanup run over the final state a few more times.
	seen := runs.Load()
	if !testenv.WaitFor(20*time.Second, func() bool { return runs.Load() >= seen+3 || len(cerr) > 0 }) {
		t.Fatal("cleanup does not finish its runs")
	}
	stopCleanup()
	wg.Wait()
	select {
	case err := <-cerr:
		t.Fatalf("cleanup: %v", err)
	default:
	}

	inStream := f.StreamIDs(ctx)
	left := remainingIDs(t, f)
	removed := 0
	for _, e := range written {
		if left[e.ID] {
			continue
		}
		removed++
		if inStream[e.ID] == 0 {
			t.Errorf("row of event %s (aggregate %s v%d) was deleted but its event is not in the stream", e.ID, e.Aggregate, e.Version)
		}
	}
	for id := range lost {
		if !left[id] {
			t.Errorf("row of event %s was deleted although its event was deleted from the stream", id)
		}
	}
	for _, e := range unpublished {
		if !left[e.ID] {
			t.Errorf("unpublished row %s was deleted", e.ID)
		}
	}
	if removed != 1200-len(lost) || int64(removed) != deleted.Load() {
		t.Fatalf("removed %d rows (cleanup counted %d in %d runs), want every published one (%d)", removed, deleted.Load(), runs.Load(), 1200-len(lost))
	}
	t.Logf("%d cleanup runs deleted %d of %d rows; %d left (%d lost from the stream, %d unpublished)", runs.Load(), removed, len(written), len(left), len(lost), len(unpublished))
}

// --older-than keeps young rows; a dry run deletes nothing; publish_state
// mode deletes only rows marked PUBLISHED.
func TestCleanupOlderThanDryRunAndPublishedMode(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := opstest.New(t, "", 0)
	f.Setup(ctx)
	f.Start(ctx)
	// Half of the rows are a day old.
	ow := f.NewWriter(5)
	ow.Age = 24 * time.Hour
	evs := ow.Write(ctx, 20, 4)
	old := map[string]bool{}
	for _, e := range evs {
		old[e.ID] = true
	}
	evs = append(evs, f.NewWriter(5).Write(ctx, 20, 4)...)
	f.WaitCount(ctx, f.Stream, 40, 30*time.Second)
	base := cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, OlderThan: time.Hour, BatchSize: 7}
	run := func(c cleanup.Config) *cleanup.Report {
		t.Helper()
		rep, err := cleanup.Run(ctx, f.DB.Pool, f.JS, c)
		if err != nil {
			t.Fatal(err)
		}
		return rep
	}

	dry := base
	dry.DryRun = true
	if rep := run(dry); rep.Tables[0].Candidates != 20 || rep.Tables[0].Deleted != 20 || len(remainingIDs(t, f)) != 40 {
		t.Fatalf("dry run: %+v", rep.Tables[0])
	}

	// Mark 5 old and 5 young rows published: only the 5 old ones go.
	var marked []string
	for _, e := range append(append([]relaytest.Event(nil), evs[:5]...), evs[30:35]...) {
		marked = append(marked, e.ID)
	}
	if _, err := f.DB.Pool.Exec(ctx, "UPDATE outbox SET publish_state = 'PUBLISHED' WHERE event_id = ANY($1::uuid[])", marked); err != nil {
		t.Fatal(err)
	}
	pub := base
	pub.Mode = cleanup.ModePublished
	rep := run(pub)
	if rep.Tables[0].Deleted != 5 || rep.Tables[0].Remaining != 15 {
		t.Fatalf("published mode: %+v", rep.Tables[0])
	}
	left := remainingIDs(t, f)
	for _, e := range evs[:5] {
		if left[e.ID] {
			t.Errorf("published old row %s kept", e.ID)
		}
	}

	// Stream mode takes the other 15 old rows, and no young one.
	rep = run(base)
	if rep.Tables[0].Deleted != 15 || rep.Tables[0].Remaining != 0 {
		t.Fatalf("stream mode: %+v", rep.Tables[0])
	}
	left = remainingIDs(t, f)
	for _, e := range evs {
		if left[e.ID] == old[e.ID] {
			t.Errorf("row %s (old %v) kept %v", e.ID, old[e.ID], left[e.ID])
		}
	}
}

// A table without publish_state cannot use published mode; bad settings
// are rejected.
func TestCleanupErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := opstest.New(t, "", 0)
	if _, err := f.DB.Pool.Exec(ctx, "ALTER TABLE outbox DROP COLUMN publish_state"); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		cfg  cleanup.Config
		want error
	}{
		{cleanup.Config{Router: f.Cfg.Router, Mode: cleanup.ModePublished}, cleanup.ErrNoStateColumn},
		{cleanup.Config{Router: f.Cfg.Router, Mode: "sometimes"}, cleanup.ErrInvalidConfig},
		{cleanup.Config{Router: f.Cfg.Router}, cleanup.ErrInvalidConfig}, // stream mode without a stream
		{cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, BatchSize: cleanup.MaxBatchSize + 1}, cleanup.ErrInvalidConfig},
		{cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, OlderThan: -time.Hour}, cleanup.ErrInvalidConfig},
	} {
		if _, err := cleanup.Run(ctx, f.DB.Pool, f.JS, c.cfg); !errors.Is(err, c.want) {
			t.Errorf("%+v: got %v, want %v", c.cfg.Mode, err, c.want)
		}
	}
}
