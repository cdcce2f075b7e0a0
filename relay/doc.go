// Package relay wires the stages of outbox-relay's data path into one
// long-running component:
//
//	replication (WAL → decoded change) → router (row → message)
//	  → publisher (message → JetStream ack) → watermark (ack → LSN)
//	  → replication (standby status: confirmed LSN)
//
// One goroutine reads the replication stream, routes each row and hands it to
// the publisher; when the publisher's window is full it stops reading (the
// server's WAL stays on the server, not in our memory) but keeps sending
// status updates so the server does not time the connection out. Acks settle
// messages in the tracker from the publisher's goroutines, and the tracker's
// watermark is what the next status update confirms.
//
// It also stops reading, at the start of a transaction, when the
// transactions read but not yet confirmable (or the WAL from the watermark
// to them) reach MaxUnsettledTxs (MaxUnsettledBytes), and names the message
// holding the watermark once it stood still for StallWarning.
//
// Before every session it checks the publication (each table in it, inserts
// only, partitioned tables through their root, no row filter; again every
// PublicationCheck while streaming) and the slot's backfill (a standby waits
// while another instance backfills; an interrupted backfill is refused).
// Run reconnects after connection failures with capped backoff, waits while
// another instance holds the slot (a hot standby), and stops with an error
// for conditions that need an operator (a lost slot, wal_level, grants, a
// wrong publication, an interrupted backfill).
package relay
