package consumer

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/contract"
)

// Message is what a handler receives: the event parsed from the relay's
// header contract plus where it came from.
type Message struct {
	contract.Event
	// Subject is the NATS subject the event was published to.
	Subject string
	// Header holds all message headers, including ones the contract does
	// not parse (Outbox-Extra-*). Do not modify it.
	Header nats.Header
	// Stream and StreamSeq locate the message in JetStream.
	Stream    string
	StreamSeq uint64
	// Stored is when JetStream stored the message (its metadata
	// timestamp, the server's clock): Stored minus CommitTime is the
	// relay's share of the event's lag, the time since Stored the
	// consumer's. Zero for a replay.
	Stored time.Time
	// Deliveries is JetStream's delivery count (1 on first delivery); for a
	// replay, the count recorded when the message was dead-lettered.
	Deliveries uint64
	// DeadLetterID is set when the message is replayed from the dead-letter
	// table by `outbox-relay dlq replay`.
	DeadLetterID int64
}

// Replayed reports whether the message comes from a dead-letter replay.
func (m *Message) Replayed() bool { return m.DeadLetterID != 0 }

// Handler applies one event. It runs inside the transaction that also
// records the event in consumed_message: write the effect through tx and
// nothing else, so that the effect and the dedup row commit together. Return
// nil to commit, or an error classified with [Transient], [Permanent] or
// [Reject] (unclassified errors are [ClassUnknown]). Do not commit or roll
// back tx. An effect outside the database (a charge, an e-mail) must not
// happen here: record an outbox event through package outbox in tx instead,
// and let its own consumer perform the effect idempotently.
type Handler interface {
	Handle(ctx context.Context, tx pgx.Tx, m *Message) error
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, tx pgx.Tx, m *Message) error

// Handle calls f.
func (f HandlerFunc) Handle(ctx context.Context, tx pgx.Tx, m *Message) error { return f(ctx, tx, m) }

// ContentHash returns the SHA-256 the library stores to recognise an event:
// over its type, aggregate type, aggregate id, aggregate version and payload
// bytes, each length-prefixed so that no two different events hash alike by
// shifting bytes between fields. The payload is hashed as published: the
// relay publishes PostgreSQL's jsonb text, which is stable for equal values.
func ContentHash(ev *contract.Event) []byte {
	// Every message is hashed on the delivery path: its fields go into one
	// buffer on the stack, hashed at once, where a hash.Hash written field
	// by field cost thirteen allocations per message (1 now: the result).
	if len(ev.Type)+len(ev.AggregateType)+len(ev.AggregateID)+len(ev.Payload)+contentHashFixed > contentHashStack {
		return contentHashLarge(ev)
	}
	var buf [contentHashStack]byte
	sum := sha256.Sum256(append(appendHashed(buf[:0], ev), ev.Payload...))
	return sum[:]
}

// contentHashLarge is ContentHash of an event too large for its stack
// buffer: the payload is hashed where it is.
func contentHashLarge(ev *contract.Event) []byte {
	h := sha256.New()
	h.Write(appendHashed(nil, ev))
	h.Write(ev.Payload)
	return h.Sum(nil)
}

// appendHashed appends what ContentHash hashes before the payload's bytes:
// the version tag and each field length-prefixed (a uvarint), then the
// payload's length.
func appendHashed(b []byte, ev *contract.Event) []byte {
	b = appendField(b, "outbox-event/v1")
	b = appendField(b, ev.Type)
	b = appendField(b, ev.AggregateType)
	b = appendField(b, ev.AggregateID)
	var v [20]byte
	b = appendField(b, strconv.AppendInt(v[:0], ev.AggregateVersion, 10))
	return binary.AppendUvarint(b, uint64(len(ev.Payload)))
}

// contentHashFixed bounds what ContentHash adds to an event's fields: the
// tag, a version of at most 20 digits and six length prefixes.
const contentHashFixed = len("outbox-event/v1") + 20 + 6*binary.MaxVarintLen64

// contentHashStack is the size of the events ContentHash hashes without a
// heap buffer: most outbox payloads are well under it.
const contentHashStack = 1024

// appendField appends f length-prefixed (a uvarint of its length).
func appendField[T string | []byte](b []byte, f T) []byte {
	return append(binary.AppendUvarint(b, uint64(len(f))), f...)
}
