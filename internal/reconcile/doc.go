// Package reconcile compares the outbox rows still in PostgreSQL with the
// events in the JetStream stream, by event id, and republishes the events
// that never reached the stream.
//
// It sits beside the relay's pipeline, not in it: it reads the outbox tables
// with SQL and the streams with a headers-only JetStream consumer, so it
// checks the relay's end result independently of the relay's bookkeeping.
// It is how an operator proves that nothing was lost, and how events are
// recovered after a lost replication slot or a primary failover, when the
// WAL that held them is gone.
//
// # Soundness
//
// A row is reported missing only when the relay has provably had its chance
// to publish it: Run reads the rows in one REPEATABLE READ snapshot and
// notes pg_current_wal_insert_lsn() inside that snapshot (every visible
// transaction's commit record ends before it). When some rows are not in
// the streams, it waits until the slot's confirmed_flush_lsn passes that
// LSN and reads the streams' tails again. The relay confirms a commit only after
// JetStream acknowledged (or the dead-letter stream stored) every event of
// it and of every earlier transaction, so from then on every row of the
// snapshot is in a stream unless it was never decoded by the slot (committed
// before the slot existed, or in WAL a lost slot dropped) or was deleted from
// the stream afterwards: exactly the cases reconcile exists for. Until the
// slot confirms, such rows are "pending", not missing.
//
// The stream is read from --since minus a clock-skew margin: an event is
// stored after its transaction committed, so no event whose occurred_at is
// in the window was stored earlier (PostgreSQL's and the NATS server's
// clocks agreeing within the margin). The read goes to the stream's last
// sequence, so events relayed late or republished by a repair are found.
//
// Repair republishes missing events through the relay's own router, so they
// carry the same subject and headers, with Nats-Msg-Id = event id, in
// (aggregate, aggregate_version) order. Their commit LSN and time are not
// known: Outbox-Commit-LSN and Outbox-Commit-Time are absent and
// Outbox-Repaired-At carries the time of the repair.
//
// See docs/operations.md for the runbooks that use it.
package reconcile
