package relay

import (
	"errors"
	"fmt"

	"github.com/outbox-relay/outbox-relay/outbox"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

// MessageSchema names table-less events (pg_logical_emit_message) in
// their Outbox-Table header and dead-letter records: MessageSchema.<prefix>
// (router.MessageTable).
const MessageSchema = router.MessageSchema

// Reason classes of logical messages the relay cannot route.
const (
	ClassNonTransactional = "non_transactional"
	ClassInvalidEnvelope  = "invalid_envelope"
	// ClassStretchUnread is the dead-letter record of a stretch of WAL
	// the slot was advanced past (a publication dropped and created
	// again) whose logical messages could not be read: the message
	// publication did not cover it. One record per message prefix.
	ClassStretchUnread = "stretch_unread"
)

// messageError is why a logical message was dead-lettered.
type messageError struct {
	class, reason string
}

func (e *messageError) Error() string       { return e.reason }
func (e *messageError) ReasonClass() string { return e.class }

// messagePrefixes are the configured pg_logical_emit_message prefixes
// (router.Config.Messages); other prefixes are other applications'
// messages, not outbox events.
type messagePrefixes map[string]bool

func newMessagePrefixes(prefixes []string) messagePrefixes {
	m := make(messagePrefixes, len(prefixes))
	for _, p := range prefixes {
		m[p] = true
	}
	return m
}

// envelope parses msg's envelope, or says why msg cannot be an event.
func envelope(msg *replication.Message) (*outbox.Envelope, error) {
	if !msg.Transactional {
		return nil, &messageError{class: ClassNonTransactional, reason: fmt.Sprintf("logical message with prefix %q was emitted non-transactionally: it is decoded whether or not its transaction commits, so it cannot be an outbox event; use pg_logical_emit_message(true, ...)", msg.Prefix)}
	}
	env, err := outbox.ParseEnvelope(msg.Content)
	if err != nil {
		var ee *outbox.EnvelopeError
		reason := err.Error()
		if errors.As(err, &ee) {
			reason = fmt.Sprintf("logical message with prefix %q: %v", msg.Prefix, ee)
		}
		return nil, &messageError{class: ClassInvalidEnvelope, reason: reason}
	}
	return &env, nil
}
