package replication

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// CurrentLSN is the SQL expression of the server's current WAL position:
// pg_current_wal_lsn() on a primary; on a standby, where that fails, the
// position replayed so far, which is all a slot there can reach.
const CurrentLSN = "(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END)"

// insertLSN is CurrentLSN at the WAL's insert position on a primary: the
// end of every commit made, which commits with synchronous_commit off
// reach before pg_current_wal_lsn() does.
const insertLSN = "(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_insert_lsn() END)"

// walEnd is the end of the server's WAL (insertLSN), 0 when it cannot be
// read: Behind is then false, the safe answer.
func walEnd(ctx context.Context, conn *pgx.Conn) LSN {
	var s string
	if err := conn.QueryRow(ctx, "SELECT "+insertLSN+"::text").Scan(&s); err != nil {
		return 0
	}
	end, _ := parseLSN(s)
	return end
}

// setupOnStandby is Setup on a hot standby (PostgreSQL 16+, checked by
// checkFeatures): the publication comes from the primary, which alone can
// create it, and the slot is the standby's own. Creating it waits for the
// primary's next running-transactions record (up to 15 s on an idle
// primary; pg_log_standby_snapshot() on the primary sends one at once).
func setupOnStandby(ctx context.Context, conn *pgx.Conn, cfg Config, rep *SetupReport) error {
	if err := standbyPublication(ctx, conn, cfg); err != nil {
		return err
	}
	rep.Actions = nil
	rep.add("publication %s exists (created on the primary)", cfg.Publication)
	return ensureSlot(ctx, conn, cfg, rep, true)
}
