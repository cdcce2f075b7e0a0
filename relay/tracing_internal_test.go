package relay

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

// testSpans is a batchSpans on an in-memory exporter, with the wake times
// it asked for.
func testSpans(t *testing.T) (*batchSpans, *tracetest.InMemoryExporter, *[]time.Time) {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(t.Context()) })
	var wakes []time.Time
	o := options{}
	if err := WithTracerProvider(tp)(&o); err != nil {
		t.Fatal(err)
	}
	return newBatchSpans(o.tracer, "OUTBOX", func(at time.Time) { wakes = append(wakes, at) }, nil, nil), exp, &wakes
}

// traced is a routed row with traceparent tp, committed at lsn.
func traced(tp string, lsn replication.LSN) *outbound {
	var h contract.Headers
	if tp != "" {
		h = contract.Headers{{Name: router.TraceparentHeader, Value: tp}}
	}
	return &outbound{rm: &router.Message{Header: h, Table: "public.outbox", Commit: router.CommitInfo{LSN: lsn}}}
}

// writerTP is a sampled traceparent naming writer span i.
func writerTP(i int) string {
	return fmt.Sprintf("00-4bf92f3577b34da6a3ce929d0e0e4736-%016x-01", i+1)
}

// TestRelaySpanOnlyForSampledTraces: a row whose writer trace is sampled
// joins a batch span linked to the writer span and keeps its traceparent;
// one that is not sampled (flags 00), or is invalid, joins none, and a
// batch of such rows makes no span.
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
		{"none", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, exp, _ := testSpans(t)
			out := traced(tc.traceparent, 0x100)
			b.join(out)
			if got := out.rm.Header.Get(router.TraceparentHeader); got != tc.traceparent {
				t.Fatalf("traceparent %q, want the writer's %q unchanged", got, tc.traceparent)
			}
			if (out.span != nil) != tc.span {
				t.Fatalf("joined a span: %v, want %v", out.span != nil, tc.span)
			}
			b.close()
			out.endSpan(publisher.Result{Attempts: 1})
			spans := exp.GetSpans()
			if !tc.span {
				if len(spans) != 0 {
					t.Fatalf("%d spans exported, want none", len(spans))
				}
				return
			}
			if len(spans) != 1 {
				t.Fatalf("%d spans exported, want 1", len(spans))
			}
			s := spans[0]
			if s.Parent.IsValid() || s.SpanKind != trace.SpanKindProducer || len(s.Links) != 1 ||
				s.Links[0].SpanContext.SpanID().String() != "00f067aa0ba902b7" || s.Name != "publish OUTBOX" {
				t.Fatalf("span %+v: want a producer root span, publish OUTBOX, linked to the writer span", s)
			}
		})
	}
}

// TestWriterContextAsExtract: the in-place reading of a traceparent gives
// what the propagator's Extract gives, for the common form and the others.
func TestWriterContextAsExtract(t *testing.T) {
	const ok = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	for _, tc := range []struct{ name, tp, state string }{
		{"sampled", ok, ""},
		{"not sampled", ok[:53] + "00", ""},
		{"random flag", ok[:53] + "03", ""},
		{"reserved flag", ok[:53] + "04", ""},
		{"upper-case hex", strings.ToUpper(ok[:35]) + ok[35:], ""},
		{"zero trace id", "00-00000000000000000000000000000000-00f067aa0ba902b7-01", ""},
		{"zero span id", ok[:36] + "0000000000000000-01", ""},
		{"version 01 with more", "01" + ok[2:] + "-extra", ""},
		{"version ff", "ff" + ok[2:], ""},
		{"extra field in 00", ok + "-extra", ""},
		{"non-hex", ok[:10] + "zz" + ok[12:], ""},
		{"tracestate", ok, "vendor=abc,other=1"},
		{"invalid tracestate", ok, "=,=="},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := contract.Headers{{Name: router.TraceparentHeader, Value: tc.tp}}
			if tc.state != "" {
				h = append(h, contract.HeaderField{Name: router.TracestateHeader, Value: tc.state})
			}
			m := &router.Message{Header: h}
			want := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), headerGetter{m}))
			if got := writerContext(m, tc.tp, tc.state); !got.Equal(want) {
				t.Fatalf("writerContext %+v, Extract %+v", got, want)
			}
		})
	}
}

// TestBatchSpanLinks: the rows of many writer spans share batch spans of
// at most maxBatchLinks links, each writer span linked once per batch
// however many of its rows the batch has.
func TestBatchSpanLinks(t *testing.T) {
	b, exp, wakes := testSpans(t)
	var outs []*outbound
	add := func(o *outbound) {
		b.join(o)
		outs = append(outs, o)
	}
	// 300 one-row transactions, each its own writer span (no commit()
	// calls: a slow machine must not close batches by time here).
	for i := range 300 {
		add(traced(writerTP(i), replication.LSN(0x1000+i)))
	}
	// One transaction of 100 rows of one writer span, then one whose
	// rows alternate between two writer spans (nested spans writing).
	for range 100 {
		add(traced(writerTP(1000), 0x9000))
	}
	for i := range 10 {
		add(traced(writerTP(2000+i%2), 0x9100))
	}
	add(traced(writerTP(3000)[:len(writerTP(3000))-2]+"00", 0x9200)) // not sampled
	b.close()
	if n := len(exp.GetSpans()); n != 0 {
		t.Fatalf("%d spans ended before their rows were acked", n)
	}
	for _, o := range outs {
		o.endSpan(publisher.Result{Attempts: 1})
	}
	spans := exp.GetSpans()
	if len(spans) != 3 || len(*wakes) != 3 {
		t.Fatalf("%d spans (%d wakes asked for), want 3: 128 + 128 + 44 + 3 links", len(spans), len(*wakes))
	}
	links := map[trace.SpanID]int{}
	rows := 0
	for _, s := range spans {
		if len(s.Links) > maxBatchLinks {
			t.Errorf("span with %d links, over %d", len(s.Links), maxBatchLinks)
		}
		for _, l := range s.Links {
			links[l.SpanContext.SpanID()]++
		}
		for _, kv := range s.Attributes {
			if kv.Key == "messaging.batch.message_count" {
				rows += int(kv.Value.AsInt64())
			}
		}
	}
	if len(links) != 303 || rows != 410 {
		t.Fatalf("%d writer spans linked, %d rows covered: want 303 and 410", len(links), rows)
	}
	for id, n := range links {
		if n != 1 {
			t.Errorf("writer span %s linked %d times, want once", id, n)
		}
	}
	want := map[string]string{"outbox.batch.transactions": "46", "messaging.batch.message_count": "154",
		"outbox.commit_lsn.first": replication.LSN(0x1000 + 256).String(), "outbox.commit_lsn.last": replication.LSN(0x9100).String()}
	for _, kv := range spans[2].Attributes {
		if w, ok := want[string(kv.Key)]; ok && kv.Value.String() != w {
			t.Errorf("last batch: %s = %s, want %s", kv.Key, kv.Value.String(), w)
		}
		delete(want, string(kv.Key))
	}
	if len(want) != 0 {
		t.Errorf("last batch: attributes %v missing", want)
	}
}

// TestBatchSpanCloses: a batch takes rows until the first commit after
// maxBatchOpen, asking the stream to wake the pipeline then.
func TestBatchSpanCloses(t *testing.T) {
	b, exp, wakes := testSpans(t)
	o := traced(writerTP(1), 0x100)
	b.join(o)
	if len(*wakes) != 1 || !(*wakes)[0].Equal(b.opened.Add(maxBatchOpen)) {
		t.Fatalf("wakes %v, want one at the batch's opening + %s", *wakes, maxBatchOpen)
	}
	b.commit()
	if b.open == nil {
		t.Fatal("a young batch closed at commit")
	}
	o.endSpan(publisher.Result{Attempts: 1})
	if len(exp.GetSpans()) != 0 {
		t.Fatal("the span ended while its batch was open")
	}
	b.opened = b.opened.Add(-maxBatchOpen)
	b.commit()
	if b.open != nil || len(exp.GetSpans()) != 1 {
		t.Fatalf("batch open %v, %d spans: want closed at the commit after %s and ended (its row was acked)", b.open != nil, len(exp.GetSpans()), maxBatchOpen)
	}
}

// TestBatchSpanOpenThroughABacklog: past maxBatchOpen a batch stays open
// while the stream is reading a backlog, and closes once it is not; from
// maxBatchAge on a commit closes it whatever the stream says.
//
//   - More waiting to be read (the relay is scheduled slower than the
//     walsender sends): a commit keeps the batch open and asks again for a
//     Wake at opening + maxBatchOpen, a time already past, which the stream
//     gives as soon as nothing waits; a commit with nothing waiting closes.
//   - Behind the WAL the server had when the stream started, nothing
//     waiting (a walsender short of CPU sends the backlog slower than the
//     relay reads it): neither a commit nor a Wake between transactions
//     closes the batch, and the Wake asked for is at maxBatchAge (at
//     maxBatchOpen, already past, it would come at once, again and again);
//     a Wake once the stream has caught up closes it.
func TestBatchSpanOpenThroughABacklog(t *testing.T) {
	for _, tc := range []struct {
		name   string
		behind bool          // behind the start; otherwise more waiting
		wakeAt time.Duration // the Wake asked for, after opening
	}{
		{"more waiting", false, maxBatchOpen},
		{"behind the start", true, maxBatchAge},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, exp, wakes := testSpans(t)
			backlog := true
			b.pending = func() bool { return backlog && !tc.behind }
			b.behind = func() bool { return backlog && tc.behind }
			// end is what closes the batch once the backlog is read.
			end := b.commit
			if tc.behind {
				end = b.quiet
			}
			var outs []*outbound
			for i := range 3 {
				o := traced(writerTP(i), replication.LSN(0x100+i))
				b.join(o)
				outs = append(outs, o)
				b.opened = b.opened.Add(-maxBatchOpen) // the commit comes maxBatchOpen later
				b.commit()
				if tc.behind {
					b.quiet() // a Wake between transactions: nothing is waiting
				}
				if b.open == nil {
					t.Fatalf("row %d, %s after the batch opened: closed during the backlog", i, time.Since(b.opened).Round(time.Millisecond))
				}
				if last := (*wakes)[len(*wakes)-1]; !last.Equal(b.opened.Add(tc.wakeAt)) {
					t.Fatalf("row %d: last Wake asked for at %s after opening, want %s", i, last.Sub(b.opened), tc.wakeAt)
				}
			}
			backlog = false
			end()
			if b.open != nil {
				t.Fatal("the batch stayed open once the backlog was read")
			}
			for _, o := range outs {
				o.endSpan(publisher.Result{Attempts: 1})
			}
			if spans := exp.GetSpans(); len(spans) != 1 || len(spans[0].Links) != 3 {
				t.Fatalf("%d spans, want one linking the 3 writer spans", len(spans))
			}

			backlog = true
			o := traced(writerTP(3), 0x200)
			b.join(o)
			b.opened = b.opened.Add(-maxBatchAge)
			b.commit()
			if b.open != nil {
				t.Fatalf("a batch open for %s stayed open at a commit: a backlog must not keep it longer than %s", time.Since(b.opened).Round(time.Millisecond), maxBatchAge)
			}
			o.endSpan(publisher.Result{Attempts: 1})
			if n := len(exp.GetSpans()); n != 2 {
				t.Fatalf("%d spans, want 2", n)
			}
		})
	}
}

// TestBatchSpanDeadLettered: a dead-lettered row marks its batch span's
// status with the reason; the span ends with the last row's settlement.
func TestBatchSpanDeadLettered(t *testing.T) {
	b, exp, _ := testSpans(t)
	ok, bad := traced(writerTP(1), 0x100), traced(writerTP(2), 0x200)
	b.join(ok)
	b.join(bad)
	b.close()
	bad.endSpan(publisher.Result{DeadLettered: true, Reason: errors.New("maximum message payload exceeded")})
	if len(exp.GetSpans()) != 0 {
		t.Fatal("the span ended before all its rows were settled")
	}
	ok.endSpan(publisher.Result{Attempts: 1})
	spans := exp.GetSpans()
	if len(spans) != 1 || spans[0].Status.Code != codes.Error || spans[0].Status.Description != "dead-lettered: maximum message payload exceeded" {
		t.Fatalf("spans %+v: want one, status error naming the dead letter's reason", spans)
	}
}

// BenchmarkBatchSpanJoin is the pipeline's cost per row at 1 row per
// transaction, every row its own sampled writer span: parse, link, and a
// span started per maxBatchLinks rows (recorded by the SDK, not exported).
func BenchmarkBatchSpanJoin(b *testing.B) {
	tp := sdktrace.NewTracerProvider()
	defer func() { _ = tp.Shutdown(b.Context()) }()
	bs := newBatchSpans(tp.Tracer(TracerName), "OUTBOX", nil, nil, nil)
	outs := make([]*outbound, 4096)
	for i := range outs {
		outs[i] = traced(writerTP(i), replication.LSN(0x1000+i))
	}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		o := outs[i%len(outs)]
		bs.join(o)
		o.endSpan(publisher.Result{Attempts: 1})
	}
	bs.close()
}
