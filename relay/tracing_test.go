package relay_test

import (
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/tracingtest"
)

// One trace from the writer's transaction, through the relay (with relay
// spans on), to the consumer's transaction, read from the SDK's in-memory
// exporter; with relay spans off the consumer's span is the writer's child.
func TestOneTraceWriterRelayConsumer(t *testing.T) {
	t.Parallel()
	for _, relaySpans := range []bool{true, false} {
		t.Run(map[bool]string{true: "relay spans", false: "no relay spans"}[relaySpans], func(t *testing.T) {
			t.Parallel()
			exp := tracetest.NewInMemoryExporter()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
			t.Cleanup(func() { _ = tp.Shutdown(t.Context()) })
			res := tracingtest.Run(t, tp, relaySpans)
			want := 2
			if relaySpans {
				want = 3
			}
			var spans []tracingtest.Span
			testenv.WaitFor(10*time.Second, func() bool { return len(exp.GetSpans()) >= want })
			for _, s := range exp.GetSpans() {
				attrs := map[string]string{}
				for _, kv := range s.Attributes {
					attrs[string(kv.Key)] = kv.Value.String()
				}
				spans = append(spans, tracingtest.Span{Name: s.Name, Kind: s.SpanKind, TraceID: s.SpanContext.TraceID(),
					SpanID: s.SpanContext.SpanID(), ParentSpanID: s.Parent.SpanID(), Attributes: attrs})
			}
			if msg := tracingtest.Check(res, spans, relaySpans); msg != "" {
				t.Fatal(msg)
			}
		})
	}
}
