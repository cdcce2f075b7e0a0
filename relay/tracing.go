package relay

import (
	"context"
	"errors"
	"sync/atomic"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/router"
)

// TracerName is the instrumentation scope of the relay's spans.
const TracerName = "github.com/outbox-relay/outbox-relay/relay"

// WithTracerProvider turns on relay spans: the rows of a transaction that
// carry a W3C trace context (the traceparent column, see router) get a
// span of kind producer per writer span, a child of it, from routing the
// first of them to the broker's ack of the last (status error when one was
// dead-lettered; attribute messaging.batch.message_count). The published
// traceparent then names the relay's span, so a consumer's span is its
// child and the trace reads writer → relay → consumer. Rows without a
// trace context get no span: the relay never starts traces of its own.
// Default (nil): no spans, and nothing done per row.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(o *options) error {
		if tp != nil {
			o.tracer = tp.Tracer(TracerName)
		}
		return nil
	}
}

var attrNATS = attribute.String("messaging.system", "nats")

// txSpan is the relay span of one writer span's rows in one transaction:
// the rows of a transaction that carry the same traceparent (one request
// wrote them) share it, so its cost is paid per transaction, not per row.
// It ends when the pipeline has moved past its rows and every one of them
// is acknowledged or dead-lettered.
type txSpan struct {
	span        trace.Span
	traceparent string // the relay span's, published in the rows' headers
	rows        int    // pipeline goroutine only
	refs        atomic.Int64
	reason      atomic.Pointer[error] // set when a row was dead-lettered
}

func (s *txSpan) release() {
	if s.refs.Add(-1) != 0 {
		return
	}
	if p := s.reason.Load(); p != nil {
		s.span.SetStatus(codes.Error, "dead-lettered: "+(*p).Error())
	}
	s.span.End()
}

// traceCarrier receives the relay span's trace context headers.
type traceCarrier struct{ traceparent string }

func (c *traceCarrier) Get(string) string { return "" }
func (c *traceCarrier) Keys() []string    { return nil }
func (c *traceCarrier) Set(key, value string) {
	if key == router.TraceparentHeader {
		c.traceparent = value
	}
}

// headerGetter reads a routed message's trace context headers.
type headerGetter struct{ m *router.Message }

func (c headerGetter) Get(key string) string {
	if v := c.m.Header[key]; len(v) == 1 {
		return v[0]
	}
	return ""
}
func (c headerGetter) Set(string, string) {}
func (c headerGetter) Keys() []string {
	return []string{router.TraceparentHeader, router.TracestateHeader}
}

// startSpan joins o to the relay span of its row's trace context, starting
// one for the first row of a writer span in a transaction, and puts the
// relay span's context in the message's traceparent (same length, so
// HeaderLen stays exact). A writer's trace that is not sampled gets no
// relay span and keeps its traceparent: with sampling in the writer, the
// relay's cost follows the sampling rate. Pipeline goroutine only.
func (r *Relay) startSpan(o *outbound) {
	if r.tracer == nil {
		return
	}
	v := o.rm.Header[router.TraceparentHeader]
	if len(v) != 1 {
		return
	}
	if s := r.txSpan; s == nil || v[0] != r.txSpanParent || o.rm.Commit.LSN != r.txSpanCommit {
		r.closeTxSpan()
		parent := propagation.TraceContext{}.Extract(context.Background(), headerGetter{o.rm})
		if sc := trace.SpanContextFromContext(parent); !sc.IsValid() || !sc.IsSampled() {
			return // published as it is: invalid, or a trace nobody records
		}
		ctx, span := r.tracer.Start(parent, r.spanName, trace.WithSpanKind(trace.SpanKindProducer),
			trace.WithAttributes(attrNATS, attribute.String("messaging.destination.name", r.cfg.Stream.Name),
				attribute.String("outbox.table", o.rm.Table), attribute.String("outbox.commit_lsn", o.rm.Commit.LSN.String())))
		var c traceCarrier
		propagation.TraceContext{}.Inject(ctx, &c)
		r.txSpan = &txSpan{span: span, traceparent: c.traceparent}
		r.txSpan.refs.Store(1) // the pipeline's, until closeTxSpan
		r.txSpanParent, r.txSpanCommit = v[0], o.rm.Commit.LSN
	}
	s := r.txSpan
	s.rows++
	s.refs.Add(1)
	o.rm.HeaderLen += len(s.traceparent) - len(v[0])
	v[0] = s.traceparent
	o.span = s
}

// closeTxSpan lets the current relay span end once its rows are settled:
// the pipeline calls it at each commit (a span covers one transaction).
func (r *Relay) closeTxSpan() {
	s := r.txSpan
	if s == nil {
		return
	}
	r.txSpan = nil
	s.span.SetAttributes(attribute.Int("messaging.batch.message_count", s.rows))
	s.release()
}

// endSpan releases o's row from its relay span, with the broker's verdict.
func (o *outbound) endSpan(res publisher.Result) {
	if o.span == nil {
		return
	}
	if res.DeadLettered {
		reason := res.Reason
		if reason == nil {
			reason = errors.New("rejected by the broker")
		}
		o.span.reason.CompareAndSwap(nil, &reason)
	}
	o.span.release()
}
