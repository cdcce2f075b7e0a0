package router

import "strings"

// The W3C Trace Context headers (https://www.w3.org/TR/trace-context/),
// lower case as the specification writes them and OpenTelemetry's
// propagator reads them from a NATS header.
const (
	TraceparentHeader = "traceparent"
	TracestateHeader  = "tracestate"
)

// Default trace context columns: sql/outbox.sql's, which outbox.Writer
// fills from the writer's span.
const (
	DefaultTraceparentColumn = "traceparent"
	DefaultTracestateColumn  = "tracestate"
)

// TraceOff, as columns.traceparent or columns.tracestate, maps no column to
// the header.
const TraceOff = "-"

// traceHeader maps a trace context column to its header. Unless the
// configuration named the column, a table without it simply has no such
// header: tables created before the columns existed relay as before.
type traceHeader struct {
	key      string // YAML key under columns
	column   string
	header   string
	explicit bool
}

// compileTrace returns the trace context headers of a table. A header an
// extra column already maps (byName, lower-case header → column: mapped by
// hand before the default existed) keeps that mapping.
func compileTrace(col *ColumnsConfig, byName map[string]string, bad func(key, format string, args ...any)) []traceHeader {
	var out []traceHeader
	for _, f := range []struct {
		key, header, def string
		val              string
	}{
		{"traceparent", TraceparentHeader, DefaultTraceparentColumn, col.Traceparent},
		{"tracestate", TracestateHeader, DefaultTracestateColumn, col.Tracestate},
	} {
		th := traceHeader{key: f.key, column: f.val, header: f.header, explicit: f.val != ""}
		switch {
		case f.val == TraceOff:
			continue
		case len(f.val) > maxIdentifierBytes:
			bad(".columns."+f.key, "%q is longer than %d bytes, so no PostgreSQL column can have that name", f.val, maxIdentifierBytes)
			continue
		case f.val == "":
			th.column = f.def
		}
		if other, mapped := byName[strings.ToLower(f.header)]; mapped {
			if th.explicit {
				bad(".columns."+f.key, "is set, but headers.%s also maps a column to the %s header (remove one)", other, f.header)
			}
			continue
		}
		out = append(out, th)
	}
	return out
}

// compileTrace adds the plan's trace context headers to its extra headers:
// Route then copies them like any mapped column, and omits them when NULL,
// (unless named in the configuration) absent from the table, or unfit for
// a header (traceValue).
func (p *plan) compileTrace(missing func(column, key string) int) {
	for _, th := range p.rule.trace {
		idx := p.rel.ColumnIndex(th.column)
		if th.explicit {
			idx = missing(th.column, "columns."+th.key)
		}
		if idx >= 0 {
			p.extras = append(p.extras, planExtra{idx: idx, column: th.column, header: th.header, trace: true})
		}
	}
}

// MaxTraceValueBytes bounds a trace context header the router copies: the
// specification asks propagators to carry at least 512 characters of
// tracestate and lets them drop longer ones; a traceparent is 55.
const MaxTraceValueBytes = 512

// traceValue returns the header value of a trace context column, or nil
// when no header can carry it (a line break or another control character,
// over MaxTraceValueBytes, blank). Tracing is advisory: such a value costs
// the event its trace header, counted in TraceHeadersDropped, never the
// event itself, which a field check would dead-letter. Surrounding spaces
// and tabs, which the specification allows around list members and NATS
// would not keep, are trimmed.
func traceValue(b []byte) []byte {
	for len(b) > 0 && isSpaceTab(b[0]) {
		b = b[1:]
	}
	for len(b) > 0 && isSpaceTab(b[len(b)-1]) {
		b = b[:len(b)-1]
	}
	if len(b) == 0 || len(b) > MaxTraceValueBytes {
		return nil
	}
	for _, c := range b {
		if c < 0x20 || c == 0x7f {
			return nil
		}
	}
	return b
}

// TraceHeadersDropped returns how many trace context values the router
// has left off their events because no header could carry them.
func (r *Router) TraceHeadersDropped() uint64 { return r.traceDropped.Load() }
