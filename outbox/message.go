package outbox

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// DefaultMessagePrefix is the logical-decoding message prefix EmitMessage
// callers use unless the relay is configured for another one.
const DefaultMessagePrefix = "outbox"

// Envelope is the JSON content of a table-less outbox event, the message
// EmitMessage writes with pg_logical_emit_message. Its fields carry what an
// outbox row's columns would:
//
//	{
//	  "event_id": "0190a6e5-…",          // string, required
//	  "aggregate_type": "registration",  // string, optional ("" or absent)
//	  "aggregate_id": "42",              // string, required (may be "")
//	  "aggregate_version": 7,            // integer (int64), required
//	  "event_type": "RegistrationConfirmed", // string, required, non-empty
//	  "payload": {…},                    // any JSON value, required
//	  "occurred_at": "2025-01-02T03:04:05.123456Z" // RFC 3339, required
//	}
//
// Unknown fields are ignored, so later versions may add fields.
type Envelope struct {
	EventID          string          `json:"event_id"`
	AggregateType    string          `json:"aggregate_type,omitempty"`
	AggregateID      string          `json:"aggregate_id"`
	AggregateVersion int64           `json:"aggregate_version"`
	EventType        string          `json:"event_type"`
	Payload          json.RawMessage `json:"payload"`
	OccurredAt       time.Time       `json:"occurred_at"`
}

// EmitMessage validates ev and emits it as a transactional logical-decoding
// message with the given prefix (DefaultMessagePrefix if empty) through tx:
// the relay receives it at commit, in commit order with the transaction's
// row changes, and never if tx rolls back. No table row is written. It
// returns the event id (generated when ev.ID is zero).
func EmitMessage(ctx context.Context, tx pgx.Tx, prefix string, ev Event) (uuid.UUID, error) {
	if prefix == "" {
		prefix = DefaultMessagePrefix
	}
	if strings.ContainsRune(prefix, 0) {
		return uuid.Nil, fmt.Errorf("%w: message prefix %q contains NUL", ErrInvalidConfig, prefix)
	}
	p, err := prepare(&ev)
	if err != nil {
		return uuid.Nil, err
	}
	at := ev.OccurredAt
	if at.IsZero() {
		at = time.Now()
	}
	content, err := json.Marshal(Envelope{
		EventID:          p.id.String(),
		AggregateType:    ev.AggregateType,
		AggregateID:      ev.AggregateID,
		AggregateVersion: ev.AggregateVersion,
		EventType:        ev.Type,
		Payload:          p.payload,
		OccurredAt:       at.UTC(),
	})
	if err != nil {
		return uuid.Nil, fmt.Errorf("encode envelope: %w", err)
	}
	if _, err := tx.Exec(ctx, `SELECT pg_logical_emit_message(true, $1, $2::text)`, prefix, string(content)); err != nil {
		return uuid.Nil, fmt.Errorf("emit %s event %s as a logical message: %w", ev.Type, p.id, err)
	}
	return p.id, nil
}

// ParseEnvelope decodes and validates the content of a table-less event.
// Every required field must be present with the right JSON type; an error
// is an *EnvelopeError naming the field.
func ParseEnvelope(data []byte) (Envelope, error) {
	var raw struct {
		EventID          *string         `json:"event_id"`
		AggregateType    *string         `json:"aggregate_type"`
		AggregateID      *string         `json:"aggregate_id"`
		AggregateVersion *json.Number    `json:"aggregate_version"`
		EventType        *string         `json:"event_type"`
		Payload          json.RawMessage `json:"payload"`
		OccurredAt       *string         `json:"occurred_at"`
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if err := dec.Decode(&raw); err != nil {
		return Envelope{}, &EnvelopeError{Reason: "is not a JSON object of the expected shape: " + err.Error()}
	}
	if dec.More() {
		return Envelope{}, &EnvelopeError{Reason: "has data after the JSON object"}
	}
	var env Envelope
	switch {
	case raw.EventID == nil || *raw.EventID == "":
		return env, &EnvelopeError{Field: "event_id", Reason: "is missing or empty"}
	case raw.AggregateID == nil:
		return env, &EnvelopeError{Field: "aggregate_id", Reason: "is missing"}
	case raw.AggregateVersion == nil:
		return env, &EnvelopeError{Field: "aggregate_version", Reason: "is missing"}
	case raw.EventType == nil || *raw.EventType == "":
		return env, &EnvelopeError{Field: "event_type", Reason: "is missing or empty"}
	case len(raw.Payload) == 0:
		return env, &EnvelopeError{Field: "payload", Reason: "is missing"}
	case raw.OccurredAt == nil:
		return env, &EnvelopeError{Field: "occurred_at", Reason: "is missing"}
	}
	v, err := raw.AggregateVersion.Int64()
	if err != nil {
		return env, &EnvelopeError{Field: "aggregate_version", Reason: fmt.Sprintf("is not an int64: %s", raw.AggregateVersion.String())}
	}
	at, err := time.Parse(time.RFC3339Nano, *raw.OccurredAt)
	if err != nil {
		return env, &EnvelopeError{Field: "occurred_at", Reason: fmt.Sprintf("is not RFC 3339: %q", *raw.OccurredAt)}
	}
	env = Envelope{
		EventID:          *raw.EventID,
		AggregateID:      *raw.AggregateID,
		AggregateVersion: v,
		EventType:        *raw.EventType,
		Payload:          raw.Payload,
		OccurredAt:       at,
	}
	if raw.AggregateType != nil {
		env.AggregateType = *raw.AggregateType
	}
	return env, nil
}
