package relay

import (
	"testing"

	"github.com/nats-io/nats.go"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/router"
)

// TestRelaySpanOnlyForSampledTraces: a row whose writer trace is sampled
// gets a relay span and the span's traceparent; one that is not sampled
// (flags 00) keeps its header and costs no span; so does an invalid one.
func TestRelaySpanOnlyForSampledTraces(t *testing.T) {
	const (
		sampled   = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
		unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
	)
	for _, tc := range []struct {
		name, traceparent string
		span              bool
	}{
		{"sampled", sampled, true},
		{"not sampled", unsampled, false},
		{"invalid", "00-zz-00f067aa0ba902b7-01", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			exp := tracetest.NewInMemoryExporter()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
			t.Cleanup(func() { _ = tp.Shutdown(t.Context()) })
			r := &Relay{spanName: "publish OUTBOX"}
			o := options{}
			if err := WithTracerProvider(tp)(&o); err != nil {
				t.Fatal(err)
			}
			r.tracer = o.tracer
			rm := &router.Message{Header: nats.Header{router.TraceparentHeader: {tc.traceparent}}, Table: "public.outbox"}
			out := &outbound{r: r, rm: rm}
			r.startSpan(out)
			got := rm.Header.Get(router.TraceparentHeader)
			if tc.span {
				if out.span == nil || got == tc.traceparent || len(got) != len(tc.traceparent) {
					t.Fatalf("span %v, traceparent %q: want a relay span and its traceparent in place of %q", out.span != nil, got, tc.traceparent)
				}
				r.closeTxSpan()
				out.endSpan(publisher.Result{Attempts: 1})
				if n := len(exp.GetSpans()); n != 1 {
					t.Fatalf("%d spans exported, want 1", n)
				}
				return
			}
			if out.span != nil || got != tc.traceparent {
				t.Fatalf("span %v, traceparent %q: want no span and the header unchanged", out.span != nil, got)
			}
		})
	}
}
