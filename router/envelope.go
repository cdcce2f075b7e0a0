package router

import (
	"errors"
	"time"

	"github.com/outbox-relay/outbox-relay/outbox"
	"github.com/outbox-relay/outbox-relay/replication"
)

// MessageSchema names table-less events (pg_logical_emit_message) on the
// wire: the events of a message prefix (Config.Messages) carry
// MessageTable(prefix), MessageSchema.<prefix>, in Outbox-Table and as
// {schema}.{table} of their subject template. PostgreSQL reserves schema
// names starting with pg_, so no real table can collide with it.
const MessageSchema = "pg_logical_message"

// RouteEnvelope maps a logical message's parsed envelope to a message, as
// Route maps a row: the same checks in the same order, subjects and headers
// made the same way, with the prefix's MessageConfig. Errors are Route's;
// dead-letter the message with DeadLetterLogical.
func (r *Router) RouteEnvelope(msg *replication.Message, env *outbox.Envelope, commit CommitInfo) (*Message, error) {
	rule := r.messages[msg.Prefix]
	if rule == nil {
		return nil, &RouteError{
			Table:  MessageTable(msg.Prefix),
			Class:  ClassUnknownTable,
			Reason: "the message prefix is not in the router configuration (add it to messages: [{prefix: " + msg.Prefix + "}])",
		}
	}
	ev := event{lsn: msg.LSN}
	if err := readEnvelope(rule, env, &ev); err != nil {
		return nil, err
	}
	return r.route(rule, &ev, commit)
}

// readEnvelope takes an event's fields from env, checked as plan.read
// checks a row's; an error names the envelope field in Column. Envelope
// fields are strings and a time, so nothing is parsed again: the version is
// already an int64, and occurred_at becomes what a timestamptz column of
// the same instant gives (UTC, microseconds).
func readEnvelope(rule *tableRule, env *outbox.Envelope, ev *event) *RouteError {
	fc := fieldCheck{rule: rule}
	ev.eventID = []byte(env.EventID)
	if len(ev.eventID) == 0 {
		fc.fail(DefaultEventIDColumn, ClassInvalidField, "the event id is empty")
	}
	fc.headerSafe(DefaultEventIDColumn, ev.eventID)
	if fc.err == nil {
		fc.eventID = ev.eventID
	}
	ev.aggID = []byte(env.AggregateID)
	fc.headerSafe(DefaultAggregateIDColumn, ev.aggID)
	ev.version = env.AggregateVersion
	ev.eventType = []byte(env.EventType)
	if len(ev.eventType) == 0 {
		fc.fail(DefaultEventTypeColumn, ClassInvalidField, "the event type is empty")
	}
	fc.headerSafe(DefaultEventTypeColumn, ev.eventType)
	ev.aggType = rule.aggTypeConstB
	if len(ev.aggType) == 0 {
		ev.aggType = []byte(env.AggregateType)
		fc.headerSafe(DefaultAggregateTypeColumn, ev.aggType)
	}
	if len(ev.aggType) == 0 {
		ev.aggType = rule.nameB
	}
	ev.payload = env.Payload
	if ev.payload == nil {
		ev.payload = []byte{}
	}
	if at := env.OccurredAt; !at.IsZero() && at.Year() >= 1 {
		t := at.UTC().Truncate(time.Microsecond)
		if y := t.Year(); y < 1 || y > 9999 {
			fc.fail(DefaultOccurredAtColumn, ClassInvalidField, "occurred_at "+quoteValue([]byte(at.Format(time.RFC3339Nano)))+" "+errTimestamp.Error())
		}
		ev.occurredAt, ev.hasOccurred = t, true
	}
	return fc.err
}

// DeadLetterLogical builds the dead-letter record of a logical message
// with a configured prefix that cannot become an event: emitted
// non-transactionally, an invalid envelope, or one RouteEnvelope refused.
// It is DeadLetter's record for the table MessageTable(prefix) at the
// message's LSN, whose row is the message as emitted:
//
//	{..., "row": {"content": "..."}, ...}
//
// env is the parsed envelope, nil when there is none; its event id names
// the record when reason does not. It never fails and is safe for
// concurrent use.
func (r *Router) DeadLetterLogical(msg *replication.Message, env *outbox.Envelope, commit CommitInfo, reason error) *Message {
	rec := dlqRecord{
		table:  MessageTable(msg.Prefix),
		lsn:    msg.LSN,
		commit: commit,
		row:    []dlqField{{name: "content", val: msg.Content}},
	}
	rec.setReason(reason)
	var re *RouteError
	if errors.As(reason, &re) {
		rec.eventID, rec.subject = re.EventID, re.Subject
	}
	if rec.eventID == "" && env != nil {
		rec.eventID = env.EventID
	}
	return r.buildDLQ(&rec)
}
