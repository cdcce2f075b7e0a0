package replication

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// PublicationProbe is one look at the publication.
type PublicationProbe struct {
	// WAL is the server's WAL position read before the publication was
	// checked: when the check finds it right and unchanged since the
	// previous right one, nothing up to WAL was withheld by it.
	WAL LSN
	// Identity names the publication's definition as far as the relay's
	// tables go: the publication row's oid and version, and the oid and
	// version of each of its table and schema memberships. A table dropped
	// from the publication and added back, a publish option switched off
	// and on, a row filter set: each changes it, even when a later check
	// finds the publication right again.
	Identity string
	// Problem is the check's verdict (ErrPublicationMismatch,
	// ErrPublicationMissing or ErrTableMissing naming the fix), nil when
	// the publication is right.
	Problem error
}

// PublicationWatch probes the publication over a connection of its own,
// opened on first use and again after a failure. One goroutine at a time
// may use it.
type PublicationWatch struct {
	cfg  Config
	conn *pgx.Conn
}

// NewPublicationWatch returns a watch of cfg's publication; it connects on
// the first Probe.
func NewPublicationWatch(cfg Config) (*PublicationWatch, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	return &PublicationWatch{cfg: cfg}, nil
}

// IsPublicationProblem reports whether err is a verdict on the publication
// (a Problem of a probe, or CheckPublication's refusal) rather than a
// failure to check it.
func IsPublicationProblem(err error) bool {
	return errors.Is(err, ErrPublicationMismatch) || errors.Is(err, ErrPublicationMissing) || errors.Is(err, ErrTableMissing)
}

// Probe reads the WAL position, then checks the publication and reads its
// identity. An error means no verdict (the database unreachable, a
// standby): nothing may be concluded from it.
func (w *PublicationWatch) Probe(ctx context.Context) (PublicationProbe, error) {
	var p PublicationProbe
	if w.conn == nil || w.conn.IsClosed() {
		conn, err := connectSQL(ctx, w.cfg.URL)
		if err != nil {
			return p, err
		}
		w.conn = conn
	}
	p, err := probePublication(ctx, w.conn, w.cfg)
	if err != nil {
		// The connection may be broken half-way through a query: start
		// afresh next time.
		w.Close(context.Background())
	}
	return p, err
}

func probePublication(ctx context.Context, conn *pgx.Conn, cfg Config) (PublicationProbe, error) {
	var p PublicationProbe
	var wal string
	if err := conn.QueryRow(ctx, "SELECT "+CurrentLSN+"::text").Scan(&wal); err != nil {
		return p, fmt.Errorf("read the WAL position: %w", err)
	}
	lsn, err := parseLSN(wal)
	if err != nil {
		return p, err
	}
	p.WAL = lsn
	if err := checkPublication(ctx, conn, cfg); err != nil {
		if !IsPublicationProblem(err) {
			return p, err
		}
		p.Problem = err
		return p, nil
	}
	tables := make([]string, len(cfg.Tables))
	for i, t := range cfg.Tables {
		tables[i] = splitQualified(t).Sanitize()
	}
	// pg_publication_namespace (FOR TABLES IN SCHEMA) exists from
	// PostgreSQL 15; before, no schema is a member.
	schemas := "''"
	var version int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		return p, fmt.Errorf("read server version: %w", err)
	}
	if version >= 150000 {
		schemas = "coalesce((SELECT string_agg(n.oid::text || '.' || n.xmin::text, ',' ORDER BY n.oid) FROM pg_publication_namespace n WHERE n.pnpubid = p.oid), '')"
	}
	err = conn.QueryRow(ctx, `SELECT p.oid::text || '.' || p.xmin::text || '|' ||
	coalesce((SELECT string_agg(r.oid::text || '.' || r.xmin::text, ',' ORDER BY r.oid) FROM pg_publication_rel r
		WHERE r.prpubid = p.oid AND r.prrelid IN (SELECT to_regclass(t) FROM unnest($2::text[]) t)), '') || '|' || `+schemas+`
FROM pg_publication p WHERE p.pubname = $1`, cfg.Publication, tables).Scan(&p.Identity)
	if err != nil {
		return p, fmt.Errorf("read the definition of publication %q: %w", cfg.Publication, err)
	}
	return p, nil
}

// Close closes the watch's connection, if open.
func (w *PublicationWatch) Close(ctx context.Context) {
	if w.conn != nil {
		_ = w.conn.Close(ctx)
		w.conn = nil
	}
}
