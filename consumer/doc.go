// Package consumer is the library downstream services use to apply the
// events outbox-relay publishes to JetStream, idempotently and in aggregate
// order. It sits at the far end of the pipeline: outbox table → relay →
// JetStream stream → consumer → the service's own PostgreSQL database
// (run sql/consumer.sql there first).
//
// docs/consumer.md is the user's guide: what happens to a message, batches,
// failure classes, ordering, consumer groups, dead letters, retention and
// metrics. This comment is the map of the code.
//
// # Reading the code
//
// A message goes top to bottom through:
//
//   - consumer.go: [New] and [Consumer.Run]. A Consumer is configuration
//     only; each Run builds an engine.
//   - engine.go: the engine, one Run — it owns the workers, runs the
//     source, the replay and statistics loops, and stops in order (the
//     source first, the workers last, so that they settle what it handed
//     out). Its source is where deliveries come from: the plain durable
//     (durableSource, durable.go) or a group member's partitions
//     (groupSource, group_source.go). The engine hashes aggregate type and
//     id to one of Config.Workers workers.
//   - internal/group: a group member's membership — heartbeat, roster,
//     assignment, partition generations, each partition's pull and
//     hand-off. It sees the engine only as a group.Host that opens feeds
//     and creates durables, so it does not import this package; group.go
//     here holds GroupConfig and its checks.
//   - feed.go: a JetStream consumer's deliveries on their way to the
//     workers, in stream order by construction: a feed opens with a
//     reset of its consumer to the ack floor and resets again whenever the
//     consumer sequence of its deliveries breaks; a reset made by someone
//     else it adopts, and a plain durable that other processes pull too it
//     recognises and stops resetting (without VersionCheck). The plain
//     durable and each group partition pull through one.
//   - worker.go: a worker owns its queue, the aggregates held behind a
//     failed message and the retry state; it takes one message or a batch,
//     runs it on a goroutine of its own and settles each result with the
//     broker: ack, nak with backoff, deferral of a gap, or dead letter.
//   - step.go: the step, one message's part of a transaction — dedup row,
//     version check, handler, position move. It is the only place where a
//     message is judged; its stepOutcome tells the transaction what is left
//     to do (commit, roll back, nothing of it in the transaction).
//   - process.go: a message alone — runTx, one transaction around the step,
//     and what a failed commit means (wasCommitted: done, absent, or unknown,
//     which is retried and never dead-lettered).
//   - batch.go: several messages in one transaction — batchTx runs the
//     batch's dedup statement and then loops over the step; processBatch
//     retries a batch without the message whose attempt failed, and sends
//     the batch one message at a time when the failure is no single
//     message's (its deadline, begin, HandleBatch, a commit not known to
//     have gone through: no result from inside such a transaction stands).
//   - deadletter.go: consumer_dead_letter records and replays; a replay
//     runs the same step, and closes its record in its transaction.
//
// errors.go classifies failures ([Class], [ClassOf], [IsTransientDB]);
// config.go holds [Config] and its defaults; prune.go the [Pruner] of
// dedup rows; metrics.go and tracing.go the observability.
//
// # Invariants the code keeps
//
//   - The effect and the dedup row commit in one transaction, and a message
//     is acknowledged only when its result is known to stand: committed, or
//     decided without a write outside a transaction that failed.
//   - A message's attempt is charged to it only for its own failure: a
//     neighbour's, or a batch's deadline, is never its.
//   - One aggregate's messages are applied by one worker in the order they
//     are delivered; a message waiting for its retry holds back only its
//     aggregate.
//   - Deliveries reach the workers in stream order: a feed hands them on
//     only while their consumer sequences run unbroken since the last reset
//     (deliveries lost with a pull that ended, or a takeover break the run).
//     Order rests on that, not on redelivery timers; with VersionCheck the
//     database position enforces it as well. A plain durable shared by
//     several processes orders an aggregate only with VersionCheck.
//   - A group partition is consumed by one member at a time; a member that
//     takes one over resets it before it pulls, and the dedup row's unique
//     key serializes a previous owner still applying against it.
//   - Everything a worker holds is a delivered, unacknowledged message, so
//     MaxAckPending bounds it: a group member's partitions share it as one
//     budget (budget.go), whatever the member owns.
//
// JetStream pull consumers: https://docs.nats.io/nats-concepts/jetstream/consumers;
// PostgreSQL INSERT … ON CONFLICT: https://www.postgresql.org/docs/current/sql-insert.html.
package consumer
