package tracingtest

import (
	"fmt"
	"strings"

	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// Span is what Check needs of a finished span, whatever exporter it came
// through.
type Span struct {
	Name         string
	Kind         trace.SpanKind
	TraceID      trace.TraceID
	SpanID       trace.SpanID
	ParentSpanID trace.SpanID
	Attributes   map[string]string
	Links        []Link
}

// Link is a span link's target.
type Link struct {
	TraceID trace.TraceID
	SpanID  trace.SpanID
}

// Check reports what is wrong with spans as the trace of res: one trace,
// the writer span its root and the consumer span its child, with the event
// id and outcome applied; when relaySpans, also the relay's batch span, a
// root of its own with a link to the writer span. Empty when all holds.
func Check(res Result, spans []Span, relaySpans bool) string {
	var probs []string
	byName := map[string]Span{}
	for _, s := range spans {
		if s.TraceID != res.Writer.TraceID() && !(relaySpans && s.Name == res.RelaySpan) {
			probs = append(probs, fmt.Sprintf("span %q is in trace %s, not the writer's %s", s.Name, s.TraceID, res.Writer.TraceID()))
		}
		if _, dup := byName[s.Name]; dup {
			probs = append(probs, fmt.Sprintf("two spans named %q", s.Name))
		}
		byName[s.Name] = s
	}
	writer, ok := byName[WriterSpan]
	if !ok || writer.SpanID != res.Writer.SpanID() || writer.ParentSpanID.IsValid() {
		probs = append(probs, fmt.Sprintf("writer span %q missing or not the root: %+v", WriterSpan, writer))
	}
	parent := writer.SpanID
	want := 2
	if relaySpans {
		want = 3
		rs, ok := byName[res.RelaySpan]
		writerLink := Link{res.Writer.TraceID(), res.Writer.SpanID()}
		switch {
		case !ok:
			probs = append(probs, fmt.Sprintf("no relay span %q", res.RelaySpan))
		case rs.ParentSpanID.IsValid() || rs.Kind != trace.SpanKindProducer || len(rs.Links) != 1 || rs.Links[0] != writerLink ||
			rs.Attributes["messaging.batch.message_count"] != "1":
			probs = append(probs, fmt.Sprintf("relay span %+v: want a producer root span, linked to the writer's %v, for one event", rs, writerLink))
		}
	}
	cs, ok := byName["process "+ConsumerName]
	switch {
	case !ok:
		probs = append(probs, "no consumer span")
	case cs.ParentSpanID != parent || cs.Kind != trace.SpanKindConsumer ||
		cs.Attributes["messaging.message.id"] != res.EventID || cs.Attributes["outbox.outcome"] != "applied" ||
		cs.Attributes["outbox.aggregate.id"] != "p-1" || cs.Attributes["outbox.aggregate.version"] != "1":
		probs = append(probs, fmt.Sprintf("consumer span %+v: want a consumer span, child of %s, event %s applied", cs, parent, res.EventID))
	}
	if len(spans) != want {
		probs = append(probs, fmt.Sprintf("%d spans, want %d", len(spans), want))
	}
	return strings.Join(probs, "\n")
}

// FromStubs converts what the SDK's in-memory exporter holds.
func FromStubs(stubs tracetest.SpanStubs) []Span {
	spans := make([]Span, 0, len(stubs))
	for _, s := range stubs {
		attrs := map[string]string{}
		for _, kv := range s.Attributes {
			attrs[string(kv.Key)] = kv.Value.String()
		}
		var links []Link
		for _, l := range s.Links {
			links = append(links, Link{l.SpanContext.TraceID(), l.SpanContext.SpanID()})
		}
		spans = append(spans, Span{Name: s.Name, Kind: s.SpanKind, TraceID: s.SpanContext.TraceID(),
			SpanID: s.SpanContext.SpanID(), ParentSpanID: s.Parent.SpanID(), Attributes: attrs, Links: links})
	}
	return spans
}
