package replication

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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
	if err := w.connect(ctx); err != nil {
		return PublicationProbe{}, err
	}
	p, err := probePublication(ctx, w.conn, w.cfg)
	return p, w.after(err)
}

func (w *PublicationWatch) connect(ctx context.Context) error {
	if w.conn == nil || w.conn.IsClosed() {
		conn, err := connectSQL(ctx, w.cfg.URL)
		if err != nil {
			return err
		}
		w.conn = conn
	}
	return nil
}

// after closes the connection after a failed query: it may be broken
// half-way through one, so the next use starts afresh.
func (w *PublicationWatch) after(err error) error {
	if err != nil {
		w.Close(context.Background())
	}
	return err
}

// Gap reads the slot's recorded publication gap (GapTable).
func (w *PublicationWatch) Gap(ctx context.Context) (Gap, error) {
	if err := w.connect(ctx); err != nil {
		return Gap{}, err
	}
	g, err := readGap(ctx, w.conn, w.cfg)
	return g, w.after(err)
}

// RecordGap records an open publication gap of the slot, so that any relay
// streaming the slot next fills it first.
func (w *PublicationWatch) RecordGap(ctx context.Context, g Gap) error {
	if err := w.connect(ctx); err != nil {
		return err
	}
	return w.after(recordGap(ctx, w.conn, w.cfg, g))
}

// ClearGap deletes the slot's gap record once the gap is filled.
func (w *PublicationWatch) ClearGap(ctx context.Context) error {
	if err := w.connect(ctx); err != nil {
		return err
	}
	return w.after(clearGap(ctx, w.conn, w.cfg))
}

// AdvanceSlot moves the slot's confirmed position to lsn without decoding
// the WAL before it through the output plugin: the way past a stretch
// pgoutput cannot decode (a publication dropped and created again). The
// caller vouches that everything committed before lsn is relayed. While
// the slot is held by a session (one that is ending, or another relay's)
// it retries for up to advanceRetry, then fails with the server's
// ObjectInUse error.
func (w *PublicationWatch) AdvanceSlot(ctx context.Context, lsn LSN) error {
	if err := w.connect(ctx); err != nil {
		return err
	}
	var reached string
	err := retryInUse(ctx, func() error {
		return w.conn.QueryRow(ctx, "SELECT end_lsn::text FROM pg_replication_slot_advance($1, $2::pg_lsn)", w.cfg.Slot, lsn.String()).Scan(&reached)
	})
	var pgErr *pgconn.PgError
	if err != nil && !(errors.As(err, &pgErr) && pgErr.Code == pgerrcode.ObjectInUse) && ctx.Err() == nil {
		return w.after(fmt.Errorf("advance slot %q to %s: %w", w.cfg.Slot, lsn, err))
	}
	if err != nil {
		return fmt.Errorf("advance slot %q to %s: %w", w.cfg.Slot, lsn, err)
	}
	// The server advances no further than its flushed WAL: short of lsn,
	// the slot would fail on the stretch again.
	if end, err := parseLSN(reached); err != nil || end < lsn {
		return fmt.Errorf("advance slot %q to %s: it reached %s only (the WAL is not flushed that far yet)", w.cfg.Slot, lsn, reached)
	}
	return nil
}

// retryInUse runs use, a statement on the slot, until it does not fail
// with ObjectInUse (the slot held by a session), for up to advanceRetry.
func retryInUse(ctx context.Context, use func() error) error {
	giveUp := time.Now().Add(advanceRetry)
	for {
		err := use()
		var pgErr *pgconn.PgError
		if err == nil || !(errors.As(err, &pgErr) && pgErr.Code == pgerrcode.ObjectInUse) || time.Now().After(giveUp) {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: %w", ctx.Err(), err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// advanceRetry is how long AdvanceSlot waits for the slot's session to end:
// the relay's own, just closed, ends within milliseconds.
const advanceRetry = 3 * time.Second

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
	// The check and the identity are separate statements: read the
	// identity before and after the check, so that a change committed in
	// between (the check seeing the old definition, the identity the new)
	// is checked again rather than taken for a right publication that was
	// redefined.
	for attempt := 0; ; attempt++ {
		before, err := readIdentity(ctx, conn, cfg)
		if err != nil {
			return p, err
		}
		p.Problem = checkPublication(ctx, conn, cfg)
		if p.Problem != nil && !IsPublicationProblem(p.Problem) {
			return p, p.Problem
		}
		if p.Problem != nil {
			return p, nil
		}
		p.Identity, err = readIdentity(ctx, conn, cfg)
		if err != nil || p.Identity == before || attempt == 2 {
			return p, err
		}
	}
}

// readIdentity reads the publication's identity (PublicationProbe.Identity);
// "" when it does not exist.
func readIdentity(ctx context.Context, conn *pgx.Conn, cfg Config) (string, error) {
	tables := make([]string, len(cfg.Tables))
	for i, t := range cfg.Tables {
		tables[i] = splitQualified(t).Sanitize()
	}
	// pg_publication_namespace (FOR TABLES IN SCHEMA) exists from
	// PostgreSQL 15; before, no schema is a member.
	schemas := "''"
	var version int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		return "", fmt.Errorf("read server version: %w", err)
	}
	if version >= 150000 {
		schemas = "coalesce((SELECT string_agg(n.oid::text || '.' || n.xmin::text, ',' ORDER BY n.oid) FROM pg_publication_namespace n WHERE n.pnpubid = p.oid), '')"
	}
	var ident string
	err := conn.QueryRow(ctx, `SELECT p.oid::text || '.' || p.xmin::text || '|' ||
	coalesce((SELECT string_agg(r.oid::text || '.' || r.xmin::text, ',' ORDER BY r.oid) FROM pg_publication_rel r
		WHERE r.prpubid = p.oid AND r.prrelid IN (SELECT to_regclass(t) FROM unnest($2::text[]) t)), '') || '|' || `+schemas+`
FROM pg_publication p WHERE p.pubname = $1`, cfg.Publication, tables).Scan(&ident)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("read the definition of publication %q: %w", cfg.Publication, err)
	}
	return ident, nil
}

// Close closes the watch's connection, if open.
func (w *PublicationWatch) Close(ctx context.Context) {
	if w.conn != nil {
		_ = w.conn.Close(ctx)
		w.conn = nil
	}
}
