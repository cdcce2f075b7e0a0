// Package tracingtest runs one traced event through the real pipeline —
// outbox.Writer in a writer span, the relay, and the consumer library, on
// the test harness's PostgreSQL and JetStream — for the tests that check
// the trace it leaves, whatever exporter they read it from.
package tracingtest

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/consumer"
	"github.com/outbox-relay/outbox-relay/internal/opstest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/outbox"
	"github.com/outbox-relay/outbox-relay/relay"
)

// Span names the pipeline's spans have.
const (
	WriterSpan   = "register"
	ConsumerName = "rewards"
)

// Result is what Run wrote and applied.
type Result struct {
	// Writer is the writer span's context: the trace every span must be in.
	Writer  trace.SpanContext
	EventID string
	// RelaySpan is the relay span's name ("publish <stream>").
	RelaySpan string
}

// Run writes one event in a writer span of tp, relays it (with relay spans
// when relaySpans) and applies it with a consumer traced by tp, and
// returns once the consumer committed it. Spans still end after that (the
// consumer's after the ack), so the caller waits for them with a deadline.
func Run(t *testing.T, tp trace.TracerProvider, relaySpans bool) Result {
	t.Helper()
	ctx := t.Context()
	f := opstest.New(t, "", 0)
	f.DB.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "consumer.sql"))
	f.Setup(ctx)
	f.CreateStreams(ctx) // before the consumer looks for the stream
	var opts []relay.Option
	if relaySpans {
		opts = append(opts, relay.WithTracerProvider(tp))
	}
	f.Start(ctx, opts...)

	applied := make(chan string, 1)
	c, err := consumer.New(f.DB.Pool, f.JS, consumer.Config{Name: ConsumerName, Stream: f.Stream, Workers: 1, AckWait: 10 * time.Second},
		consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error { return nil }),
		consumer.WithLogger(zaptest.NewLogger(t).Named("consumer")), consumer.WithTracerProvider(tp),
		consumer.WithAfterCommit(func(m *consumer.Message) { applied <- m.ID }))
	testenv.Must(t, err, "new consumer")
	testenv.Background(ctx, t, func(ctx context.Context) error {
		if err := c.Run(ctx); err != nil {
			t.Errorf("consumer: %v", err)
		}
		return nil
	})

	// The request that writes the row: its span is the trace's root.
	w, err := outbox.NewWriter(outbox.Config{})
	testenv.Must(t, err, "new writer")
	wctx, span := tp.Tracer("tracingtest").Start(ctx, WriterSpan)
	tx, err := f.DB.Pool.Begin(wctx)
	testenv.Must(t, err, "begin")
	id, err := w.Insert(wctx, tx, outbox.Event{AggregateType: "player", AggregateID: "p-1", AggregateVersion: 1,
		Type: "PointsAwarded", Payload: json.RawMessage(`{"points": 10}`)})
	testenv.Must(t, err, "insert")
	testenv.Must(t, tx.Commit(wctx), "commit")
	span.End()

	select {
	case got := <-applied:
		if got != id.String() {
			t.Fatalf("consumer applied %s, want %s", got, id)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("the event was not applied within 60 s")
	}
	return Result{Writer: span.SpanContext(), EventID: id.String(), RelaySpan: "publish " + f.Stream}
}

// WriteTraced writes n events into f's outbox (aggregates p-first and
// on), each in its own transaction and its own writer span of tp, and
// returns the spans' contexts in the order written.
func WriteTraced(t *testing.T, f *opstest.Fixture, tp trace.TracerProvider, first, n int) []trace.SpanContext {
	t.Helper()
	ctx := t.Context()
	w, err := outbox.NewWriter(outbox.Config{})
	testenv.Must(t, err, "new writer")
	scs := make([]trace.SpanContext, 0, n)
	for i := range n {
		wctx, span := tp.Tracer("tracingtest").Start(ctx, WriterSpan)
		tx, err := f.DB.Pool.Begin(wctx)
		testenv.Must(t, err, "begin")
		_, err = w.Insert(wctx, tx, outbox.Event{AggregateType: "player", AggregateID: fmt.Sprintf("p-%d", first+i), AggregateVersion: 1,
			Type: "PointsAwarded", Payload: json.RawMessage(`{"points": 10}`)})
		testenv.Must(t, err, "insert")
		testenv.Must(t, tx.Commit(wctx), "commit")
		span.End()
		scs = append(scs, span.SpanContext())
	}
	return scs
}
