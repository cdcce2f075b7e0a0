package relay_test

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/opstest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/tracingtest"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// privateTraced is tracedFixture on a private cluster of its own: nothing
// else writes WAL there (a stuck Behind is not hidden by other tests).
func privateTraced(t *testing.T) (*tracetest.InMemoryExporter, *sdktrace.TracerProvider, *opstest.Fixture) {
	t.Helper()
	pg, err := testenv.StartPostgres()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	exp, tp := memTracer(t)
	f := opstest.New(t, "", 0)
	f.DB = testenv.NewDatabaseOn(t, pg)
	f.DB.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "outbox.sql"))
	f.Cfg.Replication.URL = f.DB.URL
	f.Setup(t.Context())
	return exp, tp, f
}

// spanOf waits for the ended relay span linking w.
func spanOf(t *testing.T, exp *tracetest.InMemoryExporter, w tracingtest.Span, timeout time.Duration) sdktrace.ReadOnlySpan {
	t.Helper()
	var span sdktrace.ReadOnlySpan
	if !testenv.WaitFor(timeout, func() bool {
		for _, s := range exp.GetSpans() {
			for _, l := range s.Links {
				if l.SpanContext.SpanID() == w.SpanID {
					span = s.Snapshot()
					return true
				}
			}
		}
		return false
	}) {
		t.Fatalf("no ended relay span links writer span %s after %s", w.SpanID, timeout)
	}
	return span
}

// A small backlog read at once ends in a span that closes about
// maxBatchOpen after its rows, once the stream has caught up — also when
// the WAL ended in a switch (archive_timeout, pg_switch_wal) when the
// relay started: the insert position is then past the segment's long page
// header, where the walsender's sent position never gets until more WAL
// comes. The rows must all be relayed in order and confirmed either way.
func TestAttackBacklogSpanAfterWALSwitch(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, tail string }{{"plain", ""}, {"wal switch", "SELECT pg_switch_wal()"}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			exp, tp, f := privateTraced(t)
			ctx := t.Context()
			writers := tracingtest.WriteTraced(t, f, tp, 0, 3)
			if tc.tail != "" {
				if _, err := f.DB.Pool.Exec(ctx, tc.tail); err != nil {
					t.Fatal(err)
				}
			}
			var end string
			if err := f.DB.Pool.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&end); err != nil {
				t.Fatal(err)
			}
			w0 := replication.DebugWakes()
			f.Start(ctx, relay.WithTracerProvider(tp))
			f.WaitCount(ctx, f.Stream, 3, 30*time.Second)
			var last sdktrace.ReadOnlySpan
			for _, w := range writers {
				last = spanOf(t, exp, tracingtest.Span{SpanID: w.SpanID()}, 10*time.Second)
			}
			d := last.EndTime().Sub(last.StartTime())
			t.Logf("insert LSN at start %s; relay span of the backlog lasted %s, %d Wakes so far", end, d, replication.DebugWakes()-w0)
			if d >= 150*time.Millisecond {
				t.Errorf("the backlog's relay span lasted %s after its 3 rows were read at once: held to maxBatchAge (200 ms), want about maxBatchOpen + an ack", d)
			}
			got := f.Read(ctx, f.Stream)
			for i, m := range got {
				if want := "p-" + string(rune('0'+i)); m.Event.AggregateID != want {
					t.Errorf("message %d: aggregate %s, want %s", i, m.Event.AggregateID, want)
				}
			}
			// Nothing more is written: the slot's confirmed position still
			// reaches the backlog's end (the last commit's end at least).
			var lastCommit string
			if err := f.DB.Pool.QueryRow(ctx, "SELECT pg_current_wal_flush_lsn()::text").Scan(&lastCommit); err != nil {
				t.Fatal(err)
			}
			if !testenv.WaitFor(30*time.Second, func() bool {
				var ok bool
				err := f.DB.Pool.QueryRow(ctx, "SELECT coalesce(confirmed_flush_lsn >= (SELECT min(l) FROM (VALUES ($1::pg_lsn), ($2::pg_lsn)) v(l)), false) FROM pg_replication_slots WHERE slot_name = $3",
					end, lastCommit, f.Cfg.Replication.Slot).Scan(&ok)
				return err == nil && ok
			}) {
				t.Errorf("the slot's confirmed position did not reach the backlog's end")
			}
		})
	}
}
