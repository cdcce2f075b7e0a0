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
		return &PublishError{Subject: subject, Class: "too_large", API: api, Err: ErrRejected}
	case errCodeHeaderTooLarge:
		return &PublishError{Subject: subject, Class: "header_too_large", API: api, Err: ErrRejected}
	case errCodeStreamMismatch:
		return &PublishError{Subject: subject, Class: "stream_mismatch", API: api, Err: ErrRejected}
	}
	// Anything else (stream full with discard=new, storage failure, no
	// leader, limits) may clear up; stopping beats dropping.
	return &PublishError{Subject: subject, Class: "api_error", API: api, Err: ErrTransient}
}
