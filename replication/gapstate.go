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

// A publication gap (rows the publication may have withheld from the slot)
// is filled by the relay from the outbox table before it streams again.
// The slot's confirmed position stays before the gap meanwhile, but the
// slot does not say that a gap is open: a relay started afresh finds the
// publication right and streams from there, and pgoutput never sends the
// withheld rows. The gap is therefore recorded in GapTable from the
// moment it is found until it is filled, for whichever relay streams the
// slot next.

// GapTable is the table recording open publication gaps, in the schema of
// the first outbox table, beside BackfillTable. The relay creates it when
// it may (sql/least-privilege-owner.sql creates it otherwise); every role
// may read it.
const GapTable = "outbox_relay_gap"

// Gap is a slot's open publication gap.
type Gap struct {
	// Open is false when no gap is recorded.
	Open bool
	// Since is the confirm limit when the gap was found: nothing after it
	// is known to have reached the stream.
	Since LSN
	// Undecodable is set when the slot cannot decode the stretch (the
	// publication was dropped and created again): once the gap is filled
	// the slot must be advanced past it.
	Undecodable bool
	// NoticedAt is when a relay first found it.
	NoticedAt time.Time
}

// ReadGap reads the slot's recorded publication gap (GapTable) over a
// connection of its own: for status and reconcile.
func ReadGap(ctx context.Context, cfg Config) (Gap, error) {
	if err := cfg.setDefaults(); err != nil {
		return Gap{}, err
	}
	conn, err := connectSQL(ctx, cfg.URL)
	if err != nil {
		return Gap{}, err
	}
	defer conn.Close(context.Background())
	return readGap(ctx, conn, cfg)
}

func gapTable(cfg Config) pgx.Identifier {
	return pgx.Identifier{backfillTable(cfg)[0], GapTable}
}

// readGap reads the slot's open gap; a missing table records none.
func readGap(ctx context.Context, conn *pgx.Conn, cfg Config) (Gap, error) {
	var g Gap
	var since string
	err := conn.QueryRow(ctx, "SELECT since_lsn::text, undecodable, noticed_at FROM "+gapTable(cfg).Sanitize()+" WHERE slot_name = $1", cfg.Slot).Scan(&since, &g.Undecodable, &g.NoticedAt)
	var pgErr *pgconn.PgError
	switch {
	case errors.Is(err, pgx.ErrNoRows), errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UndefinedTable:
		return Gap{}, nil
	case err != nil:
		return g, fmt.Errorf("read the publication gap of slot %q: %w", cfg.Slot, err)
	}
	g.Open = true
	g.Since, err = parseLSN(since)
	return g, err
}

// recordGap records g for the slot, keeping the earliest Since and any
// Undecodable already recorded. It creates the table when it is missing.
func recordGap(ctx context.Context, conn *pgx.Conn, cfg Config, g Gap) error {
	table := gapTable(cfg).Sanitize()
	upsert := "INSERT INTO " + table + ` (slot_name, since_lsn, undecodable, noticed_at) VALUES ($1, $2, $3, now())
ON CONFLICT (slot_name) DO UPDATE SET since_lsn = least(` + table + `.since_lsn, EXCLUDED.since_lsn), undecodable = ` + table + `.undecodable OR EXCLUDED.undecodable`
	_, err := conn.Exec(ctx, upsert, cfg.Slot, g.Since.String(), g.Undecodable)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UndefinedTable {
		create := "CREATE TABLE IF NOT EXISTS " + table + ` (
	slot_name name PRIMARY KEY,
	since_lsn pg_lsn NOT NULL,
	undecodable boolean NOT NULL DEFAULT false,
	noticed_at timestamptz NOT NULL
)`
		if err := createStateTable(ctx, conn, table, create); err != nil {
			return err
		}
		_, err = conn.Exec(ctx, upsert, cfg.Slot, g.Since.String(), g.Undecodable)
	}
	if err != nil {
		return gapStateError(ctx, conn, err, fmt.Sprintf("record the publication gap of slot %q in %s", cfg.Slot, table), table)
	}
	return nil
}

// clearGap deletes the slot's gap record: the gap is filled. When none is
// recorded it deletes nothing, so that a role that may read the table but
// not delete from it (its record refused too) still finishes the fill.
func clearGap(ctx context.Context, conn *pgx.Conn, cfg Config) error {
	g, err := readGap(ctx, conn, cfg)
	if err != nil || !g.Open {
		return err
	}
	table := gapTable(cfg).Sanitize()
	_, err = conn.Exec(ctx, "DELETE FROM "+table+" WHERE slot_name = $1", cfg.Slot)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UndefinedTable {
		return nil
	}
	if err != nil {
		return gapStateError(ctx, conn, err, fmt.Sprintf("clear the publication gap of slot %q in %s", cfg.Slot, table), table)
	}
	return nil
}

// gapStateError explains a refused write to GapTable, naming the grant
// for the role the relay runs as.
func gapStateError(ctx context.Context, conn *pgx.Conn, err error, what, table string) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != pgerrcode.InsufficientPrivilege {
		return fmt.Errorf("%s: %w", what, err)
	}
	return stateError(err, what, "a publication gap is recorded so that a relay that stops before filling it leaves it to the next one instead of streaming past the withheld rows", grantState(ctx, conn, table))
}
