package cleanup

import "errors"

var (
	// ErrInvalidConfig reports a Config that cannot be used.
	ErrInvalidConfig = errors.New("invalid cleanup configuration")
	// ErrNoStateColumn means ModePublished was asked for a table without a
	// publish_state column.
	ErrNoStateColumn = errors.New("outbox table has no publish_state column")
	// ErrNotDurable means the event stream loses its events on a restart
	// (memory storage), so ModeStream cannot prove a row safe to delete.
	ErrNotDurable = errors.New("event stream is not durable")
)
