// Package publisher is the third stage of the relay's data path: it publishes
// routed messages to JetStream and reports each message settled (acked,
// or its dead-letter record acked) to its Owner.
//
// # Ordering under pipelining
//
// Publishes are pipelined: up to MaxInFlight messages (and MaxInFlightBytes)
// wait for their acks at once, so throughput is not capped by one round trip
// per event. Pipelining alone would break per-aggregate order: a message can
// fail on its own (no responders during a stream-leader election, a timeout
// after which it may or may not be stored) while later ones succeed, and
// resending it would store version 7 after version 8; Nats-Msg-Id
// de-duplication does not repair that. Two publishers keep order:
//
// [Publisher] keeps at most one unacknowledged message per ordering key (the
// aggregate): the next message of an aggregate leaves only after the
// previous one is acked, so a retry can never overtake or be overtaken.
// Different aggregates pipeline freely. A single hot aggregate is limited to
// one round trip per event (bench/README.md has the rate); that is the
// price of correctness that does not depend on server features.
//
// [Batch] publishes one stream's messages as fast-ingest batches (nats-server
// 2.14, stream allow_batched) in "gap: fail" mode, where the server stores
// nothing after a message that failed and an ack of batch sequence N
// confirms every message up to N in order. All messages keep their order,
// hot aggregates are not limited, and the server answers once per few
// hundred messages. Failures go to a Publisher, one message at a time, so
// both share one retry and dead-letter policy.
//
// A retried message keeps its Nats-Msg-Id (the event id), so when the first
// attempt was stored after all, the stream reports a duplicate instead of
// storing it twice, as long as the retry comes within the stream's
// duplicate window.
//
// # Failures
//
// Transient failures (timeouts, no responders, stream unavailable or full,
// reconnects) are retried forever with capped exponential backoff and
// jitter: the watermark stops, nothing is skipped. Permanent rejections (the
// message exceeds the stream's size limit or the 64 KiB header limit, or
// its subject is bound to no stream) go to the dead-letter stream through
// the message's DeadLetterer and count as settled once the dead-letter record is
// acked. An ack counts only when it names the stream meant to store the
// message (WithExpectedStream): an answer in JetStream's shape from
// anything else is retried as a bad ack.
//
// # Watermark
//
// Owner.Settled tells the caller a message is settled; package watermark turns that
// into the LSN the replication stage may confirm.
//
// See https://docs.nats.io/using-nats/developer/develop_jetstream/model_deep_dive#message-deduplication.
package publisher
