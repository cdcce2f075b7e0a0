package relay

import (
	"errors"
	"fmt"

	"github.com/outbox-relay/outbox-relay/outbox"
	"github.com/outbox-relay/outbox-relay/replication"
)

// MessageSchema is the schema name under which table-less events
// (pg_logical_emit_message) are routed: the router sees each configured
// prefix as a table MessageSchema.<prefix>. PostgreSQL reserves schema names
// starting with pg_, so no real table can collide with it.
const MessageSchema = "pg_logical_message"

// Reason classes of logical messages the relay cannot route.
const (
	ClassNonTransactional = "non_transactional"
	ClassInvalidEnvelope  = "invalid_envelope"
)

// messageError is why a logical message was dead-lettered.
type messageError struct {
	class, reason string
}

func (e *messageError) Error() string       { return e.reason }
func (e *messageError) ReasonClass() string { return e.class }

// envelopeColumns are the synthetic relation's columns: the default outbox
// column names, so the router's defaults map them.
var envelopeColumns = []string{"event_id", "aggregate_type", "aggregate_id", "aggregate_version", "event_type", "payload", "occurred_at"}

// messageRoutes turns logical messages with configured prefixes into
// synthetic rows the router maps like outbox rows, so table-less events get
// the same subjects and header contract.
type messageRoutes struct {
	rels map[string]*replication.Relation // prefix -> synthetic relation
	raw  map[string]*replication.Relation // prefix -> one-column relation for dead letters
	ins  replication.Insert
	vals [7]replication.Value
	buf  []byte
}

func newMessageRoutes(prefixes []string) *messageRoutes {
	m := &messageRoutes{rels: map[string]*replication.Relation{}, raw: map[string]*replication.Relation{}}
	for i, p := range prefixes {
		rel := &replication.Relation{ID: 0xFFFF0000 + uint32(2*i), Namespace: MessageSchema, Name: p}
		for _, c := range envelopeColumns {
			rel.Columns = append(rel.Columns, replication.Column{Name: c})
		}
		m.rels[p] = rel
		m.raw[p] = &replication.Relation{ID: 0xFFFF0001 + uint32(2*i), Namespace: MessageSchema, Name: p, Columns: []replication.Column{{Name: "content"}}}
	}
	return m
}

// insert returns the synthetic row of msg, or a routing error and the raw
// row for the dead-letter record. ok is false for a prefix that is not
// configured: another application's message, not an outbox event.
func (m *messageRoutes) insert(msg *replication.Message) (ins *replication.Insert, err error, ok bool) {
	rel, ok := m.rels[msg.Prefix]
	if !ok {
		return nil, nil, false
	}
	raw := &replication.Insert{Relation: m.raw[msg.Prefix], Values: []replication.Value{{Kind: replication.ValueText, Data: msg.Content}}, LSN: msg.LSN, Tx: msg.Tx}
	if !msg.Transactional {
		return raw, &messageError{class: ClassNonTransactional, reason: fmt.Sprintf("logical message with prefix %q was emitted non-transactionally: it is decoded whether or not its transaction commits, so it cannot be an outbox event; use pg_logical_emit_message(true, ...)", msg.Prefix)}, true
	}
	env, perr := outbox.ParseEnvelope(msg.Content)
	if perr != nil {
		var ee *outbox.EnvelopeError
		reason := perr.Error()
		if errors.As(perr, &ee) {
			reason = fmt.Sprintf("logical message with prefix %q: %v", msg.Prefix, ee)
		}
		return raw, &messageError{class: ClassInvalidEnvelope, reason: reason}, true
	}
	m.buf = m.buf[:0]
	text := func(s string) replication.Value {
		start := len(m.buf)
		m.buf = append(m.buf, s...)
		return replication.Value{Kind: replication.ValueText, Data: m.buf[start:len(m.buf):len(m.buf)]}
	}
	m.vals[0] = text(env.EventID)
	m.vals[1] = text(env.AggregateType)
	m.vals[2] = text(env.AggregateID)
	m.vals[3] = text(fmt.Sprint(env.AggregateVersion))
	m.vals[4] = text(env.EventType)
	m.vals[5] = replication.Value{Kind: replication.ValueText, Data: env.Payload}
	// PostgreSQL's ISO text form, which the router parses for occurred_at.
	m.vals[6] = text(env.OccurredAt.UTC().Format("2006-01-02 15:04:05.999999") + "+00")
	if env.OccurredAt.IsZero() || env.OccurredAt.Year() < 1 {
		m.vals[6] = replication.Value{Kind: replication.ValueNull}
	}
	m.ins = replication.Insert{Relation: rel, Values: m.vals[:], LSN: msg.LSN, Tx: msg.Tx}
	return &m.ins, nil, true
}
