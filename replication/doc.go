// Package replication is the first stage of the relay's data path: it reads
// an outbox publication from a PostgreSQL logical replication slot with the
// pgoutput plugin and turns the WAL stream into decoded changes (Begin,
// Insert, Message, Commit).
//
// It owns the replication connection (replication=database), creates the
// slot and publication idempotently, answers the server's keepalives, and
// reports the confirmed LSN that the ack tracker hands it; it never confirms
// a position on its own, except the server's WAL end while nothing is in
// flight, which is how an idle outbox stops retaining WAL.
//
// See https://www.postgresql.org/docs/current/protocol-logical-replication.html
// and https://www.postgresql.org/docs/current/protocol-logicalrep-message-formats.html.
package replication
