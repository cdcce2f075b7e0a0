package publisher

import (
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"
)

var (
	// ErrRejected marks a permanent rejection of a message by the broker:
	// resending the same message cannot succeed, so it is dead-lettered.
	ErrRejected = errors.New("rejected by the broker")
	// ErrNoStream means no stream is bound to the message's subject.
	ErrNoStream = errors.New("no stream is bound to the subject")
	// ErrTransient marks a failure that a retry may cure: a timeout, no
	// responders, a full or unavailable stream, a reconnect.
	ErrTransient = errors.New("transient publish failure")
	// ErrClosed is returned after the NATS connection closed for good.
	ErrClosed = errors.New("publisher closed")
	// ErrInvalidConfig reports a bad Config value.
	ErrInvalidConfig = errors.New("invalid publisher config")
	// ErrInvalidOption reports an Option given a value it cannot use.
	ErrInvalidOption = errors.New("invalid publisher option")
)

// Classes of a PublishError (PublishError.Class), the label values of the
// relay's retry and dead-letter metrics.
const (
	// Transient: the publish is retried.
	ClassConnection   = "connection"
	ClassNoResponders = "no_responders"
	ClassBadAck       = "bad_ack"
	ClassTimeout      = "timeout"
	ClassAPIError     = "api_error"
	// ClassBatch: a batch failed without a PublishError of its own.
	ClassBatch = "batch"
	// Rejections: the message is dead-lettered.
	ClassStreamMismatch = "stream_mismatch"
	ClassNoStream       = "no_stream"
	// The broker refused the message's size: the same classes as the
	// router's own size checks (router.ClassTooLarge, ClassHeaderTooLarge).
	ClassTooLarge       = "too_large"
	ClassHeaderTooLarge = "header_too_large"
)

// RetryClasses are the classes of the transient failures, which are
// retried.
var RetryClasses = []string{ClassConnection, ClassNoResponders, ClassBadAck, ClassTimeout, ClassAPIError, ClassBatch}

// PublishError describes why one publish attempt failed.
type PublishError struct {
	Subject string
	// Class is a stable snake_case name used in metrics and dead-letter
	// records: timeout, no_responders, too_large, no_stream, api_error...
	Class string
	API   *jetstream.APIError // set when JetStream answered with an error
	Err   error               // ErrTransient or ErrRejected, possibly wrapped
}

func (e *PublishError) Error() string {
	msg := fmt.Sprintf("publish to %s: %s", e.Subject, e.Class)
	if e.API != nil {
		msg += fmt.Sprintf(" (jetstream %d/%d: %s)", e.API.Code, e.API.ErrorCode, e.API.Description)
	}
	if e.Err != nil && !errors.Is(e.Err, ErrTransient) && !errors.Is(e.Err, ErrRejected) {
		msg += ": " + e.Err.Error()
	}
	return msg
}

// Unwrap exposes ErrTransient or ErrRejected to errors.Is.
func (e *PublishError) Unwrap() error { return e.Err }

// ReasonClass is the dead-letter reason class.
func (e *PublishError) ReasonClass() string { return e.Class }

// JetStream error codes that no retry can cure, beyond nats.go's
// jetstream.JSErrCodeStreamMessageExceedsMaximum (stream max_msg_size
// exceeded), which it does not export for these.
const (
	errCodeStreamMismatch = 10060 // expected stream does not match
	errCodeHeaderTooLarge = 10097 // header block over 64 KiB
)

func classifyAPIError(subject string, api *jetstream.APIError) *PublishError {
	switch api.ErrorCode {
	case jetstream.JSErrCodeStreamMessageExceedsMaximum:
		return &PublishError{Subject: subject, Class: ClassTooLarge, API: api, Err: ErrRejected}
	case errCodeHeaderTooLarge:
		return &PublishError{Subject: subject, Class: ClassHeaderTooLarge, API: api, Err: ErrRejected}
	case errCodeStreamMismatch:
		return &PublishError{Subject: subject, Class: ClassStreamMismatch, API: api, Err: ErrRejected}
	}
	// Anything else (stream full with discard=new, storage failure, no
	// leader, limits) may clear up; stopping beats dropping.
	return &PublishError{Subject: subject, Class: ClassAPIError, API: api, Err: ErrTransient}
}
