package consumer

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/contract"
)

// outcomeDiscarded is the consumed_message outcome of a discarded event.
const outcomeDiscarded = "discarded"

// Discarded is what [RecordDiscard] did.
type Discarded struct {
	// DedupRecorded: the event now has a consumed_message row with outcome
	// 'discarded' (false when the event id was consumed before).
	DedupRecorded bool
	// PositionMoved: the aggregate's version-check position stood just
	// before the event's version and now stands at it.
	PositionMoved bool
}

// RecordDiscard settles, in the caller's transaction tx, an event an
// operator discarded instead of applying (package dlq calls it in the
// audited transaction of `outbox-relay dlq discard`): the event is recorded
// in consumed_message with outcome 'discarded', so that a redelivery is a
// duplicate and never applied, and an aggregate whose version-check position
// stands just before the event's version is moved past it, so that the
// consumer's later versions are not gaps for good. (A consumer finding a gap
// also skips versions whose dead letters were discarded, for the other
// orders.) ev needs the fields of [ContentHash].
func RecordDiscard(ctx context.Context, tx pgx.Tx, consumer string, ev *contract.Event, reason string) (Discarded, error) {
	var d Discarded
	hash := ContentHash(ev)
	tag, err := tx.Exec(ctx, insertConsumed, consumer, ev.ID, hash, ev.Type, ev.AggregateType,
		ev.AggregateID, ev.AggregateVersion, outcomeDiscarded, reason)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.CheckViolation {
			return d, fmt.Errorf("%w: consumed_message does not accept the 'discarded' outcome yet; run sql/consumer.sql, or start the upgraded consumer once: %w", ErrSchemaOutdated, err)
		}
		return d, fmt.Errorf("record discarded event %s: %w", ev.ID, err)
	}
	d.DedupRecorded = tag.RowsAffected() == 1
	tag, err = tx.Exec(ctx, `
		UPDATE consumer_aggregate_position
		SET version = $4, event_id = $5, content_hash = $6, updated_at = CURRENT_TIMESTAMP
		WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND version = $4 - 1`,
		consumer, ev.AggregateType, ev.AggregateID, ev.AggregateVersion, ev.ID, hash)
	if err != nil {
		return d, fmt.Errorf("move %s past discarded version %d: %w", aggregateName(ev.AggregateType, ev.AggregateID), ev.AggregateVersion, err)
	}
	d.PositionMoved = tag.RowsAffected() == 1
	return d, nil
}
