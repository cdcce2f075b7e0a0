package outbox

import (
	"context"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Default names of the trace context columns of sql/outbox.sql.
const (
	DefaultTraceparentColumn = "traceparent"
	DefaultTracestateColumn  = "tracestate"
)

// traceColumns says which trace context columns Insert writes. Columns the
// configuration did not name are looked up once, on the first Insert whose
// ctx carries a span, so that one Writer serves tables created before the
// columns existed (a column added later is seen after a restart).
type traceColumns struct {
	// auto marks the columns (0: traceparent, 1: tracestate) that are used
	// only if the table has them; detect is set when any is.
	auto   [2]bool
	detect bool

	mu    sync.Mutex
	known bool    // has is final (looked up, or nothing to look up)
	has   [2]bool // the column is written
}

// columns returns which trace columns the table has, looking them up
// through tx the first time.
func (c *traceColumns) columns(ctx context.Context, tx pgx.Tx, table string, names [2]string) ([2]bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.known || !c.detect {
		return c.has, nil
	}
	var found [2]bool
	err := tx.QueryRow(ctx, `SELECT coalesce(bool_or(attname = $2), false), coalesce(bool_or(attname = $3), false)
		FROM pg_attribute WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped`,
		table, names[0], names[1]).Scan(&found[0], &found[1])
	if err != nil {
		return c.has, fmt.Errorf("look up the trace context columns of %s: %w", table, err)
	}
	for i := range found {
		if c.auto[i] {
			c.has[i] = found[i]
		}
	}
	c.known = true
	return c.has, nil
}

// traceCarrier receives the W3C trace context headers of a span context.
type traceCarrier struct{ traceparent, tracestate string }

func (c *traceCarrier) Get(string) string { return "" }
func (c *traceCarrier) Keys() []string    { return nil }
func (c *traceCarrier) Set(key, value string) {
	switch key {
	case "traceparent":
		c.traceparent = value
	case "tracestate":
		c.tracestate = value
	}
}

// traceArgs returns the statement bits and values of the trace context of
// the span in ctx: none when ctx has no valid span context or the table no
// trace columns. The relay maps the columns to the traceparent and
// tracestate headers, so consumers continue the writer's trace.
func (w *Writer) traceArgs(ctx context.Context, tx pgx.Tx) (int, []any, error) {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return 0, nil, nil
	}
	has, err := w.trace.columns(ctx, tx, w.table, [2]string{w.cols.Traceparent, w.cols.Tracestate})
	if err != nil {
		return 0, nil, err
	}
	var c traceCarrier
	propagation.TraceContext{}.Inject(ctx, &c)
	bits, args := 0, make([]any, 0, 2)
	if has[0] && c.traceparent != "" {
		bits, args = bits|stmtTraceparent, append(args, c.traceparent)
	}
	if has[1] && c.tracestate != "" {
		bits, args = bits|stmtTracestate, append(args, c.tracestate)
	}
	return bits, args, nil
}
