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

// A backfill publishes the rows of a slot's exported snapshot; the slot
// streams what follows. The snapshot lives only as long as the backfill's
// connection, so a backfill that stops half-way cannot be continued, and
// the slot alone does not tell: without a record, streaming from it
// silently skips the rows not yet published. Two things guard it:
//
//   - a session advisory lock keyed on the slot, held for the whole
//     backfill (slot creation included) and taken by a streaming relay
//     before it starts, so a second instance never streams past a backfill
//     still running;
//   - a row in BackfillTable, written before the slot is created and
//     marked finished after the last row is acknowledged, so an
//     interrupted backfill is seen after any crash.

// BackfillTable is the state table's name, in the schema of the first
// outbox table. Backfill creates it; every role may read it.
const BackfillTable = "outbox_relay_backfill"

// backfillLockClass is the first key of the advisory lock (the second is
// the slot name's hash): "ORbf".
const backfillLockClass = 0x4f526266

// BackfillState is a slot's row of the state table.
type BackfillState struct {
	// Known is false when no backfill was ever recorded for the slot (or
	// the table does not exist).
	Known bool
	// Finished is false while the backfill runs, and forever after it was
	// interrupted.
	Finished  bool
	StartedAt time.Time
	// ConsistentPoint is the slot's consistent point, once it was created.
	ConsistentPoint LSN
}

// Incomplete reports whether a backfill was started and did not finish.
func (s BackfillState) Incomplete() bool { return s.Known && !s.Finished }

// BackfillGuard is the advisory lock of a backfill and the connection
// holding it: Close releases it.
type BackfillGuard struct {
	conn  *pgx.Conn
	cfg   Config
	table pgx.Identifier
}

// LockBackfill waits (until ctx ends) for the slot's backfill lock and
// returns it held on a connection of its own.
func LockBackfill(ctx context.Context, cfg Config) (*BackfillGuard, error) {
	conn, err := connectChecked(ctx, &cfg)
	if err != nil {
		return nil, err
	}
	// The lock lives as long as the server's session. A backfill whose
	// host vanished leaves no FIN: without keepalives the server would
	// keep the session, and hold every relay back, for the kernel's TCP
	// timeout (hours). With them it ends the session within about 25 s.
	if _, err := conn.Exec(ctx, "SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5; SET tcp_keepalives_count = 3"); err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("set keepalives of the backfill lock's session: %w", err)
	}
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1, hashtext($2))", backfillLockClass, cfg.Slot); err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("take the backfill lock of slot %q: %w", cfg.Slot, err)
	}
	return &BackfillGuard{conn: conn, cfg: cfg, table: backfillTable(cfg)}, nil
}

// State reads the slot's backfill record.
func (g *BackfillGuard) State(ctx context.Context) (BackfillState, error) {
	return readBackfillState(ctx, g.conn, g.table, g.cfg.Slot)
}

// Start records that a backfill of the slot begins, before the slot is
// created: a crash at any later point leaves the record unfinished.
func (g *BackfillGuard) Start(ctx context.Context) error {
	table := g.table.Sanitize()
	create := fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (
	slot_name name PRIMARY KEY,
	started_at timestamptz NOT NULL,
	consistent_point pg_lsn,
	finished_at timestamptz
)`, table)
	var exists bool
	if err := g.conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", table).Scan(&exists); err != nil {
		return fmt.Errorf("look up %s: %w", table, err)
	}
	if !exists {
		// Streaming roles read it to refuse a slot whose backfill did not
		// finish; it holds slot names and positions only.
		if err := createStateTable(ctx, g.conn, table, create); err != nil {
			return err
		}
	}
	_, err := g.conn.Exec(ctx, "INSERT INTO "+table+` (slot_name, started_at) VALUES ($1, now())
ON CONFLICT (slot_name) DO UPDATE SET started_at = now(), consistent_point = NULL, finished_at = NULL`, g.cfg.Slot)
	if err != nil {
		return backfillStateError(err, fmt.Sprintf("record the backfill of slot %q", g.cfg.Slot), grantState(ctx, g.conn, table))
	}
	return nil
}

// createStateTable creates a relay state table (table, sanitized) with the
// statement create, readable by every role: it holds slot names and
// positions only, and every relay, whatever its role, must read it.
func createStateTable(ctx context.Context, conn *pgx.Conn, table, create string) error {
	if _, err := conn.Exec(ctx, create); err != nil {
		return backfillStateError(err, "create "+table, create+"; GRANT SELECT ON "+table+" TO PUBLIC")
	}
	if _, err := conn.Exec(ctx, "GRANT SELECT ON "+table+" TO PUBLIC"); err != nil {
		return fmt.Errorf("grant SELECT on %s: %w", table, err)
	}
	return nil
}

// backfillStateError explains a refused write to the state table: the role
// that backfills must be able to record it, or the backfill cannot be
// guarded.
func backfillStateError(err error, what, fix string) error {
	return stateError(err, what, "a backfill is recorded so that an interrupted one is never streamed past", fix)
}

// stateError explains a refused write to a relay state table: why it is
// recorded, and the statement the outbox's owner runs (fix).
func stateError(err error, what, why, fix string) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.InsufficientPrivilege {
		return fmt.Errorf("%s: %w (%s: as the outbox's owner run %s — docs/faults.md, \"Least privilege: PostgreSQL\", lists every statement the owner runs — then run setup again)", what, err, why, fix)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// grantState is the statement granting the connection's role what it
// needs of the state table (sanitized): the role is read from the server,
// so that the fix names the role the relay runs as.
func grantState(ctx context.Context, conn *pgx.Conn, table string) string {
	var user string
	if err := conn.QueryRow(ctx, "SELECT current_user").Scan(&user); err != nil || user == "" {
		user = "the relay's role (the user of replication.url)"
	} else {
		user = pgx.Identifier{user}.Sanitize()
	}
	return "GRANT SELECT, INSERT, UPDATE, DELETE ON " + table + " TO " + user
}

// Created records the new slot's consistent point.
func (g *BackfillGuard) Created(ctx context.Context, lsn LSN) error {
	_, err := g.conn.Exec(ctx, "UPDATE "+g.table.Sanitize()+" SET consistent_point = $2 WHERE slot_name = $1", g.cfg.Slot, lsn.String())
	if err != nil {
		return fmt.Errorf("record the consistent point of slot %q: %w", g.cfg.Slot, err)
	}
	return nil
}

// Finish records that every row of the snapshot is published.
func (g *BackfillGuard) Finish(ctx context.Context) error {
	_, err := g.conn.Exec(ctx, "UPDATE "+g.table.Sanitize()+" SET finished_at = now() WHERE slot_name = $1", g.cfg.Slot)
	if err != nil {
		return fmt.Errorf("record the end of the backfill of slot %q: %w", g.cfg.Slot, err)
	}
	return nil
}

// Forget deletes the slot's record: no backfill of it is pending.
func (g *BackfillGuard) Forget(ctx context.Context) error {
	return forgetBackfill(ctx, g.conn, g.cfg)
}

func forgetBackfill(ctx context.Context, conn *pgx.Conn, cfg Config) error {
	table := backfillTable(cfg)
	// A finished record is harmless and stays: a role that may only read
	// the table (the streaming one) can then still drop its slot.
	st, err := readBackfillState(ctx, conn, table, cfg.Slot)
	if err != nil || !st.Incomplete() {
		return err
	}
	_, err = conn.Exec(ctx, "DELETE FROM "+table.Sanitize()+" WHERE slot_name = $1", cfg.Slot)
	if err != nil {
		return fmt.Errorf("forget the backfill record of slot %q (DELETE FROM %s WHERE slot_name = '%s' as its owner): %w", cfg.Slot, table.Sanitize(), cfg.Slot, err)
	}
	return nil
}

// Restart drops the slot of an interrupted backfill so that a new one can
// begin from a new snapshot. It refuses unless the slot is idle and has
// confirmed nothing past its consistent point: then nothing was streamed
// from it, and the new snapshot holds every row the old one had.
func (g *BackfillGuard) Restart(ctx context.Context, st BackfillState) error {
	slot, err := slotStatus(ctx, g.conn, g.cfg.Slot)
	if err != nil {
		return err
	}
	if !slot.Exists {
		return nil
	}
	if slot.Active || st.ConsistentPoint == 0 || slot.ConfirmedFlushLSN > st.ConsistentPoint {
		return backfillIncompleteError(g.cfg.Slot, st)
	}
	if _, err := g.conn.Exec(ctx, "SELECT pg_drop_replication_slot($1)", g.cfg.Slot); err != nil {
		return fmt.Errorf("drop slot %q of the interrupted backfill: %w", g.cfg.Slot, err)
	}
	return nil
}

// Close releases the lock.
func (g *BackfillGuard) Close(ctx context.Context) error { return g.conn.Close(ctx) }

// CheckBackfill is what a relay asks before it streams from the slot. It
// fails with ErrBackfillInProgress while another process holds the slot's
// backfill lock, and with ErrBackfillIncomplete when a backfill was
// interrupted. It returns the slot's record otherwise.
func CheckBackfill(ctx context.Context, cfg Config) (BackfillState, error) {
	g, st, err := HoldBackfill(ctx, cfg)
	if err != nil {
		return st, err
	}
	return st, g.Close(ctx)
}

// HoldBackfill is CheckBackfill keeping the slot's backfill lock when it
// passes; Close releases it. A relay holds it until its session has
// started: checked and released, a backfill could take the lock, create
// the slot and publish its snapshot between the check and the start,
// which then streams alongside it (a first deploy without auto_setup,
// where no slot exists at the check). Held, the backfill waits, and
// finds the slot there or creates it after the session failed to start.
func HoldBackfill(ctx context.Context, cfg Config) (*BackfillGuard, BackfillState, error) {
	conn, err := connectChecked(ctx, &cfg)
	if err != nil {
		return nil, BackfillState{}, err
	}
	g := &BackfillGuard{conn: conn, cfg: cfg, table: backfillTable(cfg)}
	st, err := g.tryHold(ctx)
	if err != nil {
		conn.Close(context.Background())
		return nil, st, err
	}
	return g, st, nil
}

func (g *BackfillGuard) tryHold(ctx context.Context) (BackfillState, error) {
	var locked bool
	if err := g.conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1, hashtext($2))", backfillLockClass, g.cfg.Slot).Scan(&locked); err != nil {
		return BackfillState{}, fmt.Errorf("try the backfill lock of slot %q: %w", g.cfg.Slot, err)
	}
	if !locked {
		return BackfillState{}, actionable(ErrBackfillInProgress, "this instance waits until the backfill is done", "slot %q", g.cfg.Slot)
	}
	st, err := g.State(ctx)
	if err != nil {
		return st, err
	}
	if st.Incomplete() {
		return st, backfillIncompleteError(g.cfg.Slot, st)
	}
	return st, nil
}

// ReadBackfillState reads the slot's backfill record, for status.
func ReadBackfillState(ctx context.Context, cfg Config) (BackfillState, error) {
	conn, err := connectChecked(ctx, &cfg)
	if err != nil {
		return BackfillState{}, err
	}
	defer conn.Close(ctx)
	return readBackfillState(ctx, conn, backfillTable(cfg), cfg.Slot)
}

// connectChecked applies cfg's defaults and opens a plain SQL connection.
func connectChecked(ctx context.Context, cfg *Config) (*pgx.Conn, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	return connectSQL(ctx, cfg.URL)
}

func readBackfillState(ctx context.Context, conn *pgx.Conn, table pgx.Identifier, slot string) (BackfillState, error) {
	var st BackfillState
	var cp *string
	var finished *time.Time
	err := conn.QueryRow(ctx, "SELECT started_at, consistent_point::text, finished_at FROM "+table.Sanitize()+" WHERE slot_name = $1", slot).
		Scan(&st.StartedAt, &cp, &finished)
	var pgErr *pgconn.PgError
	switch {
	case errors.Is(err, pgx.ErrNoRows), errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UndefinedTable:
		// Never backfilled by this version: nothing to hold against it.
		return BackfillState{}, nil
	case err != nil:
		return st, fmt.Errorf("read the backfill state of slot %q: %w", slot, err)
	}
	st.Known, st.Finished = true, finished != nil
	if cp != nil {
		st.ConsistentPoint, _ = parseLSN(*cp)
	}
	return st, nil
}

func backfillTable(cfg Config) pgx.Identifier {
	schema := "public"
	if len(cfg.Tables) > 0 {
		schema = splitQualified(cfg.Tables[0])[0]
	}
	return pgx.Identifier{schema, BackfillTable}
}

func backfillIncompleteError(slot string, st BackfillState) error {
	return actionable(ErrBackfillIncomplete,
		"rows of its snapshot may never have been published, and streaming would skip them: run `outbox-relay setup` to drop the slot and backfill again "+
			"(rows already published are de-duplicated by Nats-Msg-Id within the duplicate window); if the slot has streamed since, run "+
			"`outbox-relay teardown --yes`, `outbox-relay setup`, then `outbox-relay reconcile --repair`",
		"the backfill of slot %q started at %s (consistent point %s) never finished", slot, st.StartedAt.UTC().Format(time.RFC3339), st.ConsistentPoint)
}
