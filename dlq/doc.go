// Package dlq is the operator side of outbox-relay's dead-letter queues: a
// library ([Store] for consumers' dead letters, [RelayDLQ] for the relay's
// dead-letter stream) and the `dlq` cobra command built on it
// ([NewCommand]), which the outbox-relay binary mounts as
// `outbox-relay dlq list|show|replay|discard|audit`.
//
// A dead-letter queue is not a rubbish bin: every record keeps the original
// payload and headers, the event id, where it came from and why it failed,
// names an owner, and leaves only through an audited action.
//
//   - Consumers (package consumer) write their dead letters to the
//     consumer_dead_letter table of their own database (sql/consumer.sql).
//     `replay` marks records 'replaying'; the consumer named in the record,
//     and no other subscriber of the stream, applies them through its
//     normal idempotent transaction, in aggregate order, and closes each
//     record in that same transaction. The event id is kept, so an event
//     that was meanwhile applied is recognised as a duplicate. `discard`
//     closes records without applying them and requires a reason. Both
//     write consumer_dlq_audit rows in the transaction of the action.
//   - The relay writes rows it could not route to its dead-letter stream
//     (default OUTBOX_DLQ). They can be listed, shown and discarded (deleted
//     from the stream after an audit entry is stored in the audit stream,
//     default OUTBOX_DLQ_AUDIT); they cannot be replayed, because the fix is
//     in the row or the relay configuration, after which the event is
//     written to the outbox again.
//
// The package reads no environment variables: the program mounting the
// command passes defaults (the actor from $USER, URLs, owners) in [Deps].
package dlq
