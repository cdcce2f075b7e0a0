// Package contract defines the message contract between outbox-relay and the
// services that consume its events: the NATS headers the relay sets on every
// event and on every dead-letter record, and a parser that turns the headers of
// a received message back into a typed [Event].
//
// The relay (router package) writes these headers and the consumer library
// reads them; both import this package so the two sides cannot drift apart.
// The contract is documented for other languages in the README ("Header
// contract").
package contract

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

// Event headers, set by the relay on every event it publishes.
const (
	// MsgID is JetStream's de-duplication header; the relay sets it to the
	// event id so a re-publish after a crash is dropped by the stream.
	MsgID = "Nats-Msg-Id"
	// EventID is the outbox row's event id (a UUID in the default schema).
	EventID = "Outbox-Event-Id"
	// EventType is the outbox row's event type, e.g. RegistrationConfirmed.
	EventType = "Outbox-Event-Type"
	// AggregateType is the aggregate type: the row's aggregate_type column,
	// the table's configured constant, or the table name.
	AggregateType = "Outbox-Aggregate-Type"
	// AggregateID is the aggregate id, unescaped (the subject holds the
	// escaped form).
	AggregateID = "Outbox-Aggregate-Id"
	// AggregateVersion is the aggregate version as a decimal int64.
	AggregateVersion = "Outbox-Aggregate-Version"
	// OccurredAt is the row's occurred_at in RFC 3339 with nanoseconds, UTC.
	// Absent when the table maps no occurred_at column.
	OccurredAt = "Outbox-Occurred-At"
	// CommitLSN is the commit LSN of the transaction that inserted the row,
	// in PostgreSQL's text form (e.g. 0/16B3748).
	CommitLSN = "Outbox-Commit-LSN"
	// CommitTime is the commit time of that transaction, RFC 3339 UTC.
	CommitTime = "Outbox-Commit-Time"
	// Table is the schema-qualified outbox table, e.g. public.outbox, or
	// "message:<prefix>" for a table-less event.
	Table = "Outbox-Table"
	// ContentType is always application/json for events.
	ContentType = "Content-Type"
	// ExtraPrefix starts the name of headers mapped from extra columns when
	// the configuration does not name them explicitly.
	ExtraPrefix = "Outbox-Extra-"
)

// Dead-letter headers, set by the relay on records of its dead-letter stream.
const (
	// DLQReason is the human-readable reason the row could not be relayed.
	DLQReason = "Outbox-DLQ-Reason"
	// DLQReasonClass is a stable machine-readable class of the reason, e.g.
	// missing_field, invalid_field, too_large, rejected_by_broker.
	DLQReasonClass = "Outbox-DLQ-Reason-Class"
	// DLQLSN is the WAL position of the row's change.
	DLQLSN = "Outbox-DLQ-LSN"
)

// JSONContentType is the value of the Content-Type header of events.
const JSONContentType = "application/json"

// CloudEvents binary content mode headers (the NATS protocol binding of
// CloudEvents 1.0: every attribute is a header named "ce-" + attribute, the
// data content type is the "content-type" header). The relay sets them
// beside the Outbox-* headers on the events of tables and message prefixes
// whose cloudevents option is on.
const (
	CESpecVersion = "ce-specversion"
	CEID          = "ce-id"
	CESource      = "ce-source"
	CEType        = "ce-type"
	CETime        = "ce-time"
	CESubject     = "ce-subject"
	// CEAggregateVersion is the extension attribute aggregateversion: the
	// aggregate version, so that an event keeps its order position when a
	// CloudEvents tool forwards only the ce-* headers.
	CEAggregateVersion = "ce-aggregateversion"
	// CEAggregateType is the extension attribute aggregatetype: the
	// aggregate type alone, so that ce-subject ("<type>/<id>") splits
	// where the relay joined it even when the type holds a '/'.
	CEAggregateType = "ce-aggregatetype"
	// CEContentType is the binding's lower-case content type header. NATS
	// header names are case-sensitive, so it is set beside Content-Type,
	// with the same value.
	CEContentType = "content-type"
)

// CESpecVersionValue is the CloudEvents specification version the relay
// writes in ce-specversion.
const CESpecVersionValue = "1.0"

// Event is the typed form of an event message's headers and payload.
type Event struct {
	ID               string
	Type             string
	AggregateType    string
	AggregateID      string
	AggregateVersion int64
	OccurredAt       time.Time // zero when absent
	CommitLSN        string
	CommitTime       time.Time // zero when absent
	Table            string
	Payload          []byte
}

// ErrInvalidEvent reports a message that does not follow the contract: a
// required header is missing or malformed. It is permanent: redelivering the
// same message cannot fix it.
var ErrInvalidEvent = errors.New("invalid outbox event")

// FieldError names the header that broke the contract.
type FieldError struct {
	Header string
	Reason string
}

func (e *FieldError) Error() string {
	return fmt.Sprintf("%s: header %s %s", ErrInvalidEvent, e.Header, e.Reason)
}

// Unwrap lets errors.Is(err, ErrInvalidEvent) match.
func (e *FieldError) Unwrap() error { return ErrInvalidEvent }

// Parse reads an event from a message's headers and data. It requires the
// event id, type, aggregate type, aggregate id and aggregate version headers;
// the time headers are parsed when present.
//
// A message without Outbox-Event-Type but with ce-id is read in CloudEvents
// binary content mode instead (see ParseCloudEvents); a message with both
// forms is read from its Outbox-* headers.
func Parse(h nats.Header, data []byte) (Event, error) {
	if h.Get(EventType) == "" && h.Get(CEID) != "" {
		return ParseCloudEvents(h, data)
	}
	ev := Event{
		ID:            h.Get(EventID),
		Type:          h.Get(EventType),
		AggregateType: h.Get(AggregateType),
		CommitLSN:     h.Get(CommitLSN),
		Table:         h.Get(Table),
		Payload:       data,
	}
	if ev.ID == "" {
		ev.ID = h.Get(MsgID)
	}
	// Values() keeps an empty aggregate id apart from a missing header: the
	// relay escapes empty ids in subjects, so they are legal.
	ids := h.Values(AggregateID)
	switch {
	case ev.ID == "":
		return ev, &FieldError{Header: EventID, Reason: "is missing"}
	case ev.Type == "":
		return ev, &FieldError{Header: EventType, Reason: "is missing"}
	case len(ids) == 0:
		return ev, &FieldError{Header: AggregateID, Reason: "is missing"}
	}
	ev.AggregateID = ids[0]
	v := h.Get(AggregateVersion)
	if v == "" {
		return ev, &FieldError{Header: AggregateVersion, Reason: "is missing"}
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return ev, &FieldError{Header: AggregateVersion, Reason: fmt.Sprintf("is not an int64: %q", v)}
	}
	ev.AggregateVersion = n
	if s := h.Get(OccurredAt); s != "" {
		if ev.OccurredAt, err = time.Parse(time.RFC3339Nano, s); err != nil {
			return ev, &FieldError{Header: OccurredAt, Reason: fmt.Sprintf("is not RFC 3339: %q", s)}
		}
	}
	if s := h.Get(CommitTime); s != "" {
		if ev.CommitTime, err = time.Parse(time.RFC3339Nano, s); err != nil {
			return ev, &FieldError{Header: CommitTime, Reason: fmt.Sprintf("is not RFC 3339: %q", s)}
		}
	}
	return ev, nil
}

// ParseCloudEvents reads an event from CloudEvents binary-mode headers
// alone: ce-specversion must be 1.0; ce-id is the event id and ce-type its
// type; ce-subject is "<aggregate type>/<aggregate id>" (see
// SplitCESubject); ce-aggregateversion (an extension the relay sets) is the
// aggregate version; ce-time, when present, is the occurrence time. Commit
// LSN, commit time and table stay empty: CloudEvents has no attributes for
// them.
func ParseCloudEvents(h nats.Header, data []byte) (Event, error) {
	ev := Event{ID: h.Get(CEID), Type: h.Get(CEType), Payload: data}
	subject := h.Values(CESubject)
	switch sv := h.Get(CESpecVersion); {
	case sv != CESpecVersionValue:
		return ev, &FieldError{Header: CESpecVersion, Reason: fmt.Sprintf("is %q, want %q", sv, CESpecVersionValue)}
	case ev.ID == "":
		return ev, &FieldError{Header: CEID, Reason: "is missing"}
	case ev.Type == "":
		return ev, &FieldError{Header: CEType, Reason: "is missing"}
	case len(subject) == 0:
		return ev, &FieldError{Header: CESubject, Reason: "is missing (want <aggregate type>/<aggregate id>)"}
	}
	var ok bool
	if ev.AggregateType, ev.AggregateID, ok = SplitCESubject(subject[0], h.Values(CEAggregateType)); !ok {
		return ev, &FieldError{Header: CESubject, Reason: fmt.Sprintf("is %q, want <aggregate type>/<aggregate id> (with %s, that type first)", subject[0], CEAggregateType)}
	}
	v := h.Get(CEAggregateVersion)
	if v == "" {
		return ev, &FieldError{Header: CEAggregateVersion, Reason: "is missing (the consumer orders each aggregate's events by it)"}
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return ev, &FieldError{Header: CEAggregateVersion, Reason: fmt.Sprintf("is not an int64: %q", v)}
	}
	ev.AggregateVersion = n
	if s := h.Get(CETime); s != "" {
		if ev.OccurredAt, err = time.Parse(time.RFC3339Nano, s); err != nil {
			return ev, &FieldError{Header: CETime, Reason: fmt.Sprintf("is not RFC 3339: %q", s)}
		}
	}
	return ev, nil
}

// CESubjectOf returns the ce-subject of an aggregate: "<type>/<id>".
func CESubjectOf(aggType, aggID string) string { return aggType + "/" + aggID }

// SplitCESubject splits a ce-subject back into the aggregate type and id.
// aggType holds the ce-aggregatetype values: the relay sets it, and the
// subject then splits right after that type, whatever '/' the type or the
// id holds. Without it (another producer) the subject splits at its first
// '/'. An empty type ("/42", an untyped aggregate) is an aggregate like
// any other: its Outbox-* twin has the same empty type.
func SplitCESubject(subject string, aggType []string) (typ, id string, ok bool) {
	if len(aggType) > 0 {
		id, ok = strings.CutPrefix(subject, aggType[0]+"/")
		return aggType[0], id, ok
	}
	return strings.Cut(subject, "/")
}

// EventKey is an event's identity across the relay and its tools: the
// outbox table (Outbox-Table) and the event id, which is unique only
// within its table. ok is false without a table: a message that does not
// say which table's row it is (another producer's, a polling relay's)
// identifies no row, so it can prove none relayed.
func EventKey(table, eventID string) (key string, ok bool) {
	return table + "\x00" + eventID, table != ""
}
