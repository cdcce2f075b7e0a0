// Package outbox is the producer side of outbox-relay: a small, typed helper
// that services use to record an event in the same transaction as the
// business change it describes. The relay then streams the committed event
// from the WAL to JetStream (see the repository README).
//
// Two forms are supported:
//
//   - [Writer.Insert] inserts a row into an outbox table (sql/outbox.sql, or
//     a table of your own described by [Columns]) through the caller's
//     pgx.Tx. The event commits or rolls back with the business change.
//   - [EmitMessage] writes no row at all: it calls
//     pg_logical_emit_message(true, prefix, content) with the event as a
//     JSON [Envelope]. The message is transactional, so it is decoded only
//     if the transaction commits, and the table never needs cleaning up.
//     The relay's router parses the content with [ParseEnvelope].
//
// Both validate the event first (type, aggregate id and payload are
// required; the version must not be negative; text fields must not hold NUL
// or line breaks, which neither PostgreSQL text nor NATS headers carry) and
// give it a time-ordered UUIDv7 id when it has none, so ids sort by creation
// time and index well.
//
// Tracing: Insert stores the W3C trace context of the span in its ctx
// (OpenTelemetry's trace.SpanContextFromContext) in the table's optional
// traceparent and tracestate columns; the relay maps them to the
// traceparent and tracestate headers and the consumer library continues the
// trace. Without a span, or in a table without the columns, nothing
// changes. EmitMessage carries no trace context.
//
// A consumer handler that must cause an external effect (a charge, an
// e-mail) records such an event in its own transaction instead of calling
// out directly; the effect's own consumer then performs it idempotently.
//
// PostgreSQL logical decoding messages:
// https://www.postgresql.org/docs/current/functions-admin.html#FUNCTIONS-REPLICATION
package outbox
