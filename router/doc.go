// Package router is the second stage of the relay's data path: it turns an
// inserted outbox row (a replication.Insert) into a NATS message — subject,
// headers, payload and ordering key — according to the table mapping in
// Config. It does no I/O; the publisher sends what it returns.
//
//	replication (WAL in) → router (row → message) → publisher (→ JetStream ack)
//
// # Mapping
//
// Each configured table names its event id, aggregate id, aggregate
// version, event type and payload columns (the seed's names by default,
// see sql/outbox.sql), optionally an aggregate type and an occurred_at
// column, and extra columns to copy into headers. The message body is the
// payload column's text exactly as PostgreSQL sent it (jsonb text); the
// headers are the contract package's (Nats-Msg-Id is the event id, so
// JetStream drops a re-published event). A row that cannot be mapped gives
// a *RouteError wrapping ErrUnroutable with a stable reason class; the
// relay then publishes the record DeadLetter builds to the dead-letter
// subjects instead, so nothing is dropped silently.
//
// Route resolves a table's column positions once per *replication.Relation
// (a new one arrives after ALTER TABLE), so an added column costs nothing
// and a dropped mapped column turns into missing_column errors at once.
//
// # CloudEvents
//
// A table with CloudEventsConfig.Enabled also gets CloudEvents binary
// content mode headers (ce-specversion, ce-id, ce-source, ce-type,
// ce-subject, ce-time, ce-aggregateversion, ce-aggregatetype, content-type;
// see
// https://github.com/cloudevents/spec/blob/main/cloudevents/bindings/nats-protocol-binding.md),
// beside the contract's, never instead of them. Their values reuse the
// strings of the contract headers, and they count against the header limits.
//
// # Trace context
//
// The W3C trace context columns (traceparent and tracestate, which
// outbox.Writer fills from the writer's span) become the traceparent and
// tracestate headers, by default whenever the table has them: they are
// added to the table's extra headers when its relation is planned, so a
// table without them routes exactly as before and Route itself knows
// nothing of tracing. See https://www.w3.org/TR/trace-context/.
//
// # Subjects and escaping
//
// A subject template such as "outbox.{aggregate_type}.{aggregate_id}" may
// use {aggregate_type}, {aggregate_id}, {event_type}, {table} and {schema}
// anywhere inside a token; two placeholders share a token only with a byte
// between them that escaping never produces (not a letter, digit, '_', '-'
// or '~'; ':' or '+' will do), else two aggregates could get one subject.
// Each substituted value is escaped so that it can never change the
// subject's token structure:
//
//   - bytes in [A-Za-z0-9_-] are kept as they are;
//   - every other byte becomes '~' and two upper-case hex digits: "." is
//     "~2E", "~" is "~7E", " " is "~20", "é" (UTF-8 C3 A9) is "~C3~A9";
//   - the empty string becomes a lone "~".
//
// So aggregate id "order.42" of type "Order" gives "outbox.Order.order~2E42"
// and an empty id gives "outbox.Order.~". Escaped values never contain '.',
// '*', '>' or whitespace. The scheme is deterministic and reversible:
// EscapeToken and UnescapeToken implement it, and a consumer that needs the
// raw id reads the Outbox-Aggregate-Id header instead. Config.SubjectFilters
// gives the wildcard filters a stream needs to capture every subject.
//
// See https://docs.nats.io/nats-concepts/subjects for the subject rules and
// https://docs.nats.io/nats-concepts/jetstream/headers for Nats-Msg-Id.
package router
