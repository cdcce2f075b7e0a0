package router

import (
	"errors"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/replication"
)

const (
	testTraceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	testTracestate  = "vendor=abc"
)

// The trace context columns become the traceparent and tracestate headers
// by default; a table without them, or a NULL, routes as before.
func TestRouteTraceContext(t *testing.T) {
	traced := append(append([]string{}, seedColumns...), "traceparent", "tracestate")
	base := func() nats.Header {
		return nats.Header{
			contract.MsgID: {testEventID}, contract.EventID: {testEventID},
			contract.EventType: {"RegistrationConfirmed"}, contract.AggregateType: {"outbox"},
			contract.AggregateID: {"r-1"}, contract.AggregateVersion: {"7"},
			contract.OccurredAt: {"2026-11-29T09:35:21.123456Z"}, contract.CommitLSN: {"0/16B37A0"},
			contract.CommitTime: {"2026-11-29T09:35:22.5Z"}, contract.Table: {"public.outbox"},
			contract.ContentType: {"application/json"},
		}
	}
	with := func(kv ...string) nats.Header {
		h := base()
		for i := 0; i < len(kv); i += 2 {
			h[kv[i]] = []string{kv[i+1]}
		}
		return h
	}
	for _, tc := range []struct {
		name string
		cols []string
		tc   TableConfig
		row  map[string]replication.Value
		want nats.Header
	}{
		{name: "both columns", cols: traced,
			row:  map[string]replication.Value{"traceparent": txt(testTraceparent), "tracestate": txt(testTracestate)},
			want: with(TraceparentHeader, testTraceparent, TracestateHeader, testTracestate)},
		{name: "tracestate NULL", cols: traced,
			row:  map[string]replication.Value{"traceparent": txt(testTraceparent)},
			want: with(TraceparentHeader, testTraceparent)},
		{name: "both NULL", cols: traced, want: base()},
		{name: "table without the columns", cols: seedColumns, want: base()},
		{name: "off", cols: traced, tc: TableConfig{Columns: ColumnsConfig{Traceparent: TraceOff, Tracestate: TraceOff}},
			row:  map[string]replication.Value{"traceparent": txt(testTraceparent), "tracestate": txt(testTracestate)},
			want: base()},
		{name: "named column", cols: append(append([]string{}, seedColumns...), "trace_parent"),
			tc:   TableConfig{Columns: ColumnsConfig{Traceparent: "trace_parent"}},
			row:  map[string]replication.Value{"trace_parent": txt(testTraceparent)},
			want: with(TraceparentHeader, testTraceparent)},
		{name: "mapped by hand keeps its mapping", cols: append(append([]string{}, seedColumns...), "tp"),
			tc:   TableConfig{Headers: map[string]string{"tp": "traceparent"}},
			row:  map[string]replication.Value{"tp": txt(testTraceparent)},
			want: with(TraceparentHeader, testTraceparent)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.tc
			cfg.Table = "outbox"
			r := mustNew(t, Config{Tables: []TableConfig{cfg}})
			rel := newRelation(1, "public", "outbox", tc.cols...)
			row := seedRow()
			for k, v := range tc.row {
				row[k] = v
			}
			routeTwice(t, r, newInsert(rel, row), tc.want)
		})
	}

	// A column named in the configuration must exist.
	r := mustNew(t, Config{Tables: []TableConfig{{Table: "outbox", Columns: ColumnsConfig{Tracestate: "ts"}}}})
	_, err := r.Route(newInsert(newRelation(1, "public", "outbox", seedColumns...), seedRow()), testCommit)
	var re *RouteError
	if !errors.As(err, &re) || re.Class != ClassMissingColumn || re.Column != "ts" {
		t.Fatalf("named column missing: %v, want %s for column ts", err, ClassMissingColumn)
	}
}

func TestTraceContextConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		tc   TableConfig
		path string
	}{
		{"named and mapped by hand", TableConfig{Table: "outbox", Columns: ColumnsConfig{Traceparent: "tp"},
			Headers: map[string]string{"tp2": "Traceparent"}}, "tables[0].columns.traceparent"},
		{"name too long", TableConfig{Table: "outbox", Columns: ColumnsConfig{Tracestate: string(make([]byte, 64))}}, "tables[0].columns.tracestate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{Tables: []TableConfig{tc.tc}}
			err := cfg.Validate()
			var ce *ConfigError
			if !errors.As(err, &ce) || ce.Path != tc.path {
				t.Fatalf("Validate = %v, want an error at %s", err, tc.path)
			}
		})
	}
}

// routeTwice routes ins twice (the router's per-relation and per-commit
// caches must give the same headers), and checks the headers and
// HeaderLen against what nats.go encodes.
func routeTwice(t *testing.T, r *Router, ins *replication.Insert, want nats.Header) {
	t.Helper()
	for i := 0; i < 2; i++ {
		m, err := r.Route(ins, testCommit)
		if err != nil {
			t.Fatalf("Route: %v", err)
		}
		checkHeaders(t, m.Header.NATS(), want)
		nm := &nats.Msg{Subject: m.Subject, Header: m.Header.NATS(), Data: m.Data}
		if hdr := nm.Size() - len(nm.Subject) - len(nm.Data); m.HeaderLen != hdr {
			t.Fatalf("HeaderLen %d, nats.go encodes %d bytes of headers", m.HeaderLen, hdr)
		}
	}
}

// Regression (issue 25): a trace context value no header can carry (a line
// break, 70 KB, surrounding whitespace) dead-lettered the whole event as
// invalid_field or header_too_large. Tracing is advisory: the bad header
// is dropped and counted, surrounding spaces trimmed, the event relayed.
func TestRouteBadTraceContextKeepsTheEvent(t *testing.T) {
	traced := append(append([]string{}, seedColumns...), "traceparent", "tracestate")
	long := make([]byte, 70<<10)
	for i := range long {
		long[i] = 'a'
	}
	for _, tc := range []struct {
		name        string
		parent      string
		state       string
		wantParent  string // "" : no header
		wantState   string
		wantDropped uint64
	}{
		{name: "CR LF in traceparent", parent: testTraceparent + "\r\nX-Evil: 1", state: testTracestate, wantState: testTracestate, wantDropped: 1},
		{name: "LF in tracestate", parent: testTraceparent, state: "a=b\nc=d", wantParent: testTraceparent, wantDropped: 1},
		{name: "70 KB tracestate", parent: testTraceparent, state: string(long), wantParent: testTraceparent, wantDropped: 1},
		{name: "surrounding whitespace trimmed", parent: " " + testTraceparent + "\t", state: "  " + testTracestate + " ",
			wantParent: testTraceparent, wantState: testTracestate},
		{name: "blank", parent: "   ", state: testTracestate, wantState: testTracestate, wantDropped: 1},
		{name: "both bad", parent: "\r\n", state: string(long), wantDropped: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := mustNew(t, Config{Tables: []TableConfig{{Table: "outbox"}}})
			row := seedRow()
			row["traceparent"], row["tracestate"] = txt(tc.parent), txt(tc.state)
			m, err := r.Route(newInsert(newRelation(1, "public", "outbox", traced...), row), testCommit)
			if err != nil {
				t.Fatalf("Route: %v, want the event relayed without the bad trace header", err)
			}
			for _, h := range []struct{ name, want string }{{TraceparentHeader, tc.wantParent}, {TracestateHeader, tc.wantState}} {
				if got := m.Header.Get(h.name); got != h.want {
					t.Errorf("%s header %q, want %q", h.name, got, h.want)
				}
			}
			if got := r.TraceHeadersDropped(); got != tc.wantDropped {
				t.Errorf("TraceHeadersDropped %d, want %d", got, tc.wantDropped)
			}
			nm := &nats.Msg{Subject: m.Subject, Header: m.Header.NATS(), Data: m.Data}
			if hdr := nm.Size() - len(nm.Subject) - len(nm.Data); m.HeaderLen != hdr {
				t.Fatalf("HeaderLen %d, nats.go encodes %d bytes of headers", m.HeaderLen, hdr)
			}
		})
	}
}
