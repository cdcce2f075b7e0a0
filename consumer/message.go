package consumer

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"hash"
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
	h := sha256.New()
	writeField(h, []byte("outbox-event/v1"))
	writeField(h, []byte(ev.Type))
	writeField(h, []byte(ev.AggregateType))
	writeField(h, []byte(ev.AggregateID))
	writeField(h, strconv.AppendInt(nil, ev.AggregateVersion, 10))
	writeField(h, ev.Payload)
	return h.Sum(nil)
}

func writeField(h hash.Hash, b []byte) {
	var n [binary.MaxVarintLen64]byte
	h.Write(n[:binary.PutUvarint(n[:], uint64(len(b)))])
	h.Write(b)
}
