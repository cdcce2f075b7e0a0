package reconcile

import "errors"

var (
	// ErrInvalidConfig reports a Config that cannot be used.
	ErrInvalidConfig = errors.New("invalid reconcile configuration")
	// ErrNoTimeColumn means an outbox table has no occurred-at column, so
	// rows cannot be selected by time.
	ErrNoTimeColumn = errors.New("outbox table has no occurred-at column")
	// ErrTableMissing means a configured outbox table does not exist.
	ErrTableMissing = errors.New("outbox table does not exist")
	// ErrTooManyRows means the time window holds more rows than the
	// configured limit; a narrower window keeps memory bounded.
	ErrTooManyRows = errors.New("too many rows in the time window")
)
