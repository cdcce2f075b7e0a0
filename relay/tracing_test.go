package relay_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/outbox-relay/outbox-relay/internal/opstest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/tracingtest"
	"github.com/outbox-relay/outbox-relay/relay"
)

// One trace from the writer's transaction to the consumer's transaction
// (the consumer's span the writer's child), read from the SDK's in-memory
// exporter; with relay spans on, the relay's batch span is a root linked
// to the writer span, and the published traceparent is still the writer's.
func TestOneTraceWriterRelayConsumer(t *testing.T) {
	t.Parallel()
	for _, relaySpans := range []bool{true, false} {
		t.Run(map[bool]string{true: "relay spans", false: "no relay spans"}[relaySpans], func(t *testing.T) {
			t.Parallel()
			exp, tp := memTracer(t)
			res := tracingtest.Run(t, tp, relaySpans)
			want := 2
			if relaySpans {
				want = 3
			}
			testenv.WaitFor(10*time.Second, func() bool { return len(exp.GetSpans()) >= want })
			if msg := tracingtest.Check(res, tracingtest.FromStubs(exp.GetSpans()), relaySpans); msg != "" {
				t.Fatal(msg)
			}
		})
	}
}

// memTracer is a TracerProvider exporting to memory, shut down at the end.
func memTracer(t *testing.T) (*tracetest.InMemoryExporter, *sdktrace.TracerProvider) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return exp, tp
}

// tracedFixture is memTracer and a fixture with its slot created, the
// relay not started.
func tracedFixture(t *testing.T) (*tracetest.InMemoryExporter, *sdktrace.TracerProvider, *opstest.Fixture) {
	t.Helper()
	exp, tp := memTracer(t)
	f := opstest.New(t, "", 0)
	f.Setup(t.Context())
	return exp, tp, f
}

// relaySpans returns the relay's finished spans among spans.
func relaySpans(spans []tracingtest.Span, stream string) []tracingtest.Span {
	var rs []tracingtest.Span
	for _, s := range spans {
		if s.Name == "publish "+stream {
			rs = append(rs, s)
		}
	}
	return rs
}

// covered sums the relay spans' messaging.batch.message_count.
func covered(t *testing.T, rs []tracingtest.Span) int {
	t.Helper()
	n := 0
	for _, s := range rs {
		c, err := strconv.Atoi(s.Attributes["messaging.batch.message_count"])
		if err != nil {
			t.Fatalf("relay span %+v: messaging.batch.message_count: %v", s, err)
		}
		n += c
	}
	return n
}

// A backlog of one-row transactions, each written in its own sampled
// writer span, is relayed under far fewer batch spans than transactions;
// every writer span is linked by exactly one of them, and none links more
// than the SDK's default link limit (128).
func TestRelayBatchSpansLinkEveryWriterSpan(t *testing.T) {
	t.Parallel()
	const events = 600
	exp, tp, f := tracedFixture(t)
	ctx := t.Context()
	writers := tracingtest.WriteTraced(t, f, tp, 0, events) // the backlog, read at full speed
	f.Start(ctx, relay.WithTracerProvider(tp))
	f.WaitCount(ctx, f.Stream, events, 60*time.Second)
	var rs []tracingtest.Span
	if !testenv.WaitFor(10*time.Second, func() bool {
		rs = relaySpans(tracingtest.FromStubs(exp.GetSpans()), f.Stream)
		return covered(t, rs) >= events
	}) {
		t.Fatalf("relay spans cover %d events after 10 s, want %d", covered(t, rs), events)
	}
	if n := covered(t, rs); n != events {
		t.Fatalf("relay spans cover %d events, want %d", n, events)
	}
	if len(rs) > events/10 {
		t.Errorf("%d relay spans for %d transactions: want batches (at most %d)", len(rs), events, events/10)
	}
	linked := map[tracingtest.Link]int{}
	for _, s := range rs {
		if len(s.Links) > 128 || s.ParentSpanID.IsValid() {
			t.Errorf("relay span %s: %d links, parent %s: want at most 128, and a root", s.SpanID, len(s.Links), s.ParentSpanID)
		}
		for _, l := range s.Links {
			linked[l]++
		}
	}
	for i, w := range writers {
		if n := linked[tracingtest.Link{TraceID: w.TraceID(), SpanID: w.SpanID()}]; n != 1 {
			t.Errorf("writer span %d (%s) is linked by %d relay spans, want 1", i, w.SpanID(), n)
		}
	}
	if len(linked) != events {
		t.Errorf("%d distinct links, want %d (the writer spans)", len(linked), events)
	}
	t.Logf("%d events, %d relay spans", events, len(rs))
}

// A trickle of events (one every 100 ms) gets each relay span ended while
// no more rows come: the next event is written only once the previous
// one's span has ended, so a span waiting for more rows fails the test;
// and each span lasts about maxBatchOpen (5 ms) plus the ack, not until
// the next event.
func TestRelayBatchSpansEndUnderLightLoad(t *testing.T) {
	t.Parallel()
	exp, tp, f := tracedFixture(t)
	ctx := t.Context()
	f.Start(ctx, relay.WithTracerProvider(tp))
	var longest time.Duration
	for i := range 5 {
		if i > 0 {
			time.Sleep(100 * time.Millisecond) // the trickle's pace, not a wait for a result
		}
		w := tracingtest.WriteTraced(t, f, tp, i, 1)[0]
		var span sdktrace.ReadOnlySpan
		if !testenv.WaitFor(20*time.Second, func() bool {
			for _, s := range exp.GetSpans() {
				for _, l := range s.Links {
					if l.SpanContext.SpanID() == w.SpanID() {
						span = s.Snapshot()
						return true
					}
				}
			}
			return false
		}) {
			t.Fatalf("event %d: no ended relay span links its writer span 20 s after it was written", i)
		}
		// Between its first row and its end: the time bound and one ack,
		// with a generous margin for a loaded machine.
		if d := span.EndTime().Sub(span.StartTime()); d > 2*time.Second {
			t.Errorf("event %d: its relay span lasted %s, want about 5 ms", i, d)
		} else {
			longest = max(longest, d)
		}
	}
	t.Logf("longest relay span: %s", longest)
}
