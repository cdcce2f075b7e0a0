package outbox

import (
	"context"
	"fmt"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// DefaultTable is the table of sql/outbox.sql.
const DefaultTable = "outbox"

// Omit, as a Columns field, says the table has no such column.
const Omit = "-"

// Columns names the outbox table's columns. Empty fields take the names of
// sql/outbox.sql. AggregateType and OccurredAt may be Omit for a table
// without them (the relay then uses the table name as aggregate type, and
// has no occurred-at header).
type Columns struct {
	EventID          string
	AggregateType    string
	AggregateID      string
	AggregateVersion string
	EventType        string
	Payload          string
	OccurredAt       string
	// Traceparent and Tracestate hold the W3C trace context of the span
	// in Insert's ctx (see trace.go). Empty means "traceparent" and
	// "tracestate" if the table has them; Omit never writes them.
	Traceparent string
	Tracestate  string
}

func (c *Columns) setDefaults() {
	def := func(p *string, v string) {
		if *p == "" {
			*p = v
		}
	}
	def(&c.EventID, "event_id")
	def(&c.AggregateType, "aggregate_type")
	def(&c.AggregateID, "aggregate_id")
	def(&c.AggregateVersion, "aggregate_version")
	def(&c.EventType, "event_type")
	def(&c.Payload, "payload")
	def(&c.OccurredAt, "occurred_at")
	def(&c.Traceparent, DefaultTraceparentColumn)
	def(&c.Tracestate, DefaultTracestateColumn)
}

// Config configures a Writer.
type Config struct {
	// Table is the outbox table, optionally schema-qualified
	// ("events.outbox"). Default DefaultTable. It must be in the relay's
	// publication.
	Table string
	// Columns names the table's columns; see Columns.
	Columns Columns
}

// Writer inserts events into one outbox table. It is safe for concurrent
// use.
type Writer struct {
	cols Columns
	// stmts holds the INSERT for each combination of the optional values
	// (stmtAt, stmtTraceparent, stmtTracestate bits); "" where the table
	// has no such column.
	stmts [8]string
	table string
	trace traceColumns
}

// The bits of Writer.stmts' index.
const (
	stmtAt = 1 << iota
	stmtTraceparent
	stmtTracestate
)

// NewWriter returns a writer for cfg.Table. It checks the names only; a
// table or column that does not exist fails the first Insert.
func NewWriter(cfg Config) (*Writer, error) {
	if cfg.Table == "" {
		cfg.Table = DefaultTable
	}
	parts := strings.Split(cfg.Table, ".")
	if len(parts) > 2 {
		return nil, fmt.Errorf("%w: table %q: want table or schema.table", ErrInvalidConfig, cfg.Table)
	}
	for _, p := range parts {
		if p == "" {
			return nil, fmt.Errorf("%w: table %q has an empty name part", ErrInvalidConfig, cfg.Table)
		}
	}
	cols := cfg.Columns
	// Trace columns left empty are used only if the table has them.
	detect := cols.Traceparent == "" || cols.Tracestate == ""
	cols.setDefaults()
	for name, v := range map[string]string{"EventID": cols.EventID, "AggregateID": cols.AggregateID,
		"AggregateVersion": cols.AggregateVersion, "EventType": cols.EventType, "Payload": cols.Payload} {
		if v == Omit {
			return nil, fmt.Errorf("%w: column %s is required and cannot be omitted", ErrInvalidConfig, name)
		}
	}
	table := pgx.Identifier(parts).Sanitize()
	names := []string{cols.EventID, cols.AggregateID, cols.AggregateVersion, cols.EventType, cols.Payload}
	if cols.AggregateType != Omit {
		names = append(names, cols.AggregateType)
	}
	w := &Writer{cols: cols, table: table}
	for i := range w.stmts {
		all := names[:len(names):len(names)]
		for _, opt := range []struct {
			bit  int
			name string
		}{{stmtAt, cols.OccurredAt}, {stmtTraceparent, cols.Traceparent}, {stmtTracestate, cols.Tracestate}} {
			if i&opt.bit == 0 {
				continue
			}
			if opt.name == Omit {
				all = nil
				break
			}
			all = append(all, opt.name)
		}
		if all != nil {
			w.stmts[i] = insertSQL(table, all)
		}
	}
	w.trace.detect = detect
	w.trace.has[0], w.trace.has[1] = cols.Traceparent != Omit, cols.Tracestate != Omit
	w.trace.auto[0], w.trace.auto[1] = cfg.Columns.Traceparent == "", cfg.Columns.Tracestate == ""
	return w, nil
}

func insertSQL(table string, cols []string) string {
	quoted := make([]string, len(cols))
	params := make([]string, len(cols))
	for i, c := range cols {
		quoted[i] = pgx.Identifier{c}.Sanitize()
		params[i] = fmt.Sprintf("$%d", i+1)
	}
	return fmt.Sprintf("INSERT INTO %s (%s) VALUES (%s)", table, strings.Join(quoted, ", "), strings.Join(params, ", "))
}

// Insert validates ev and inserts it into the outbox table through tx, so
// that it commits or rolls back with the caller's business change. It
// returns the event id (generated when ev.ID is zero). The caller commits.
func (w *Writer) Insert(ctx context.Context, tx pgx.Tx, ev Event) (uuid.UUID, error) {
	p, err := prepare(&ev)
	if err != nil {
		return uuid.Nil, err
	}
	args := []any{p.id.String(), ev.AggregateID, ev.AggregateVersion, ev.Type, string(p.payload)}
	switch {
	case w.cols.AggregateType != Omit:
		args = append(args, ev.AggregateType)
	case ev.AggregateType != "":
		return uuid.Nil, &FieldError{Field: "AggregateType", Reason: "is set but the table has no aggregate type column"}
	}
	stmt := 0
	if !ev.OccurredAt.IsZero() {
		if w.cols.OccurredAt == Omit {
			return uuid.Nil, &FieldError{Field: "OccurredAt", Reason: "is set but the table has no occurred-at column"}
		}
		stmt, args = stmtAt, append(args, ev.OccurredAt)
	}
	bits, targs, err := w.traceArgs(ctx, tx)
	if err != nil {
		return uuid.Nil, err
	}
	stmt |= bits
	if _, err := tx.Exec(ctx, w.stmts[stmt], append(args, targs...)...); err != nil {
		return uuid.Nil, fmt.Errorf("insert %s event %s into the outbox: %w", ev.Type, p.id, err)
	}
	return p.id, nil
}
