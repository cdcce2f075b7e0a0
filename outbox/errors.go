package outbox

import (
	"errors"
	"fmt"
)

var (
	// ErrInvalidEvent reports an event that cannot be recorded; the error
	// is a *FieldError naming the field.
	ErrInvalidEvent = errors.New("invalid outbox event")
	// ErrInvalidConfig reports a bad Writer configuration.
	ErrInvalidConfig = errors.New("invalid outbox writer config")
	// ErrInvalidEnvelope reports a logical-decoding message content that is
	// not a valid Envelope; the error is an *EnvelopeError.
	ErrInvalidEnvelope = errors.New("invalid outbox message envelope")
)

// FieldError names the event field that failed validation.
type FieldError struct {
	Field  string
	Reason string
}

func (e *FieldError) Error() string {
	return fmt.Sprintf("%s: %s %s", ErrInvalidEvent, e.Field, e.Reason)
}

// Unwrap lets errors.Is(err, ErrInvalidEvent) match.
func (e *FieldError) Unwrap() error { return ErrInvalidEvent }

// EnvelopeError names the envelope field that failed to parse.
type EnvelopeError struct {
	Field  string
	Reason string
}

func (e *EnvelopeError) Error() string {
	if e.Field == "" {
		return fmt.Sprintf("%s: %s", ErrInvalidEnvelope, e.Reason)
	}
	return fmt.Sprintf("%s: field %q %s", ErrInvalidEnvelope, e.Field, e.Reason)
}

// Unwrap lets errors.Is(err, ErrInvalidEnvelope) match.
func (e *EnvelopeError) Unwrap() error { return ErrInvalidEnvelope }
