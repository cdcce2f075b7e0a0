package relay

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

// TracerName is the instrumentation scope of the relay's spans.
const TracerName = "github.com/outbox-relay/outbox-relay/relay"

// WithTracerProvider turns on relay spans, batch publish spans as the
// OpenTelemetry messaging conventions describe them: one span "publish
// <stream>" of kind producer covers the rows of many transactions and
// carries a link to each distinct sampled writer span context among them
// (the rows' traceparent/tracestate headers, see router), from routing its
// first row to the broker's ack of its last (status error when one was
// dead-lettered; attributes messaging.batch.message_count,
// outbox.batch.transactions, and outbox.commit_lsn.first and .last, the
// commits of its first and last rows). The published traceparent stays the
// writer's: it is the message's creation context, so a consumer's span is
// the writer span's child, and the relay's span is found through its link.
// Rows without a sampled trace context get no span: the relay never
// records a trace the writer did not sample. Default (nil): no spans, and
// nothing done per row.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(o *options) error {
		if tp != nil {
			o.tracer = tp.Tracer(TracerName)
		}
		return nil
	}
}

const (
	// maxBatchLinks is how many writer span contexts one batch span links
	// at most: the SDK's default span link limit (sdktrace
	// LinkCountLimit, 128). Past it the SDK would drop links silently, so
	// a batch closes instead; at 1 row per transaction it amortises a
	// span's cost (~5 µs with export, bench/README.md) over 128 events.
	maxBatchLinks = 128
	// maxBatchOpen is how long a batch span takes new rows while the
	// relay has caught up with the server: it closes at the first commit
	// after it with nothing more waiting to be read, or when the stream
	// has been quiet that long (replication.Wake). It bounds how long a
	// span waits for rows that may never come, and so the delay of its
	// export under light load; at high rates maxBatchLinks closes batches
	// first.
	maxBatchOpen = 5 * time.Millisecond
	// maxBatchAge is how long a batch span takes new rows while more is
	// always waiting, or the stream is still behind the WAL the server had
	// when it started: a backlog read on a machine that gives the relay
	// (or the walsender) little CPU, or a busy cluster whose WAL never
	// lets the stream catch up. Without it such a span would stay open as
	// long as the busy spell, its rows' writers waiting that long to see
	// it exported.
	// 200 ms is far above maxBatchOpen, so that it is not what sizes a
	// starved relay's spans (at 128 rows it allows 1.6 ms a row), and
	// small beside the SDK batch processor's own export delay (5 s by
	// default): it adds little to when a span can be seen.
	maxBatchAge = 200 * time.Millisecond
)

var (
	attrNATS = attribute.String("messaging.system", "nats")
	attrSend = attribute.String("messaging.operation.type", "send")
)

// batchSpan is one relay span: the rows it covers hold references to it,
// and it ends when the last of them is released — the pipeline's own
// reference, dropped when the batch closes, and one per row, dropped when
// the broker acknowledged or dead-lettered it. The ack side only releases
// (atomics): the span is started, and its fields set, by the pipeline
// before it drops its reference, so whoever drops the last one sees them.
type batchSpan struct {
	span   trace.Span
	refs   atomic.Int64
	reason atomic.Pointer[error] // set when a row was dead-lettered
}

func (s *batchSpan) release() {
	if s.refs.Add(-1) != 0 {
		return
	}
	if p := s.reason.Load(); p != nil {
		s.span.SetStatus(codes.Error, "dead-lettered: "+(*p).Error())
	}
	s.span.End()
}

// spanKey names a writer span: a link's identity.
type spanKey struct {
	trace trace.TraceID
	span  trace.SpanID
}

// batchSpans makes the relay's batch spans. It belongs to the pipeline
// goroutine, which opens, fills and closes the batch: the rows' acks
// arrive on the publisher's goroutines and only release references
// (batchSpan), so nothing here needs a lock.
//
// A batch span is a root span, not a child of its first writer span: it
// covers the rows of up to maxBatchLinks requests equally, and as the
// child of one of them it would sit in that request's trace for the time
// of 127 others (the conventions' form for a batch is a new span with a
// link per message's creation context). Its sampling is then the relay's
// TracerProvider's decision for a root span (parent-based by default:
// always).
type batchSpans struct {
	tracer trace.Tracer
	name   string
	attrs  []attribute.KeyValue // the span's constant attributes
	// wake asks the stream for a replication.Wake at a time, pending
	// asks whether more of it is already waiting to be read
	// (replication.Stream.Pending), and behind whether it is still
	// reading the WAL the server had when it started
	// (replication.Stream.Behind). Nil: none, as in tests without a
	// stream (nothing is then ever waiting, nor behind).
	wake    func(time.Time)
	pending func() bool
	behind  func() bool

	// The open batch, nil when none; what it covers so far.
	open   *batchSpan
	opened time.Time
	links  []trace.Link // reused: the SDK copies them at Start
	linked map[spanKey]struct{}
	rows   int
	txs    int
	// The commits of the batch's first and last rows.
	firstTx, lastTx replication.LSN

	// The previous traced row's headers and what they name, so that the
	// rows of one writer span (a transaction of 100 rows, one request)
	// cost a string comparison each, not a parse.
	lastParent, lastState string
	lastCtx               trace.SpanContext // invalid: not sampled, or unparsable
	lastLinked            bool              // lastCtx is linked in the open batch
}

func newBatchSpans(tracer trace.Tracer, stream string, wake func(time.Time), pending, behind func() bool) *batchSpans {
	if tracer == nil {
		return nil
	}
	return &batchSpans{tracer: tracer, name: "publish " + stream, wake: wake, pending: pending, behind: behind,
		attrs:  []attribute.KeyValue{attrNATS, attrSend, attribute.String("messaging.destination.name", stream)},
		linked: make(map[spanKey]struct{}, maxBatchLinks)}
}

// join puts o's row in the open batch, opening one for the first sampled
// row, and links its writer span context there once per batch. A row
// without a trace context, or with one not sampled or not valid, joins
// nothing and is published as it is. Its traceparent header is never
// changed (HeaderLen stays exact). Pipeline goroutine only; b may be nil.
func (b *batchSpans) join(o *outbound) {
	if b == nil {
		return
	}
	tp, ok := o.rm.Header.Lookup(router.TraceparentHeader)
	if !ok {
		return
	}
	state := o.rm.Header.Get(router.TracestateHeader)
	if tp != b.lastParent || state != b.lastState {
		b.lastParent, b.lastState, b.lastLinked = tp, state, false
		b.lastCtx = writerContext(o.rm, tp, state)
		if !b.lastCtx.IsSampled() {
			b.lastCtx = trace.SpanContext{} // a trace nobody records
		}
	}
	if !b.lastCtx.IsValid() {
		return
	}
	if !b.lastLinked { // false whenever no batch is open
		b.link(o)
	}
	s := b.open
	b.rows++
	if o.rm.Commit.LSN != b.lastTx || b.txs == 0 {
		if b.txs == 0 {
			b.firstTx = o.rm.Commit.LSN
		}
		b.txs++
		b.lastTx = o.rm.Commit.LSN
	}
	s.refs.Add(1)
	o.span = s
}

// link adds b.lastCtx to the open batch's links unless it is there,
// closing a full batch and opening one as needed.
func (b *batchSpans) link(o *outbound) {
	key := spanKey{b.lastCtx.TraceID(), b.lastCtx.SpanID()}
	if b.open != nil {
		if _, ok := b.linked[key]; ok {
			b.lastLinked = true
			return
		}
		if len(b.links) >= maxBatchLinks {
			b.close()
		}
	}
	if b.open == nil {
		b.open = &batchSpan{}
		b.open.refs.Store(1) // the pipeline's, until close
		b.opened = time.Now()
		if b.wake != nil {
			b.wake(b.opened.Add(maxBatchOpen))
		}
	}
	b.linked[key] = struct{}{}
	b.lastLinked = true
	// No link attributes: the commit LSN of the writer span's first row
	// on each link doubled the OTLP bytes and added ~50 MB of peak RSS at
	// 1 row/tx (bench/README.md); the span's first and last commit LSN
	// give the WAL range to look in.
	b.links = append(b.links, trace.Link{SpanContext: b.lastCtx})
}

// commit closes the open batch when it has taken rows for maxBatchOpen
// and the relay has caught up with the server: the pipeline calls it at
// each transaction's commit, so that the rows of one writer span in one
// transaction share a batch.
//
// While more of the stream is already waiting, or the stream is still
// reading the WAL the server had when it started, the batch stays open (up
// to maxBatchAge): a backlog is then being read as fast as the relay and
// the walsender are scheduled, and closing by the clock alone would size
// its spans by the CPU share they get, not by the data — on a loaded
// machine, a few rows each. It closes where the backlog ends, at
// maxBatchLinks, or at maxBatchAge when the stream never catches up.
func (b *batchSpans) commit() {
	if b == nil || b.open == nil {
		return
	}
	age := time.Since(b.opened)
	if age < maxBatchOpen {
		return
	}
	if age < maxBatchAge && b.pending != nil && b.pending() {
		// The Wake asked for at opening may have come inside a
		// transaction, and gone: ask again, so that the batch ends as
		// soon as the stream has nothing more to give (a time already
		// past: the stream wakes the pipeline once nothing is waiting).
		if b.wake != nil {
			b.wake(b.opened.Add(maxBatchOpen))
		}
		return
	}
	if b.holdBehind(age) {
		return
	}
	b.close()
}

// quiet closes the open batch on a Wake between transactions: the stream
// had nothing waiting once the batch was maxBatchOpen old. Unless the
// stream is still behind the server's WAL at its start: then the
// walsender is only slower than the relay, and the batch waits for the
// backlog's next rows (holdBehind).
func (b *batchSpans) quiet() {
	if b == nil || b.open == nil || b.holdBehind(time.Since(b.opened)) {
		return
	}
	b.close()
}

// holdBehind keeps a batch of age open while the stream is behind (see
// commit), asking for a Wake at maxBatchAge: with nothing waiting, a Wake
// at maxBatchOpen would come at once, again and again.
func (b *batchSpans) holdBehind(age time.Duration) bool {
	if age >= maxBatchAge || b.behind == nil || !b.behind() {
		return false
	}
	if b.wake != nil {
		b.wake(b.opened.Add(maxBatchAge))
	}
	return true
}

// close starts the open batch's span, backdated to when the batch opened
// and with all its links (given at Start, where samplers see them), and
// drops the pipeline's reference: the span ends when its rows are settled,
// at once if they already are. Called at commit (above), on a Wake
// between transactions, when intake pauses and when the pipeline ends, so
// no span waits for rows that are not coming.
func (b *batchSpans) close() {
	if b == nil || b.open == nil {
		return
	}
	s := b.open
	attrs := append(b.attrs[:len(b.attrs):len(b.attrs)],
		attribute.Int("messaging.batch.message_count", b.rows), attribute.Int("outbox.batch.transactions", b.txs),
		attribute.String("outbox.commit_lsn.first", b.firstTx.String()), attribute.String("outbox.commit_lsn.last", b.lastTx.String()))
	_, s.span = b.tracer.Start(context.Background(), b.name, trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithTimestamp(b.opened), trace.WithLinks(b.links...), trace.WithAttributes(attrs...))
	b.open, b.rows, b.txs, b.lastLinked = nil, 0, 0, false
	clear(b.links) // the SDK holds copies; drop the attributes' references
	b.links = b.links[:0]
	clear(b.linked)
	s.release()
}

// writerContext is the span context in m's traceparent (tp) and
// tracestate headers, invalid when there is none. The common form — version
// 00, lowercase, no reserved flags — is read in place: the propagator's
// Extract returns it in a new context, two allocations per writer span
// that a batch span's links do not need. Any other form, valid or not,
// goes through Extract, which knows the specification's rules for it.
func writerContext(m *router.Message, tp, state string) trace.SpanContext {
	if len(tp) == 55 && tp[:3] == "00-" && tp[35] == '-' && tp[52] == '-' && tp[53] == '0' && tp[54] >= '0' && tp[54] <= '3' {
		tid, terr := trace.TraceIDFromHex(tp[3:35])
		sid, serr := trace.SpanIDFromHex(tp[36:52])
		if terr == nil && serr == nil {
			cfg := trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.TraceFlags(tp[54] - '0'), Remote: true}
			if state != "" {
				// As Extract: an invalid tracestate is dropped, the
				// traceparent still counts (W3C Trace Context).
				cfg.TraceState, _ = trace.ParseTraceState(state)
			}
			return trace.NewSpanContext(cfg)
		}
	}
	return trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), headerGetter{m}))
}

// headerGetter reads a routed message's trace context headers.
type headerGetter struct{ m *router.Message }

func (c headerGetter) Get(key string) string { return c.m.Header.Get(key) }
func (c headerGetter) Set(string, string)    {}
func (c headerGetter) Keys() []string {
	return []string{router.TraceparentHeader, router.TracestateHeader}
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

// TraceHeadersDropped returns how many trace context values the router
// left off their events because no header could carry them.
func (r *Relay) TraceHeadersDropped() uint64 { return r.router.TraceHeadersDropped() }
