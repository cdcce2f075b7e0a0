// Package consumer is the library downstream services use to apply the
// events outbox-relay publishes to JetStream, idempotently and in aggregate
// order. It sits at the far end of the pipeline: outbox table → relay →
// JetStream stream → consumer → the service's own PostgreSQL database.
//
// Delivery is at least once, so every message goes through one database
// transaction (run sql/consumer.sql in the service's database first):
//
//  1. insert (consumer, event_id, content hash, …) into consumed_message
//     with ON CONFLICT DO NOTHING; if the row exists, the stored hash decides:
//     the same content is a duplicate (acknowledged, counted), other content
//     is a conflict (dead-lettered, never treated as a duplicate);
//  2. with Config.VersionCheck, compare the event's aggregate version with
//     the aggregate's position (read FOR UPDATE): the next version is
//     applied, the current one with the same identity is a duplicate, a
//     later one is a gap (deferred with NakWithDelay up to Config.GapWait,
//     then dead-lettered naming both versions), anything else a conflict;
//  3. run the Handler in the same transaction and move the position;
//  4. commit, and only then acknowledge.
//
// A crash after the commit and before the ack causes a redelivery that step 1
// recognises; a crash before the commit leaves nothing behind.
//
// # Batches
//
// A worker applies up to Config.BatchSize messages already queued for it in
// one transaction: one dedup statement for all of them (INSERT … SELECT FROM
// unnest … ON CONFLICT DO NOTHING RETURNING), then steps 2 and 3 per message
// in order (or a [BatchHandler] once), one commit, then the acks. It never
// waits for more messages: a lone one goes through the transaction above.
// When a message's attempt fails or is rejected, the transaction rolls back;
// that attempt is the message's result, settled as if it were alone; the
// later messages of its aggregate in the batch go back to the queue and are
// held behind it; the rest is retried at once without them (a rejection is
// redone there as one). A failure of no single message (begin, the dedup
// statement, HandleBatch, the deadline) sends the batch's untried messages
// back to be applied one at a time. So no message is applied twice or
// fails for a neighbour, and every message ends with the same dedup row,
// dead letter, attempts per class and holds as with BatchSize 1; only a
// neighbour's handler may run again after a rollback. Replays go one at a
// time.
//
// # Failures
//
// Handlers classify their errors with [Transient], [Permanent] and [Reject].
// Transient failures (database unavailability is recognised by SQLSTATE and
// error type, see [IsTransientDB]; a deadline while beginning the
// transaction counts too) are retried with capped exponential backoff and
// jitter through NakWithDelay, without limit unless
// Config.TransientAttempts is set; permanent ones are dead-lettered at once;
// a business rejection is recorded as 'rejected' with the dedup row and
// acknowledged; anything else, including a recovered panic, is retried up to
// Config.MaxAttempts and then dead-lettered. Each class counts against its
// own limit: transient failures through an outage do not use up the
// attempts of a later unclassified error. A commit that reports an error is
// checked in a new transaction: when the dedup row with the message's hash
// is there, the commit went through and the message is acknowledged as
// applied, never retried or dead-lettered.
//
// Dead letters go to the consumer_dead_letter table of the same database
// with the original payload and headers, event id, subject, stream
// sequence, failure class and reason, attempts and first and last failure
// time. A record belongs to one message: a redelivery of it updates the
// open record, another message at the same stream sequence (a recreated
// stream) gets its own. Text the database cannot store (invalid UTF-8, NUL)
// is sanitised, a handler's own class outside the table's set is recorded
// as unknown, and a record the database still refuses is stored with every
// text field escaped: only a transient error writing the record (the
// database unavailable) retries the message, so a message never stays
// forever for want of a record. An event whose id, type or aggregate
// headers are not UTF-8 text is permanent (its dedup row could never be
// written).
//
// Operators list, replay and discard dead letters with `outbox-relay dlq`
// (package dlq). A replay is applied by this consumer only, through the
// same transaction as a live message, and closes the record in that
// transaction; records are replayed in aggregate and version order, and a
// failed replay holds back its aggregate's later records of the same batch.
// A discard records the event in consumed_message as 'discarded' (a
// redelivery is a duplicate) and moves a VersionCheck position that stands
// just before it past it, in the audited transaction ([RecordDiscard]); a
// consumer finding a gap of discarded versions only applies the event.
//
// # The durable consumer
//
// Run creates the durable consumer (explicit acks, no MaxDeliver) and
// records in its metadata the database (system identifier when readable,
// and name) and the filter subjects. It refuses to start with
// [ErrDurableClash] when the durable is recorded for another database
// (another service uses the same Name), or filters other subjects unless
// Config.AllowFilterChange says the change is deliberate. Run also checks
// the schema ([CheckSchema]) and upgrades tables made by an earlier
// sql/consumer.sql in place ([Migrate]).
//
// # Ordering
//
// What is guaranteed, and what is not:
//
//   - Messages are dispatched to Config.Workers workers by a hash of
//     aggregate type and id; a worker applies its messages one at a time,
//     or in batches in order, in the order the stream delivers them, so one aggregate's events are
//     applied in stream order (which the relay keeps equal to commit order).
//     Different aggregates proceed in parallel; there is no order between
//     them.
//   - When a message fails and waits for its retry, the later messages of
//     the same aggregate are held in memory (kept alive with progress acks)
//     until it is applied or dead-lettered, or JetStream shows that it is
//     gone: settled by another process sharing the durable consumer (at or
//     below its ack floor) or removed from the stream. A message that is
//     only late, because NATS is unreachable, keeps its aggregate held
//     however long the outage lasts. Other aggregates carry on. The number
//     of held messages is bounded by the durable consumer's MaxAckPending:
//     an aggregate with more than MaxAckPending messages behind a failing
//     one stalls the consumer until that message is resolved. Transient
//     failures retry without limit by default, so a long database outage
//     stalls everything (as it must).
//   - A slow handler, or one that ignores its context and hangs, delays the
//     other aggregates of its worker (1/Workers of them), not the dispatcher
//     or other workers; the worker keeps its queued messages alive. Run
//     waits for a handler in flight to return before it returns.
//   - Without VersionCheck, this order holds across crashes, restarts,
//     lost pulls and NATS outages: the durable is pulled through a feed
//     (feed.go) that starts each Run with a reset of the durable to its ack
//     floor, after which JetStream delivers in stream order, and resets
//     again whenever the consumer sequence of its deliveries breaks
//     (deliveries in transit lost with a pull that ended, or taken by
//     another process). With VersionCheck, the database position enforces
//     the order as well: an early arrival is deferred until the missing
//     versions are applied, for up to GapWait.
//   - Several processes sharing one durable consumer split an aggregate's
//     messages between them; only VersionCheck keeps its order then. To
//     scale out with order per aggregate, run them as one consumer group
//     (Config.Group, GroupConfig): the stream is partitioned by a subject
//     transform, each partition is a durable consumer that JetStream pins
//     to one member at a time, and a member that takes a partition over
//     unpins it and resets it to its ack floor before it pulls, so the new
//     owner is delivered the partition in stream order whatever the
//     previous one held; the dedup row's unique key serializes a previous
//     owner still applying against it. A partition-count change drains the
//     old partitions first. See docs/consumer.md "Consumer groups".
//
// VersionCheck needs every event of an aggregate. A consumer that filters
// event types or subjects, or a producer that changes an aggregate without
// emitting an event, skips versions legitimately; such consumers leave it
// off (the seed lesson's point: a version jump is then not a lost message).
//
// # Retention
//
// [Pruner] deletes old consumed_message rows, refusing a retention shorter
// than the window in which an event can arrive again (see its doc).
//
// # Metrics
//
// With [WithRegisterer]: outbox_consumer_messages_processed_total{outcome},
// outbox_consumer_idempotency_hits_total, outbox_consumer_version_gaps_total,
// outbox_consumer_conflicts_total, outbox_consumer_retries_total{class},
// outbox_consumer_dead_lettered_total{owner,class},
// outbox_consumer_replayed_total{result},
// outbox_consumer_consume_latency_seconds (outbox commit to consumer commit),
// outbox_consumer_transaction_duration_seconds (one message's transaction),
// outbox_consumer_batch_size, outbox_consumer_batch_transaction_duration_seconds,
// outbox_consumer_dead_letters_open{owner},
// outbox_consumer_dead_letter_oldest_age_seconds{owner} and
// outbox_consumer_resumes_total{reason} (resets to the ack floor, feed.go);
// all carry a consumer label.
//
// JetStream pull consumers: https://docs.nats.io/nats-concepts/jetstream/consumers;
// PostgreSQL INSERT … ON CONFLICT: https://www.postgresql.org/docs/current/sql-insert.html.
package consumer
