package relay

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/router"
)

// TracerName is the instrumentation scope of the relay's spans.
const TracerName = "github.com/outbox-relay/outbox-relay/relay"

// WithTracerProvider turns on relay spans: each event whose row carries a
// W3C trace context (the traceparent column, see router) gets a span of
// kind producer, a child of the writer's span, from routing to the broker's
// ack (or dead-lettering: status error). The published traceparent then
// names the relay's span, so a consumer's span is its child and the trace
// reads writer → relay → consumer. Rows without a trace context get no
// span: the relay never starts traces of its own, one per row. Default
// (nil): no spans, and nothing done per row.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(r *Relay) {
		if tp != nil {
			r.tracer = tp.Tracer(TracerName)
		}
	}
}

var attrNATS = attribute.String("messaging.system", "nats")

// traceHeaders adapts a routed message's headers to the propagator. Set
// only replaces the value of a header the message has, in its slot, so
// the router's Release contract holds (keys untouched), and keeps
// HeaderLen exact.
type traceHeaders struct{ m *router.Message }

func (c traceHeaders) Get(key string) string {
	if v := c.m.Header[key]; len(v) == 1 {
		return v[0]
	}
	return ""
}

func (c traceHeaders) Set(key, value string) {
	if v := c.m.Header[key]; len(v) == 1 {
		c.m.HeaderLen += len(value) - len(v[0])
		v[0] = value
	}
}

func (c traceHeaders) Keys() []string {
	return []string{router.TraceparentHeader, router.TracestateHeader}
}

// startSpan starts o's relay span when spans are on and its row carries a
// trace context, and puts the span's context in the message's traceparent.
func (r *Relay) startSpan(o *outbound) {
	if r.tracer == nil || o.rm.Header[router.TraceparentHeader] == nil {
		return
	}
	h := traceHeaders{o.rm}
	parent := propagation.TraceContext{}.Extract(context.Background(), h)
	if !trace.SpanContextFromContext(parent).IsValid() {
		return // an invalid traceparent is published as it is
	}
	ctx, span := r.tracer.Start(parent, r.spanName, trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(attrNATS,
			attribute.String("messaging.destination.name", o.rm.Subject),
			attribute.String("messaging.message.id", o.rm.EventID),
			attribute.String("outbox.table", o.rm.Table)))
	propagation.TraceContext{}.Inject(ctx, h)
	o.span = span
}

// endSpan ends o's span, if any, with the broker's verdict.
func (o *outbound) endSpan(res publisher.Result) {
	if o.span == nil {
		return
	}
	if res.DeadLettered {
		msg := "dead-lettered"
		if res.Reason != nil {
			msg = res.Reason.Error()
		}
		o.span.SetStatus(codes.Error, msg)
	}
	o.span.End()
}
