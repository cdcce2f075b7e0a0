// Package cleanup deletes outbox rows that were provably relayed, in small
// batches, so the outbox tables stay small without losing an event.
//
// It is one of three ways to keep an outbox small (docs/operations.md,
// "Retention"): deleting the row in the transaction that inserted it (the
// relay reads the INSERT from the WAL, and the publication does not publish
// the DELETE), dropping old partitions of a time-partitioned table, and this
// package, for tables whose rows are kept for a while (reconciliation,
// debugging, a polling relay's publish_state).
//
// "Provably relayed" has two definitions, one per Mode:
//
//   - ModeStream (the default): the row's event id is in the event stream.
//     Cleanup scans the stream's headers (no payloads) from the oldest
//     candidate row's time, and every batch of ids it finds becomes one
//     DELETE of those rows that are older than the cutoff. A row whose event
//     is not in the stream (not yet published, lost, only dead-lettered, or
//     expired from the stream) is never deleted, nor one whose event was
//     stored less than Config.StoredMargin ago: JetStream acknowledges
//     before fsync, so until the server synced the event the row may be its
//     only durable copy. A stream in memory is refused. It needs no
//     cooperation from the relay and holds after lost slots and failovers.
//   - ModePublished: the row's publish_state is 'PUBLISHED', the seed's
//     column, set by whatever publishes the rows (a polling relay being
//     replaced, or a marker that updates rows after the broker's ack). The
//     relay itself does not mark rows: marking costs an UPDATE per event.
//
// Why not "committed before the slot's confirmed_flush_lsn": rows do not
// carry their commit LSN, and a commit before the confirmed position is
// relayed only if the slot decoded it. Rows committed before the slot was
// created, or in WAL a lost slot dropped, are before the confirmed position
// and were never relayed; deleting them would lose them for good.
//
// Each batch is its own short transaction: DELETE ... WHERE (tableoid,
// ctid) IN (SELECT tableoid, ctid ... FOR UPDATE SKIP LOCKED) AND the same
// conditions again, so cleanup never waits for, nor blocks, the
// application's transactions for longer than one batch. The tableoid is
// what makes this right on a partitioned table, where each partition has
// its own ctids.
package cleanup
