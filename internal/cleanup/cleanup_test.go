package cleanup_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

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
			rep, err := cleanup.Run(cctx, f.DB.Pool, f.JS, cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, BatchSize: 50, OlderThan: time.Nanosecond, StoredMargin: time.Nanosecond}, cleanup.WithMinStoredMargin(0))
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
	base := cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, OlderThan: time.Hour, BatchSize: 7, StoredMargin: time.Nanosecond}
	run := func(c cleanup.Config) *cleanup.Report {
		t.Helper()
		rep, err := cleanup.Run(ctx, f.DB.Pool, f.JS, c, cleanup.WithMinStoredMargin(0))
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
	h := time.Hour
	for _, c := range []struct {
		cfg  cleanup.Config
		want error
	}{
		{cleanup.Config{Router: f.Cfg.Router, Mode: cleanup.ModePublished, OlderThan: h}, cleanup.ErrNoStateColumn},
		{cleanup.Config{Router: f.Cfg.Router, Mode: "sometimes", OlderThan: h}, cleanup.ErrInvalidConfig},
		{cleanup.Config{Router: f.Cfg.Router, OlderThan: h}, cleanup.ErrInvalidConfig}, // stream mode without a stream
		{cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, OlderThan: h, BatchSize: cleanup.MaxBatchSize + 1}, cleanup.ErrInvalidConfig},
		{cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, OlderThan: -time.Hour}, cleanup.ErrInvalidConfig},
		// Issue 17, case 4: no age at all, and a margin shorter than
		// JetStream's sync interval, are refused.
		{cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream}, cleanup.ErrInvalidConfig},
		{cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, Mode: cleanup.ModePublished}, cleanup.ErrInvalidConfig},
		{cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, OlderThan: h, StoredMargin: time.Minute}, cleanup.ErrInvalidConfig},
		// A pause longer than the scan consumer survives idle.
		{cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, OlderThan: h, Pause: 2 * cleanup.MaxPause}, cleanup.ErrInvalidConfig},
	} {
		if _, err := cleanup.Run(ctx, f.DB.Pool, f.JS, c.cfg); !errors.Is(err, c.want) {
			t.Errorf("%+v: got %v, want %v", c.cfg.Mode, err, c.want)
		}
	}
}

// Issue 17, case 4: the row's age said nothing of when its event was
// stored. Rows two hours old, relayed late, were deleted milliseconds after
// their events were stored, before the default R1 stream (ack before
// fsync) had synced them: an OS crash then lost event and row together.
// Now the event must have been stored for the stored margin; a stream in
// memory is refused and one with fewer than three replicas warned about.
func TestCleanupKeepsRowsWhoseEventWasStoredRecently(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := opstest.New(t, "", 0)
	f.Setup(ctx)
	w := f.NewWriter(5)
	w.Age = 2 * time.Hour
	evs := w.Write(ctx, 20, 4) // written while no relay runs
	f.Start(ctx)
	f.WaitCount(ctx, f.Stream, 20, 30*time.Second)

	cfg := cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, OlderThan: 30 * time.Minute}
	rep, err := cleanup.Run(ctx, f.DB.Pool, f.JS, cfg)
	if err != nil {
		t.Fatal(err)
	}
	tr := rep.Tables[0]
	if tr.Candidates != 20 || tr.Deleted != 0 || tr.Remaining != 20 || tr.StoredRecently != 20 || len(remainingIDs(t, f)) != len(evs) {
		t.Fatalf("events stored just now: %+v, want all 20 rows kept as stored recently", tr)
	}
	if tr.OldestRemaining == nil || time.Since(*tr.OldestRemaining) < 2*time.Hour {
		t.Errorf("oldest remaining row: %v, want about 2h old", tr.OldestRemaining)
	}
	if len(rep.Warnings) != 1 || !strings.Contains(rep.Warnings[0], "1 replica(s)") {
		t.Errorf("warnings on an R1 stream: %q", rep.Warnings)
	}
	// Once the margin has passed (here: lowered to what has passed), they go.
	cfg.StoredMargin = time.Nanosecond
	if rep, err = cleanup.Run(ctx, f.DB.Pool, f.JS, cfg, cleanup.WithMinStoredMargin(0)); err != nil || rep.Tables[0].Deleted != 20 {
		t.Fatalf("after the margin: %+v, %v", rep, err)
	}

	// A stream in memory is never proof enough.
	mem := strings.ToUpper(testenv.UniqueName("MEM"))
	if _, err := f.JS.CreateStream(ctx, jetstream.StreamConfig{Name: mem, Subjects: []string{strings.ToLower(mem) + ".>"}, Storage: jetstream.MemoryStorage}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.JS.DeleteStream(context.Background(), mem) })
	cfg.Stream = mem
	if _, err := cleanup.Run(ctx, f.DB.Pool, f.JS, cfg, cleanup.WithMinStoredMargin(0)); !errors.Is(err, cleanup.ErrNotDurable) {
		t.Fatalf("memory stream: err %v, want ErrNotDurable", err)
	}
}
