package consumer

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// TracerName is the instrumentation scope of the consumer's spans.
const TracerName = "github.com/outbox-relay/outbox-relay/consumer"

// Span attribute keys. The messaging.* keys are OpenTelemetry's messaging
// semantic conventions; the outbox.* keys are the event's own fields.
const (
	AttrEventID          = attribute.Key("messaging.message.id")
	AttrAggregateType    = attribute.Key("outbox.aggregate.type")
	AttrAggregateID      = attribute.Key("outbox.aggregate.id")
	AttrAggregateVersion = attribute.Key("outbox.aggregate.version")
	AttrEventType        = attribute.Key("outbox.event.type")
	AttrOutcome          = attribute.Key("outbox.outcome")
	AttrBatchSize        = attribute.Key("outbox.batch.size")
	AttrClass            = attribute.Key("outbox.failure.class")
)

// Span event names: what happened to the message besides its outcome.
const (
	EventRetry      = "retry"
	EventDeadLetter = "dead_letter"
	EventDuplicate  = "duplicate"
)

// WithTracerProvider makes the consumer start a span (kind consumer) around
// each message's transaction, a child of the trace context in its
// traceparent/tracestate headers (the writer's span: the relay publishes
// it unchanged, its own batch spans only link to it), so that one trace
// runs from the request that wrote the outbox row to the transaction that
// applied it. The handler's
// ctx carries the span. A message in a batch gets its own span, covering
// the batch's transaction (attribute outbox.batch.size). Default: no spans,
// and no cost beyond a nil check per message.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(o *options) error {
		if tp == nil {
			return fmt.Errorf("%w: nil tracer provider", ErrInvalidConfig)
		}
		o.tracerProvider = tp
		return nil
	}
}

// headerCarrier reads the W3C trace context from a message's headers.
type headerCarrier nats.Header

func (h headerCarrier) Get(key string) string {
	if v := h[key]; len(v) > 0 {
		return v[0]
	}
	return ""
}
func (h headerCarrier) Set(key, value string) { h[key] = []string{value} }
func (h headerCarrier) Keys() []string {
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	return keys
}

// startSpans starts the span of each message about to be processed.
func (c *Consumer) startSpans(ctx context.Context, its []*item) {
	if c.tracer == nil {
		return
	}
	for _, it := range its {
		switch {
		case it.span != nil:
			continue // back from a batch that did not attempt it: the same span goes on
		case it.err != nil && it.m.ID == "" || c.wanted != nil && !c.wanted[it.m.Type]:
			continue // no transaction to trace
		}
		parent := propagation.TraceContext{}.Extract(context.WithoutCancel(ctx), headerCarrier(it.m.Header))
		attrs := []attribute.KeyValue{
			AttrEventID.String(it.m.ID),
			AttrAggregateType.String(it.m.AggregateType),
			AttrAggregateID.String(it.m.AggregateID),
			AttrAggregateVersion.Int64(it.m.AggregateVersion),
			AttrEventType.String(it.m.Type),
			attribute.String("messaging.system", "nats"),
			attribute.String("messaging.destination.name", it.m.Subject),
			attribute.String("messaging.consumer.group.name", c.cfg.Name),
		}
		if len(its) > 1 {
			attrs = append(attrs, AttrBatchSize.Int(len(its)))
		}
		if it.m.Replayed() {
			attrs = append(attrs, attribute.Int64("outbox.dead_letter.id", it.m.DeadLetterID))
		}
		_, it.span = c.tracer.Start(parent, "process "+c.cfg.Name,
			trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
	}
}

// spanContext returns ctx carrying it's span, for the handler.
func (it *item) spanContext(ctx context.Context) context.Context {
	if it.span == nil {
		return ctx
	}
	return trace.ContextWithSpan(ctx, it.span)
}

// spanEvent records what happened to it on its span.
func (it *item) spanEvent(name string, attrs ...attribute.KeyValue) {
	if it.span != nil {
		it.span.AddEvent(name, trace.WithAttributes(attrs...))
	}
}

// retrySpanEvent records a retry on it's span.
func (it *item) retrySpanEvent(class Class, attempt int, delay time.Duration, err error) {
	if it.span != nil {
		it.spanEvent(EventRetry, AttrClass.String(string(class)), attribute.Int("outbox.attempt", attempt),
			attribute.String("outbox.retry.delay", delay.String()), attribute.String("exception.message", err.Error()))
	}
}

// deadLetterSpanEvent records that it was dead-lettered as record id.
func (it *item) deadLetterSpanEvent(class Class, id int64) {
	if it.span != nil {
		it.spanDead = true
		it.spanEvent(EventDeadLetter, AttrClass.String(string(class)), attribute.Int64("outbox.dead_letter.id", id))
	}
}

// endSpan ends it's span with the outcome of res; retried says the message
// will be redelivered.
func (it *item) endSpan(res result, retried bool) {
	if it.span == nil {
		return
	}
	outcome := outcomeOf(res, retried)
	if it.spanDead {
		outcome = outcomeDeadLettered
	}
	if res.kind == resDuplicate {
		it.spanEvent(EventDuplicate)
	}
	it.span.SetAttributes(AttrOutcome.String(outcome))
	if res.err != nil && outcome != outcomeDeferred {
		it.span.SetStatus(codes.Error, res.err.Error())
	}
	it.span.End()
	it.span = nil
}

// outcomeOf names res for the span: the metrics' outcomes, plus
// dead_lettered and failed.
func outcomeOf(res result, retried bool) string {
	switch {
	case retried:
		return outcomeRetried
	case res.kind == resApplied:
		return outcomeApplied
	case res.kind == resRejected:
		return outcomeRejected
	case res.kind == resDuplicate:
		return outcomeDuplicate
	case res.kind == resSkipped:
		return outcomeSkipped
	case res.kind == resStale:
		return "stale"
	case res.kind == resGap:
		return outcomeDeferred // not dead-lettered (endSpan): deferred
	}
	return "failed"
}
