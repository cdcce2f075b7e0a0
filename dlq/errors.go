package dlq

import "errors"

var (
	// ErrNotFound reports a dead-letter record that does not exist.
	ErrNotFound = errors.New("dead letter not found")
	// ErrNotOpen reports an action on a record that is not open (already
	// replayed, being replayed, or discarded).
	ErrNotOpen = errors.New("dead letter is not open")
	// ErrReasonRequired reports a discard without a reason.
	ErrReasonRequired = errors.New("a reason is required")
	// ErrActorRequired reports an audited action without an actor.
	ErrActorRequired = errors.New("an actor is required: pass --actor NAME (who performs the action, for the audit trail; it defaults to $USER, which is empty here)")
	// ErrNothingSelected reports an action whose selection matched no record.
	ErrNothingSelected = errors.New("no dead letter selected")
	// ErrUsage reports a command line that does not say what to act on.
	ErrUsage = errors.New("usage")
	// ErrReplayIncomplete reports a replay that did not finish in time or
	// whose records failed again.
	ErrReplayIncomplete = errors.New("replay incomplete")
	// ErrNotSupported reports an action the selected queue does not support.
	ErrNotSupported = errors.New("not supported")
)
