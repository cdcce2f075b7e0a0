package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"
)

// tracingResult is the relay's drain of one backlog whose rows all carry a
// sampled trace context, with relay spans off and on: the cost of the
// spans (issue 13: spans on within 5% of spans off).
type tracingResult struct {
	RowsPerTx int           `json:"rows_per_tx"`
	Events    int64         `json:"events"`
	Repeat    int           `json:"repeat"`
	OffRuns   []drainResult `json:"spans_off_runs"`
	OnRuns    []drainResult `json:"spans_on_runs"`
	Off       drainResult   `json:"spans_off"` // best run
	On        drainResult   `json:"spans_on"`  // best run
	// Ratio is On.Rate / Off.Rate.
	Ratio float64 `json:"on_off_ratio"`
	// SpansExported counts the spans the sink received in the best
	// spans-on run (decoded after the run, so the decoding costs the drain
	// nothing), LinksExported their links (the relay's batch spans link
	// each writer span: one per transaction here), ExportBytes their OTLP
	// request bytes.
	SpansExported int64 `json:"spans_exported"`
	LinksExported int64 `json:"links_exported"`
	ExportBytes   int64 `json:"export_bytes"`
}

// tracedLoad writes rows as bench_load does, each transaction's rows with
// one sampled W3C traceparent (one writer span per transaction).
func (db *benchDB) tracedLoad(ctx context.Context, events int64, perTx, aggs, pad int) (time.Duration, error) {
	start := time.Now()
	_, err := db.pool.Exec(ctx, "CALL bench_load(0, $1, $2, $3, $4, true)", events, perTx, aggs, pad)
	return time.Since(start), err
}

// otlpSink accepts OTLP/HTTP trace exports and answers them as a collector
// would, keeping the bodies to count their spans after the run.
type otlpSink struct {
	srv    *http.Server
	ln     net.Listener
	mu     sync.Mutex
	bodies [][]byte
	bytes  int64
}

func startSink() (*otlpSink, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &otlpSink{ln: ln}
	s.srv = &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		s.mu.Lock()
		s.bodies = append(s.bodies, b)
		s.bytes += int64(len(b))
		s.mu.Unlock()
		// An empty ExportTraceServiceResponse: every span accepted.
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.WriteHeader(http.StatusOK)
	})}
	go func() { _ = s.srv.Serve(ln) }()
	return s, nil
}

func (s *otlpSink) endpoint() string { return "http://" + s.ln.Addr().String() }

// take returns and forgets what was received: spans, their links and
// request bytes.
func (s *otlpSink) take() (spans, links, bytes int64, err error) {
	s.mu.Lock()
	bodies, n := s.bodies, s.bytes
	s.bodies, s.bytes = nil, 0
	s.mu.Unlock()
	for _, b := range bodies {
		var req coltracepb.ExportTraceServiceRequest
		if err := proto.Unmarshal(b, &req); err != nil {
			return 0, 0, 0, fmt.Errorf("sink: not an OTLP trace export: %w", err)
		}
		for _, rs := range req.ResourceSpans {
			for _, ss := range rs.ScopeSpans {
				spans += int64(len(ss.Spans))
				for _, sp := range ss.Spans {
					links += int64(len(sp.Links))
				}
			}
		}
	}
	return spans, links, n, nil
}

func (s *otlpSink) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = s.srv.Shutdown(ctx)
}

// tracingDrain loads a backlog of traced rows and drains it alternately
// with relay spans off and on (spans exported over OTLP/HTTP to a sink in
// this process that accepts and keeps them), keeping the best of each.
func tracingDrain(ctx context.Context, o *options, env *benchEnv, perTx int) (*tracingResult, error) {
	t := &tracingResult{RowsPerTx: perTx, Events: o.events, Repeat: max(1, o.repeat)}
	var slots []string
	for i := 1; i <= t.Repeat; i++ {
		slots = append(slots, fmt.Sprintf("off_%d", i), fmt.Sprintf("on_%d", i))
	}
	db, err := env.newDB(ctx, slots...)
	if err != nil {
		return nil, err
	}
	defer db.drop()
	logf("tracing %d rows/tx: loading %d events with a sampled traceparent", perTx, o.events)
	if _, err := db.tracedLoad(ctx, o.events, perTx, o.aggs, o.pad); err != nil {
		return nil, fmt.Errorf("load: %w", err)
	}
	sink, err := startSink()
	if err != nil {
		return nil, err
	}
	defer sink.close()
	on := *o
	on.relayConfig = "tracing:\n  relay_spans: true\n"
	on.relayEnv = append(append([]string(nil), o.relayEnv...),
		"OTEL_EXPORTER_OTLP_ENDPOINT="+sink.endpoint(), "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf")
	// profile names a drain's CPU profile (1 s from its first ack) when
	// --profile-dir is set.
	profile := func(spans string, i int) string {
		if o.profileDir == "" {
			return ""
		}
		return fmt.Sprintf("relay-tracing-%drows-spans-%s-%d.pprof", perTx, spans, i)
	}
	var bestSpans, bestLinks, bestBytes int64
	for i := 1; i <= t.Repeat; i++ {
		logf("tracing %d rows/tx: relay spans off (%d of %d)", perTx, i, t.Repeat)
		d, err := drainRelay(ctx, o, env, db, fmt.Sprintf("off_%d", i), o.events, profile("off", i), 1)
		if err != nil {
			return nil, err
		}
		t.OffRuns = append(t.OffRuns, d)
		logf("tracing %d rows/tx: relay spans on (%d of %d)", perTx, i, t.Repeat)
		if d, err = drainRelay(ctx, &on, env, db, fmt.Sprintf("on_%d", i), o.events, profile("on", i), 1); err != nil {
			return nil, err
		}
		// The relay flushes its spans on exit, which drainRelay waited for.
		spans, links, n, err := sink.take()
		if err != nil {
			return nil, err
		}
		if spans == 0 {
			return nil, errors.New("relay spans on: the relay exported no spans (is tracing.relay_spans wired?)")
		}
		if d.Rate > best(t.OnRuns).Rate {
			bestSpans, bestLinks, bestBytes = spans, links, n
		}
		t.OnRuns = append(t.OnRuns, d)
	}
	t.Off, t.On = best(t.OffRuns), best(t.OnRuns)
	t.Ratio = ratio(t.On.Rate, t.Off.Rate)
	t.SpansExported, t.LinksExported, t.ExportBytes = bestSpans, bestLinks, bestBytes
	return t, nil
}
