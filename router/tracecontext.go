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
// Route then copies them like any mapped column, and omits them when NULL
// or (unless named in the configuration) absent from the table.
func (p *plan) compileTrace(missing func(column, key string) int) {
	for _, th := range p.rule.trace {
		idx := p.rel.ColumnIndex(th.column)
		if th.explicit {
			idx = missing(th.column, "columns."+th.key)
		}
		if idx >= 0 {
			p.extras = append(p.extras, planExtra{idx: idx, column: th.column, header: th.header})
		}
	}
}
