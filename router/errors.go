package router

import (
	"errors"
	"fmt"
)

// ErrInvalidConfig is wrapped by every error Config.Validate and New return
// for a configuration that cannot work. Match it with errors.Is; use
// errors.As with *ConfigError to find the offending YAML key.
var ErrInvalidConfig = errors.New("invalid router configuration")

// ErrInvalidOption is wrapped by the error New returns for a bad Option.
var ErrInvalidOption = errors.New("invalid router option")

// ErrUnroutable is wrapped by every error Route returns. Such an error is
// permanent: routing the same row again gives the same error, so the relay
// dead-letters the row (DeadLetter) instead of retrying it.
var ErrUnroutable = errors.New("unroutable outbox row")

// ConfigError names the YAML key of a configuration mistake and says how to
// fix it. It wraps ErrInvalidConfig.
type ConfigError struct {
	// Path is the YAML key path, e.g. "tables[1].subject".
	Path string
	// Msg says what is wrong and how to fix it.
	Msg string
}

func (e *ConfigError) Error() string { return e.Path + ": " + e.Msg }

// Unwrap lets errors.Is(err, ErrInvalidConfig) match.
func (e *ConfigError) Unwrap() error { return ErrInvalidConfig }

// Reason classes: stable, snake_case names for why a row was dead-lettered.
// They label metrics and fill the Outbox-DLQ-Reason-Class header, so they
// never change once released.
const (
	// ClassMissingColumn: a configured column is not in the table (dropped
	// or renamed by an ALTER TABLE, or misspelled in the configuration).
	ClassMissingColumn = "missing_column"
	// ClassNullField: a required field is NULL.
	ClassNullField = "null_field"
	// ClassInvalidField: a field's value cannot be used (an aggregate
	// version that is not an int64, an unparsable occurred_at, an empty
	// event id or type, a value sent in binary, a value a NATS header cannot
	// carry unchanged).
	ClassInvalidField = "invalid_field"
	// ClassSubjectTooLong: the subject is longer than max_subject_bytes.
	ClassSubjectTooLong = "subject_too_long"
	// ClassTooLarge: payload plus headers exceed the NATS max payload.
	ClassTooLarge = "too_large"
	// ClassHeaderTooLarge: the header block exceeds JetStream's limit of
	// MaxHeaderBytes (error 10097), whatever max_payload allows: a long
	// event type, event id or mapped extra column.
	ClassHeaderTooLarge = "header_too_large"
	// ClassUnknownTable: the row's table is not in the configuration.
	ClassUnknownTable = "unknown_table"
	// ClassRejectedByBroker: JetStream permanently refused the message.
	// DeadLetter uses it for a reason that exposes no class of its own.
	ClassRejectedByBroker = "rejected_by_broker"
)

// ReasonClasser is implemented by errors that know their dead-letter reason
// class. DeadLetter looks for it with errors.As, so a publisher can give a
// broker rejection a more precise class than rejected_by_broker.
type ReasonClasser interface {
	ReasonClass() string
}

// RouteError says why a row could not be turned into a message. It wraps
// ErrUnroutable.
type RouteError struct {
	// Table is the row's schema-qualified table.
	Table string
	// Column is the table column at fault, "" when the error is not about
	// one column.
	Column string
	// Class is one of the Class* constants.
	Class string
	// Reason says what is wrong and how to fix it.
	Reason string
	// Subject is the subject the message would have had, when routing got
	// far enough to build it; the dead-letter record keeps it.
	Subject string
	// EventID is the row's event id, when it was read before the error.
	EventID string
}

func (e *RouteError) Error() string {
	if e.Column == "" {
		return fmt.Sprintf("%s: %s: %s (%s)", ErrUnroutable, e.Table, e.Reason, e.Class)
	}
	return fmt.Sprintf("%s: %s column %s: %s (%s)", ErrUnroutable, e.Table, e.Column, e.Reason, e.Class)
}

// Unwrap lets errors.Is(err, ErrUnroutable) match.
func (e *RouteError) Unwrap() error { return ErrUnroutable }

// ReasonClass returns e.Class.
func (e *RouteError) ReasonClass() string { return e.Class }
