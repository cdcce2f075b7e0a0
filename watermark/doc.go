// Package watermark turns the publisher's acknowledgements into the LSN
// that the replication stage may confirm to PostgreSQL: the fourth step of
// the relay's data path,
//
//	replication (WAL → decoded change) → router (row → message)
//	  → publisher (message → JetStream ack) → watermark (ack → LSN)
//	  → replication (standby status: confirmed LSN).
//
// [Tracker] keeps transactions in commit order; a transaction's end LSN
// becomes confirmable when it and every earlier transaction are settled.
// Its Unsettled tail is what the relay bounds: per key, one stuck message
// lets later ones settle while the watermark stands still.
//
// pgoutput sends whole transactions in commit order, so confirming the end
// LSN of the newest settled prefix never skips a commit whose messages are
// not all stored; see
// https://www.postgresql.org/docs/current/protocol-replication.html.
package watermark
