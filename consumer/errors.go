package consumer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
)

// Class is how a failure is handled. Handlers choose the class of their
// errors with [Transient], [Permanent] and [Reject]; anything else is
// [ClassUnknown], except database unavailability, which is recognised as
// [ClassTransient] (see [ClassOf]).
type Class string

// Failure classes. The string values appear in metrics labels, logs and the
// failure_class column of consumer_dead_letter.
const (
	// ClassTransient: the cause is expected to go away (database or network
	// unavailable, serialization failure). Retried with capped exponential
	// backoff; dead-lettered only when Config.TransientAttempts is set and
	// reached.
	ClassTransient Class = "transient"
	// ClassPermanent: retrying cannot help (schema incompatible, a required
	// field missing, a message breaking the header contract). Dead-lettered
	// at once.
	ClassPermanent Class = "permanent"
	// ClassRejected: a business rejection. Not a failure: recorded as
	// rejected in the same transaction as the dedup row, acknowledged,
	// counted, never retried.
	ClassRejected Class = "rejected"
	// ClassUnknown: anything unclassified, including a handler panic.
	// Retried up to Config.MaxAttempts, then dead-lettered.
	ClassUnknown Class = "unknown"
	// ClassConflict: the same event id with other content, or the same
	// aggregate version with another event identity. Dead-lettered at once:
	// it is never an ordinary duplicate.
	ClassConflict Class = "conflict"
	// ClassGap: a later aggregate version arrived before the one the
	// consumer expects. Deferred up to Config.GapWait, then dead-lettered.
	ClassGap Class = "gap"
)

// Sentinel errors. Match them with errors.Is.
var (
	// ErrInvalidConfig reports a bad Config field or Option.
	ErrInvalidConfig = errors.New("invalid consumer config")
	// ErrSchemaMissing means the consumer's tables are not in the database.
	ErrSchemaMissing = errors.New("consumer schema missing")
	// ErrSchemaOutdated means the consumer's tables need an upgrade the
	// library could not apply by itself (see [Migrate]).
	ErrSchemaOutdated = errors.New("consumer schema outdated")
	// ErrDurableClash means the durable consumer named by Config.Name is
	// recorded as another database's, or filters other subjects: another
	// service seems to use the same Name.
	ErrDurableClash = errors.New("durable consumer belongs to another consumer")
	// ErrConflict is the error of a message classified ClassConflict.
	ErrConflict = errors.New("event conflict")
	// ErrGap is the error of a message classified ClassGap.
	ErrGap = errors.New("aggregate version gap")
	// ErrPanic wraps a recovered handler panic (classified ClassUnknown).
	ErrPanic = errors.New("handler panicked")
	// ErrRetentionTooShort is returned by the pruner when the configured
	// retention would let a redelivered or replayed event be applied twice.
	ErrRetentionTooShort = errors.New("dedup retention shorter than the redelivery and replay window")
)

// PanicError is a recovered handler panic. It matches ErrPanic and is
// classified ClassUnknown; the dead-letter reason includes the stack.
type PanicError struct {
	Value any
	Stack []byte
}

func (e *PanicError) Error() string { return fmt.Sprintf("%s: %v", ErrPanic, e.Value) }

// Unwrap lets errors.Is(err, ErrPanic) match.
func (e *PanicError) Unwrap() error { return ErrPanic }

// ClassError gives an error its handling class. Handlers build it with
// [Transient], [Permanent] or [Reject].
type ClassError struct {
	Class Class
	Err   error
}

func (e *ClassError) Error() string {
	if e.Err == nil {
		return string(e.Class)
	}
	return fmt.Sprintf("%s: %v", e.Class, e.Err)
}

// Unwrap returns the classified error.
func (e *ClassError) Unwrap() error { return e.Err }

// Transient marks err as transient: the message is retried with backoff.
// Transient(nil) is nil.
func Transient(err error) error {
	if err == nil {
		return nil
	}
	return &ClassError{Class: ClassTransient, Err: err}
}

// Permanent marks err as permanent: the message is dead-lettered without
// retrying. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &ClassError{Class: ClassPermanent, Err: err}
}

// RejectError is a business rejection returned through [Reject].
type RejectError struct {
	Reason string
}

func (e *RejectError) Error() string { return "rejected: " + e.Reason }

// Reject returns a business rejection: the handler's effects are rolled back,
// the event is recorded in consumed_message with outcome 'rejected' and the
// reason, and the message is acknowledged. Use it for "the business says no"
// (registration already cancelled, limit reached), never for infrastructure
// failures.
func Reject(reason string) error {
	return &ClassError{Class: ClassRejected, Err: &RejectError{Reason: reason}}
}

// ClassOf returns the handling class of err: the class given by [Transient],
// [Permanent] or [Reject] (the outermost one wins); ClassTransient for
// database unavailability (see [IsTransientDB]); ClassUnknown otherwise.
func ClassOf(err error) Class {
	var ce *ClassError
	if errors.As(err, &ce) {
		return ce.Class
	}
	if IsTransientDB(err) {
		return ClassTransient
	}
	return ClassUnknown
}

// IsTransientDB reports whether err means the database is unavailable or
// asked for a retry, so that running the same transaction later can succeed:
// a failed connection, a dropped connection, a timeout, and the SQLSTATEs of
// class 08 (connection exception), 53 (insufficient resources), 57P01-57P03
// (shutdown, crash, not yet accepting connections), 25006 (read-only
// transaction, typical just after a failover), 40001 and 40P01
// (serialization failure, deadlock) and 55P03 (lock not available). An
// exceeded context deadline is not transient by itself; the consumer classes
// one while beginning a message's transaction as transient, because nothing
// of the handler ran: it was spent waiting for a connection. It looks at error types and
// SQLSTATEs, never at message text.
func IsTransientDB(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		code := pgErr.Code
		switch {
		case pgerrcode.IsConnectionException(code),
			pgerrcode.IsInsufficientResources(code),
			code == pgerrcode.AdminShutdown,
			code == pgerrcode.CrashShutdown,
			code == pgerrcode.CannotConnectNow,
			// A read-only transaction right after a failover: the old
			// primary (or a standby) still answers until clients move.
			code == pgerrcode.ReadOnlySQLTransaction,
			code == pgerrcode.SerializationFailure,
			code == pgerrcode.DeadlockDetected,
			code == pgerrcode.LockNotAvailable:
			return true
		}
		return false
	}
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) {
		return true
	}
	// A deadline is the handler's own budget running out: retrying it
	// without limit could block its aggregate forever, so it stays unknown.
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return false
	}
	if pgconn.SafeToRetry(err) || pgconn.Timeout(err) {
		return true
	}
	// A connection that broke mid-statement: the server went away.
	var netErr net.Error
	switch {
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF),
		errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET),
		errors.Is(err, syscall.EPIPE), errors.Is(err, net.ErrClosed),
		errors.As(err, &netErr):
		return true
	}
	// pgx reports a connection it closed after a fatal error as "conn
	// closed"; the pool then replaces it.
	return errors.Is(err, pgconn.ErrConnClosed)
}
