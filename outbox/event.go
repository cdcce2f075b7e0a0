package outbox

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
)

// Event is one event to record.
type Event struct {
	// ID is the event id, the consumers' dedup key. Zero: a new UUIDv7.
	// Reuse an id only for the very same event (a retried request), never
	// for different content: consumers treat that as a conflict.
	ID uuid.UUID
	// AggregateType names the kind of aggregate, e.g. "registration". It
	// may be empty for a table whose aggregate_type defaults to '' (the
	// relay then uses the table name).
	AggregateType string
	// AggregateID identifies the aggregate; events of one aggregate are
	// delivered in commit order. Required.
	AggregateID string
	// AggregateVersion is the aggregate's version after the change this
	// event describes; consumers use it to detect gaps and duplicates. Must
	// not be negative.
	AggregateVersion int64
	// Type is the event type, e.g. "RegistrationConfirmed". Required.
	Type string
	// Payload is the event body. json.RawMessage and []byte are used as
	// they are and must be valid JSON; any other value is encoded with
	// encoding/json. Required (use json.RawMessage("{}") for no data).
	Payload any
	// OccurredAt is when the change happened. Zero: the table's default
	// (CURRENT_TIMESTAMP, the transaction's start) for Insert, the current
	// time for EmitMessage.
	OccurredAt time.Time
}

// prepared is a validated event with its id and encoded payload.
type prepared struct {
	id      uuid.UUID
	payload json.RawMessage
}

// prepare validates ev, assigns a UUIDv7 when it has no id and encodes its
// payload.
func prepare(ev *Event) (prepared, error) {
	if err := checkText("Type", ev.Type, true); err != nil {
		return prepared{}, err
	}
	if err := checkText("AggregateID", ev.AggregateID, true); err != nil {
		return prepared{}, err
	}
	if err := checkText("AggregateType", ev.AggregateType, false); err != nil {
		return prepared{}, err
	}
	if ev.AggregateVersion < 0 {
		return prepared{}, &FieldError{Field: "AggregateVersion", Reason: fmt.Sprintf("is %d; versions are never negative", ev.AggregateVersion)}
	}
	payload, err := encodePayload(ev.Payload)
	if err != nil {
		return prepared{}, err
	}
	id := ev.ID
	if id == uuid.Nil {
		if id, err = uuid.NewV7(); err != nil {
			return prepared{}, fmt.Errorf("generate event id: %w", err)
		}
	}
	return prepared{id: id, payload: payload}, nil
}

// checkText rejects what PostgreSQL text (NUL) or a NATS header value (line
// breaks) cannot carry, and invalid UTF-8.
func checkText(field, s string, required bool) error {
	switch {
	case required && s == "":
		return &FieldError{Field: field, Reason: "is required"}
	case !utf8.ValidString(s):
		return &FieldError{Field: field, Reason: "is not valid UTF-8"}
	case strings.ContainsAny(s, "\x00\r\n"):
		return &FieldError{Field: field, Reason: fmt.Sprintf("%q contains NUL or a line break", s)}
	}
	return nil
}

func encodePayload(p any) (json.RawMessage, error) {
	var b []byte
	switch v := p.(type) {
	case nil:
		return nil, &FieldError{Field: "Payload", Reason: `is required (use json.RawMessage("{}") for an event without data)`}
	case json.RawMessage:
		b = v
	case []byte:
		b = v
	default:
		enc, err := json.Marshal(v)
		if err != nil {
			return nil, &FieldError{Field: "Payload", Reason: "cannot be encoded as JSON: " + err.Error()}
		}
		b = enc
	}
	if !json.Valid(b) {
		return nil, &FieldError{Field: "Payload", Reason: "is not valid JSON"}
	}
	// jsonb refuses NUL in strings (\u0000); say so now rather than at
	// commit time.
	if strings.Contains(string(b), `\u0000`) {
		return nil, &FieldError{Field: "Payload", Reason: `contains \u0000, which PostgreSQL jsonb cannot store`}
	}
	return b, nil
}
