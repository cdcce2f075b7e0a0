package outbox

import (
	"context"
	"encoding/json"
	"path/filepath"
	"testing"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// tracedContext returns a context carrying a sampled remote span context
// with a tracestate, as a request handler's context would.
func tracedContext(t *testing.T) (context.Context, trace.SpanContext) {
	t.Helper()
	ts, err := trace.ParseTraceState("vendor=abc")
	testenv.Must(t, err, "trace state")
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e, 0x47, 0x36},
		SpanID:     trace.SpanID{0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7},
		TraceFlags: trace.FlagsSampled,
		TraceState: ts,
		Remote:     true,
	})
	return trace.ContextWithSpanContext(context.Background(), sc), sc
}

// The writer stores the span context of its ctx as W3C traceparent and
// tracestate; without a span, or in a table without the columns (one
// created before they existed), it writes the row as before.
func TestInsertStoresTraceContext(t *testing.T) {
	t.Parallel()
	traced, _ := tracedContext(t)
	const wantTP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	ev := func(v int64) Event {
		return Event{AggregateID: "a", AggregateVersion: v, Type: "T", Payload: json.RawMessage(`{}`)}
	}
	insert := func(t *testing.T, db *testenv.Database, w *Writer, ctx context.Context, e Event) uuid.UUID {
		t.Helper()
		tx, err := db.Pool.Begin(context.Background())
		testenv.Must(t, err, "begin")
		defer func() { _ = tx.Rollback(context.Background()) }()
		id, err := w.Insert(ctx, tx, e)
		testenv.Must(t, err, "insert")
		testenv.Must(t, tx.Commit(context.Background()), "commit")
		return id
	}
	read := func(t *testing.T, db *testenv.Database, id uuid.UUID) (tp, ts *string) {
		t.Helper()
		err := db.Pool.QueryRow(context.Background(), `SELECT traceparent, tracestate FROM outbox WHERE event_id = $1`, id).Scan(&tp, &ts)
		testenv.Must(t, err, "read trace columns")
		return tp, ts
	}
	seed := func(t *testing.T) *testenv.Database {
		db := testenv.Get(t).NewDatabase(t)
		db.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "outbox.sql"))
		return db
	}

	t.Run("seed table", func(t *testing.T) {
		t.Parallel()
		db := seed(t)
		w, err := NewWriter(Config{})
		testenv.Must(t, err, "new writer")
		tp, ts := read(t, db, insert(t, db, w, traced, ev(1)))
		if tp == nil || *tp != wantTP || ts == nil || *ts != "vendor=abc" {
			t.Fatalf("traceparent %v tracestate %v, want %s vendor=abc", deref(tp), deref(ts), wantTP)
		}
		if tp, ts := read(t, db, insert(t, db, w, context.Background(), ev(2))); tp != nil || ts != nil {
			t.Fatalf("no span: traceparent %v tracestate %v, want NULL", deref(tp), deref(ts))
		}
	})
	t.Run("table without the columns", func(t *testing.T) {
		t.Parallel()
		db := seed(t)
		_, err := db.Pool.Exec(context.Background(), `ALTER TABLE outbox DROP COLUMN traceparent, DROP COLUMN tracestate`)
		testenv.Must(t, err, "drop the trace columns")
		w, err := NewWriter(Config{})
		testenv.Must(t, err, "new writer")
		for v := int64(1); v <= 2; v++ { // the second Insert uses what the first looked up
			insert(t, db, w, traced, ev(v))
		}
	})
	t.Run("omitted", func(t *testing.T) {
		t.Parallel()
		db := seed(t)
		w, err := NewWriter(Config{Columns: Columns{Traceparent: Omit, Tracestate: Omit}})
		testenv.Must(t, err, "new writer")
		if tp, ts := read(t, db, insert(t, db, w, traced, ev(1))); tp != nil || ts != nil {
			t.Fatalf("omitted columns written: %v %v", deref(tp), deref(ts))
		}
	})
	t.Run("named columns", func(t *testing.T) {
		t.Parallel()
		db := seed(t)
		_, err := db.Pool.Exec(context.Background(), `ALTER TABLE outbox RENAME COLUMN traceparent TO trace_parent`)
		testenv.Must(t, err, "rename")
		w, err := NewWriter(Config{Columns: Columns{Traceparent: "trace_parent", Tracestate: Omit}})
		testenv.Must(t, err, "new writer")
		id := insert(t, db, w, traced, ev(1))
		var tp string
		testenv.Must(t, db.Pool.QueryRow(context.Background(), `SELECT trace_parent FROM outbox WHERE event_id = $1`, id).Scan(&tp), "read")
		if tp != wantTP {
			t.Fatalf("trace_parent %q, want %s", tp, wantTP)
		}
	})
}

func deref(p *string) any {
	if p == nil {
		return nil
	}
	return *p
}
