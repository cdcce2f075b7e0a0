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
// read: Behind is then false, the safe answer. It is a record's end, as
// the walsender reports what it has sent (recordEnd).
func walEnd(ctx context.Context, conn *pgx.Conn) LSN {
	var (
		s        string
		blk, seg uint64
	)
	if err := conn.QueryRow(ctx, "SELECT "+insertLSN+"::text, current_setting('wal_block_size')::bigint, pg_size_bytes(current_setting('wal_segment_size'))").Scan(&s, &blk, &seg); err != nil {
		return 0
	}
	end, _ := parseLSN(s)
	return recordEnd(end, blk, seg)
}

// Page headers of the WAL: a segment's first page has the long one.
const (
	walShortPageHeader = 24 // SizeOfXLogShortPHD
	walLongPageHeader  = 40 // SizeOfXLogLongPHD
)

// recordEnd is the insert position lsn as the end of the record before
// it. pg_current_wal_insert_lsn() gives where the next record will
// start: at a page's start (the last record ended on the boundary, as an
// XLOG_SWITCH always does: the reader takes it to the segment's end),
// past the page's header. The walsender's sent position (keepalives) is
// the end of the last record it read, the boundary, and stays there until
// more WAL comes, so Behind, compared against the insert position, would
// stay true on an idle server. No record ends right after a page header
// (a record has a header of its own), so a position there is always such
// a start. blk and seg are the WAL's page and segment sizes; 0: unknown,
// lsn as it is.
func recordEnd(lsn LSN, blk, seg uint64) LSN {
	switch {
	case blk == 0 || seg == 0 || seg%blk != 0:
		return lsn
	case uint64(lsn)%seg == walLongPageHeader:
		return lsn - walLongPageHeader
	case uint64(lsn)%seg >= blk && uint64(lsn)%blk == walShortPageHeader:
		return lsn - walShortPageHeader
	}
	return lsn
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
