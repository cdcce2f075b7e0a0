package reconcile

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

// DB is what reconcile and cleanup need of a database; *pgxpool.Pool
// implements it.
type DB interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Table is an outbox table's router mapping resolved against the catalog:
// the columns pgoutput sends, in its order, and the SQL to select rows by
// time and event id.
type Table struct {
	// Config is the table's validated router configuration.
	Config router.TableConfig
	// Qualified is schema.table, as in the Outbox-Table header.
	Qualified string
	// Relation has the columns pgoutput sends for the table (not dropped,
	// not generated), in attribute order.
	Relation *replication.Relation
	// Ident is the quoted schema-qualified name for SQL.
	Ident string
	// EventID and Time are the quoted event id and occurred-at columns.
	EventID, Time string
	// EventIDType is the event id column's SQL type, e.g. uuid.
	EventIDType string
	// StateColumn is the quoted publish_state column, empty if absent.
	StateColumn string

	aggType     string // SQL expression for the aggregate type
	aggID       string
	version     string
	columnTypes []string
}

// Tableless returns the message prefixes of cfg (cfg.Messages): their
// events have no row to compare with or delete.
func Tableless(cfg router.Config) []string {
	if len(cfg.Messages) == 0 {
		return nil
	}
	return cfg.MessagePrefixes()
}

// LoadTables resolves every table of cfg (validated here, on a copy) against
// the catalog. A table without an occurred-at column fails with
// ErrNoTimeColumn, a missing table with ErrTableMissing.
func LoadTables(ctx context.Context, db DB, cfg router.Config) ([]*Table, error) {
	cfg = cfg.Clone()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	out := make([]*Table, 0, len(cfg.Tables))
	for i, tc := range cfg.Tables {
		t, err := loadTable(ctx, db, tc, fmt.Sprintf("tables[%d]", i))
		if err != nil {
			return nil, err
		}
		out = append(out, t)
	}
	return out, nil
}

func loadTable(ctx context.Context, db DB, tc router.TableConfig, path string) (*Table, error) {
	schema, name, _ := strings.Cut(tc.Table, ".")
	t := &Table{
		Config:    tc,
		Qualified: tc.Table,
		Ident:     pgx.Identifier{schema, name}.Sanitize(),
	}
	var regclass *uint32
	err := db.QueryRow(ctx, "SELECT to_regclass($1)::oid", t.Ident).Scan(&regclass)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("look up table %s: %w", tc.Table, err)
	}
	if regclass == nil {
		return nil, fmt.Errorf("%w: %s (create it or fix %s.table)", ErrTableMissing, tc.Table, path)
	}
	// pgoutput sends the columns that are not dropped and not generated,
	// in attribute order: the router's column positions depend on it.
	rows, err := db.Query(ctx, `
SELECT attname, atttypid, format_type(atttypid, atttypmod)
FROM pg_attribute
WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped AND attgenerated = ''
ORDER BY attnum`, *regclass)
	if err != nil {
		return nil, fmt.Errorf("read columns of %s: %w", tc.Table, err)
	}
	rel := &replication.Relation{ID: *regclass, Namespace: schema, Name: name}
	for rows.Next() {
		var c replication.Column
		var typ string
		if err := rows.Scan(&c.Name, &c.TypeOID, &typ); err != nil {
			rows.Close()
			return nil, fmt.Errorf("read columns of %s: %w", tc.Table, err)
		}
		rel.Columns = append(rel.Columns, c)
		t.columnTypes = append(t.columnTypes, typ)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read columns of %s: %w", tc.Table, err)
	}
	t.Relation = rel

	col := func(name, key string) (string, int, error) {
		i := rel.ColumnIndex(name)
		if i < 0 {
			return "", -1, fmt.Errorf("%w: %s has no column %q (fix %s.columns.%s)", ErrInvalidConfig, tc.Table, name, path, key)
		}
		return pgx.Identifier{name}.Sanitize(), i, nil
	}
	var idx int
	if t.EventID, idx, err = col(tc.Columns.EventID, "event_id"); err != nil {
		return nil, err
	}
	t.EventIDType = t.columnTypes[idx]
	if t.aggID, _, err = col(tc.Columns.AggregateID, "aggregate_id"); err != nil {
		return nil, err
	}
	if t.version, _, err = col(tc.Columns.AggregateVersion, "aggregate_version"); err != nil {
		return nil, err
	}
	timeCol := tc.Columns.OccurredAt
	if timeCol == "" {
		timeCol = router.DefaultOccurredAtColumn
	}
	if i := rel.ColumnIndex(timeCol); i < 0 {
		return nil, fmt.Errorf("%w: %s has no column %q; reconcile and cleanup select rows by the time the Outbox-Occurred-At header carries (add the column or name it in %s.columns.occurred_at)", ErrNoTimeColumn, tc.Table, timeCol, path)
	} else if typ := t.columnTypes[i]; !strings.HasPrefix(typ, "timestamp") {
		return nil, fmt.Errorf("%w: %s.%s is %s, not a timestamp", ErrNoTimeColumn, tc.Table, timeCol, typ)
	}
	t.Time = pgx.Identifier{timeCol}.Sanitize()
	if i := rel.ColumnIndex("publish_state"); i >= 0 {
		t.StateColumn = pgx.Identifier{"publish_state"}.Sanitize()
	}

	// The aggregate type as the router computes it: the table's constant,
	// else the column's non-empty value, else the table name ($1).
	switch {
	case tc.AggregateType != "":
		t.aggType = quoteLiteral(tc.AggregateType)
	default:
		name := tc.Columns.AggregateType
		if name == "" {
			name = router.DefaultAggregateTypeColumn
		}
		if rel.ColumnIndex(name) >= 0 {
			t.aggType = fmt.Sprintf("COALESCE(NULLIF(%s::text, ''), %s)", pgx.Identifier{name}.Sanitize(), quoteLiteral(rel.Name))
		} else if tc.Columns.AggregateType != "" {
			return nil, fmt.Errorf("%w: %s has no column %q (fix %s.columns.aggregate_type)", ErrInvalidConfig, tc.Table, name, path)
		} else {
			t.aggType = quoteLiteral(rel.Name)
		}
	}
	return t, nil
}

// IDIn returns a condition matching the rows whose event id is in the
// text[] parameter param. For uuid and text ids it compares in the column's
// type, so the column's index is used; other types compare as text.
func (t *Table) IDIn(param string) string {
	switch t.EventIDType {
	case "uuid", "text", "character varying":
		return fmt.Sprintf("%s = ANY(%s::text[]::%s[])", t.EventID, param, t.EventIDType)
	}
	if strings.HasPrefix(t.EventIDType, "character varying(") {
		// Without the length: a cast to varchar(n) would truncate a long
		// id into one that may match another row.
		return fmt.Sprintf("%s = ANY(%s::text[]::character varying[])", t.EventID, param)
	}
	return fmt.Sprintf("%s::text = ANY(%s::text[])", t.EventID, param)
}

// ValidID reports whether id can be an event id of the table: an id that
// is not a UUID cannot be in a uuid column (and would fail the cast).
func (t *Table) ValidID(id string) bool {
	if t.EventIDType == "uuid" {
		return uuid.Validate(id) == nil
	}
	return true
}

// quoteLiteral quotes s as an SQL string literal (standard_conforming_strings
// is on in every supported PostgreSQL).
func quoteLiteral(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}
