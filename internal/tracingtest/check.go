package tracingtest

import (
	"fmt"
	"strings"

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
}

// Check reports what is wrong with spans as the trace of res: one trace,
// the writer span its root, the relay span (when relaySpans) its child and
// the consumer span the relay's child (else the writer's), with the event
// id and outcome applied. Empty when all holds.
func Check(res Result, spans []Span, relaySpans bool) string {
	var probs []string
	byName := map[string]Span{}
	for _, s := range spans {
		if s.TraceID != res.Writer.TraceID() {
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
		switch {
		case !ok:
			probs = append(probs, fmt.Sprintf("no relay span %q", res.RelaySpan))
		case rs.ParentSpanID != writer.SpanID || rs.Kind != trace.SpanKindProducer ||
			rs.Attributes["messaging.batch.message_count"] != "1":
			probs = append(probs, fmt.Sprintf("relay span %+v: want a producer span, child of the writer's %s, for one event", rs, writer.SpanID))
		}
		parent = rs.SpanID
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
