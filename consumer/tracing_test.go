package consumer

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

const testTraceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// spanAttr returns the value of key on s, "" when absent.
func spanAttr(s tracetest.SpanStub, key attribute.Key) string {
	for _, kv := range s.Attributes {
		if kv.Key == key {
			return kv.Value.String()
		}
	}
	return ""
}

func spanEvents(s tracetest.SpanStub) []string {
	var names []string
	for _, e := range s.Events {
		names = append(names, e.Name)
	}
	return names
}

// Each message's transaction gets a span, a child of the span in its
// traceparent header, with the event's fields and outcome; a retry, a dead
// letter and a duplicate are span events. Per message and in batches.
func TestConsumerSpans(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{1, 8} {
		t.Run(map[int]string{1: "per message", 8: "batched"}[batch], func(t *testing.T) {
			t.Parallel()
			f := newFixture(t)
			exp := tracetest.NewInMemoryExporter()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
			t.Cleanup(func() { _ = tp.Shutdown(t.Context()) })
			rec := newRecorder("traced")
			rec.fail = func(m *Message, call int) error {
				switch {
				case m.ID == uuidN(2) && call == 1:
					return Transient(errors.New("database hiccup"))
				case m.ID == uuidN(3):
					return Permanent(errors.New("cannot apply"))
				}
				return nil
			}
			evs := []event{
				{ID: uuidN(1), AggID: "a1", Version: 1},
				{ID: uuidN(2), AggID: "a2", Version: 1},
				{ID: uuidN(3), AggID: "a3", Version: 1},
				{ID: uuidN(1), AggID: "a1", Version: 1, MsgID: "again"}, // stored twice: a duplicate
			}
			for _, e := range evs {
				m := e.msg(f.stream)
				m.Header["traceparent"] = []string{testTraceparent}
				ctx := t.Context()
				if _, err := f.js.PublishMsg(ctx, m); err != nil {
					t.Fatal(err)
				}
			}
			cfg := f.baseConfig("traced")
			cfg.BatchSize = batch
			f.start(cfg, rec, WithTracerProvider(tp))
			f.waitSettled("traced", 30*time.Second)
			// Spans end after the ack: wait for all five (event 2 twice).
			f.waitFor("five spans", 10*time.Second, func() bool { return len(exp.GetSpans()) >= 5 })

			one := checkSpans(t, exp.GetSpans())
			if batch > 1 && spanAttr(one(outcomeApplied), AttrBatchSize) == "" {
				t.Logf("no batch size on the applied span: it went alone")
			}
		})
	}
}

// checkSpans checks TestConsumerSpans's spans: children of the header's
// span, one per outcome with its event; it returns the first span of an
// outcome.
func checkSpans(t *testing.T, spans tracetest.SpanStubs) func(outcome string) tracetest.SpanStub {
	t.Helper()
	parent, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	byOutcome := map[string][]tracetest.SpanStub{}
	for _, s := range spans {
		if s.SpanContext.TraceID() != parent || s.Parent.SpanID().String() != "00f067aa0ba902b7" || !s.Parent.IsRemote() {
			t.Errorf("span %s: trace %s parent %s, want a child of the header's span", s.Name, s.SpanContext.TraceID(), s.Parent.SpanID())
		}
		if s.SpanKind != trace.SpanKindConsumer || s.Name != "process traced" {
			t.Errorf("span %q kind %s", s.Name, s.SpanKind)
		}
		byOutcome[spanAttr(s, AttrOutcome)] = append(byOutcome[spanAttr(s, AttrOutcome)], s)
	}
	one := func(outcome string) tracetest.SpanStub {
		t.Helper()
		if len(byOutcome[outcome]) == 0 {
			t.Fatalf("no span with outcome %s: %v", outcome, byOutcome)
		}
		return byOutcome[outcome][0]
	}
	applied := byOutcome[outcomeApplied]
	if len(applied) != 2 {
		t.Fatalf("%d applied spans, want 2 (events 1 and 2): %v", len(applied), byOutcome)
	}
	for _, s := range applied {
		if id := spanAttr(s, AttrEventID); id != uuidN(1) && id != uuidN(2) ||
			spanAttr(s, AttrAggregateType) != "registration" || spanAttr(s, AttrAggregateVersion) != "1" ||
			spanAttr(s, AttrEventType) != "RegistrationConfirmed" {
			t.Errorf("applied span attributes %v", s.Attributes)
		}
	}
	if s := one(outcomeRetried); spanAttr(s, AttrEventID) != uuidN(2) || len(s.Events) != 1 || s.Events[0].Name != EventRetry {
		t.Errorf("retried span: id %s events %v", spanAttr(s, AttrEventID), spanEvents(s))
	}
	if s := one(outcomeDeadLettered); spanAttr(s, AttrEventID) != uuidN(3) || len(s.Events) != 1 || s.Events[0].Name != EventDeadLetter ||
		s.Status.Code.String() != "Error" {
		t.Errorf("dead-lettered span: id %s events %v status %v", spanAttr(s, AttrEventID), spanEvents(s), s.Status)
	}
	if s := one(outcomeDuplicate); spanAttr(s, AttrEventID) != uuidN(1) || len(s.Events) != 1 || s.Events[0].Name != EventDuplicate {
		t.Errorf("duplicate span: id %s events %v", spanAttr(s, AttrEventID), spanEvents(s))
	}
	return one
}

// Without WithTracerProvider the consumer creates no span and the handler's
// ctx carries none.
func TestConsumerWithoutTracerProvider(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	var sawSpan bool
	h := HandlerFunc(func(ctx context.Context, tx pgx.Tx, m *Message) error {
		sawSpan = trace.SpanContextFromContext(ctx).IsValid()
		return nil
	})
	e := event{ID: uuidN(1), AggID: "a1", Version: 1}
	m := e.msg(f.stream)
	m.Header["traceparent"] = []string{testTraceparent}
	if _, err := f.js.PublishMsg(t.Context(), m); err != nil {
		t.Fatal(err)
	}
	f.start(f.baseConfig("untraced"), h)
	f.waitSettled("untraced", 30*time.Second)
	if sawSpan {
		t.Fatal("the handler's ctx carries a span without a tracer provider")
	}
	if _, err := New(f.pool, f.js, f.baseConfig("x"), h, WithTracerProvider(nil)); !errors.Is(err, ErrInvalidConfig) {
		t.Fatalf("WithTracerProvider(nil): %v, want ErrInvalidConfig", err)
	}
}
