package consumer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"runtime/debug"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// The step is one message's part of a transaction: its dedup row, its
// version check, its handler, its position. A message alone runs it in a
// transaction of its own (runTx); a batch runs it for each message in one
// transaction (batchTx). The rules of what a message comes to live here
// only, so the two paths cannot disagree; what the paths add is what to do
// with the transaction afterwards, which stepOutcome tells them.

// stepOutcome is what a step left in its transaction.
type stepOutcome int

const (
	// stepWrote: the message's dedup row and effect (or recorded
	// rejection) are written; they, and its result, stand or fall with
	// the commit.
	stepWrote stepOutcome = iota
	// stepDecided: the message needs no effect (a duplicate, a conflict, a
	// gap). In a shared transaction nothing of it is left in it; alone,
	// the transaction is rolled back (or a replay's record closed).
	stepDecided
	// stepFailed: the message's own attempt failed, or its handler
	// rejected it (resRejectRedo); the transaction must roll back.
	stepFailed
	// stepBroken: a statement failed after the transaction's deadline
	// passed. The deadline is the transaction's: shared, no message is
	// charged with it; alone, it was the message's own budget.
	stepBroken
)

// stepIn is one message's part of a transaction.
type stepIn struct {
	it     *item
	reject *RejectError // redo as a rejection: no handler, the dedup row records it
	// recorded: the batch's dedup statement wrote the message's row
	// already; otherwise the step writes it, or finds it recorded.
	recorded bool
	// deferred: a BatchHandler applies the message after the batch's
	// steps, so the step does not call Handle.
	deferred bool
	// shared: other messages share the transaction, so a message that
	// needs no effect withdraws its dedup row instead of rolling back.
	shared bool
}

// stepResult is a step's outcome and the message's result.
type stepResult struct {
	outcome stepOutcome
	res     result
}

// step runs one message's part of the transaction tx.
func (c *Consumer) step(ctx context.Context, tx pgx.Tx, in stepIn) stepResult {
	it := in.it
	if !in.recorded {
		written, err := c.insertOne(ctx, tx, it, in.reject)
		if err != nil {
			return c.blockedInsert(ctx, in, err)
		}
		if !written {
			// Recorded before, or by an earlier message of the batch with
			// the same id: the stored hash decides.
			res := c.compareConsumed(ctx, tx, it)
			if res.kind == resFailed {
				return failedStep(ctx, res)
			}
			return stepResult{outcome: stepDecided, res: res}
		}
	}
	var pos *position
	if c.cfg.VersionCheck {
		var res result
		if res, pos = c.checkVersion(ctx, tx, it); res.kind != resApplied {
			if res.kind == resFailed {
				return failedStep(ctx, res)
			}
			return c.withdraw(ctx, tx, in, res)
		}
	}
	if in.reject == nil && !in.deferred {
		if err := c.callHandler(ctx, tx, it); err != nil {
			return failedStep(ctx, handlerResult(err))
		}
		if err := ctx.Err(); err != nil {
			// It ignored its context: nothing after it can commit.
			return failedStep(ctx, failed(err, fmt.Sprintf("handler returned after HandlerTimeout %s", c.cfg.HandlerTimeout)))
		}
	}
	if c.cfg.VersionCheck {
		if err := c.movePosition(ctx, tx, it, pos); err != nil {
			return failedStep(ctx, failed(err, "move aggregate position"))
		}
	}
	if in.reject != nil {
		return stepResult{outcome: stepWrote, res: result{kind: resRejected}}
	}
	return stepResult{outcome: stepWrote, res: result{kind: resApplied}}
}

// failedStep is the outcome of a step whose statement or handler failed
// with res. After the deadline every statement of the transaction fails:
// the failure says nothing about this message.
func failedStep(ctx context.Context, res result) stepResult {
	if ctx.Err() != nil {
		return stepResult{outcome: stepBroken, res: res}
	}
	return stepResult{outcome: stepFailed, res: res}
}

// withdraw ends the step of a message the version check decided (res)
// after its dedup row was written: in a shared transaction the row is
// deleted, so that nothing of the message commits and a later message with
// its id is recorded as it would be alone.
func (c *Consumer) withdraw(ctx context.Context, tx pgx.Tx, in stepIn, res result) stepResult {
	if in.shared {
		if _, err := tx.Exec(ctx, `DELETE FROM consumed_message WHERE consumer = $1 AND event_id = $2`, c.cfg.Name, in.it.m.ID); err != nil {
			return failedStep(ctx, failed(err, "withdraw consumed message"))
		}
	}
	return stepResult{outcome: stepDecided, res: res}
}

const insertConsumed = `
	INSERT INTO consumed_message (consumer, event_id, content_hash, event_type, aggregate_type,
		aggregate_id, aggregate_version, outcome, reason)
	VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
	ON CONFLICT (consumer, event_id) DO NOTHING`

// insertOne writes the dedup row of one message, recording the rejection
// when reject is set, and reports whether it was written (false: the event
// id is recorded already).
func (c *Consumer) insertOne(ctx context.Context, tx pgx.Tx, it *item, reject *RejectError) (bool, error) {
	tag, err := tx.Exec(ctx, insertConsumed, c.insertArgs(it, reject)...)
	return tag.RowsAffected() == 1, err
}

// insertArgs are insertConsumed's arguments for it (reject: recorded as
// rejected).
func (c *Consumer) insertArgs(it *item, reject *RejectError) []any {
	ev := &it.m.Event
	outcome, reason := outcomeApplied, (*string)(nil)
	if reject != nil {
		outcome, reason = outcomeRejected, &reject.Reason
	}
	return []any{c.cfg.Name, ev.ID, it.hash, ev.Type, ev.AggregateType,
		ev.AggregateID, ev.AggregateVersion, outcome, reason}
}

// handlerResult turns a handler's error into the message's result; a
// rejection is redone without the handler's effect.
func handlerResult(err error) result {
	class := ClassOf(err)
	var re *RejectError
	switch {
	case class == ClassRejected && errors.As(err, &re):
		return result{kind: resRejectRedo, reject: re}
	case class == ClassRejected: // Reject-classed error without a reason
		return result{kind: resRejectRedo, reject: &RejectError{Reason: err.Error()}}
	}
	return result{kind: resFailed, class: class, err: err}
}

// compareConsumed decides between duplicate and conflict for an event id the
// consumer has already recorded.
func (c *Consumer) compareConsumed(ctx context.Context, tx pgx.Tx, it *item) result {
	var (
		hash                []byte
		typ, aggType, aggID *string
		version             *int64
		consumedAt          time.Time
	)
	err := tx.QueryRow(ctx, `
		SELECT content_hash, event_type, aggregate_type, aggregate_id, aggregate_version, consumed_at
		FROM consumed_message WHERE consumer = $1 AND event_id = $2`,
		c.cfg.Name, it.m.ID).Scan(&hash, &typ, &aggType, &aggID, &version, &consumedAt)
	if err != nil {
		return failed(err, "read consumed message")
	}
	// A row without a hash was written by SQL that records only the id (the
	// seed's apply_reward_event): nothing to compare, so a duplicate.
	if hash == nil || bytes.Equal(hash, it.hash) {
		return result{kind: resDuplicate}
	}
	ev := &it.m.Event
	var diffs []string
	diff := func(field string, stored *string, got string) {
		if stored != nil && *stored != got {
			diffs = append(diffs, fmt.Sprintf("%s %q (consumed) vs %q", field, *stored, got))
		}
	}
	diff("type", typ, ev.Type)
	diff("aggregate type", aggType, ev.AggregateType)
	diff("aggregate id", aggID, ev.AggregateID)
	if version != nil && *version != ev.AggregateVersion {
		diffs = append(diffs, fmt.Sprintf("aggregate version %d (consumed) vs %d", *version, ev.AggregateVersion))
	}
	if len(diffs) == 0 {
		diffs = append(diffs, "payload differs")
	}
	return result{kind: resConflict, err: fmt.Errorf("%w: event id %s was consumed at %s with other content: %s",
		ErrConflict, ev.ID, consumedAt.UTC().Format(time.RFC3339), strings.Join(diffs, "; "))}
}

// position is an aggregate's row in consumer_aggregate_position.
type position struct {
	version int64
	eventID string
	hash    []byte
}

// checkVersion compares the event's version with its aggregate's position,
// locking the position row until the transaction ends. It returns resApplied
// when the event is the next version (pos is nil for an aggregate never
// seen).
func (c *Consumer) checkVersion(ctx context.Context, tx pgx.Tx, it *item) (result, *position) {
	ev := &it.m.Event
	var p position
	err := tx.QueryRow(ctx, `
		SELECT version, event_id, content_hash FROM consumer_aggregate_position
		WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3
		FOR UPDATE`, c.cfg.Name, ev.AggregateType, ev.AggregateID).Scan(&p.version, &p.eventID, &p.hash)
	v := ev.AggregateVersion
	if errors.Is(err, pgx.ErrNoRows) {
		start := c.cfg.InitialVersion
		switch {
		case start == 0:
			// The first version seen starts the aggregate, unless an
			// earlier one is dead-lettered: then this one must wait for
			// its replay like any later version.
			if res := c.gap(ctx, tx, it, math.MinInt64); res.kind != resGap || res.blockedBy != 0 {
				return res, nil
			}
			return result{kind: resApplied}, nil
		case v == start:
			return result{kind: resApplied}, nil
		case v < start:
			return result{kind: resConflict, err: fmt.Errorf("%w: version %d of %s is below the configured initial version %d",
				ErrConflict, v, aggregateName(ev.AggregateType, ev.AggregateID), start)}, nil
		default:
			return c.gap(ctx, tx, it, start-1), nil
		}
	}
	if err != nil {
		return failed(err, "read aggregate position"), nil
	}
	agg := aggregateName(ev.AggregateType, ev.AggregateID)
	switch {
	case v == p.version+1:
		return result{kind: resApplied}, &p
	case v == p.version && p.eventID == ev.ID && bytes.Equal(p.hash, it.hash):
		// Its dedup row was pruned, the position still knows it.
		return result{kind: resDuplicate}, &p
	case v == p.version:
		return result{kind: resConflict, err: fmt.Errorf("%w: %s is at version %d by event %s; event %s claims the same version with another identity",
			ErrConflict, agg, p.version, p.eventID, ev.ID)}, &p
	case v < p.version:
		return result{kind: resConflict, err: fmt.Errorf("%w: %s is at version %d; event %s has the older version %d and was never consumed (its dedup row may have been pruned too early, or two events claim one version)",
			ErrConflict, agg, p.version, ev.ID, v)}, &p
	default:
		return c.gap(ctx, tx, it, p.version), &p
	}
}

// gap builds the gap result, naming an open dead letter that holds one of
// the missing versions: then waiting cannot fill the gap, and the event is
// dead-lettered at once to be replayed after it, in order.
func (c *Consumer) gap(ctx context.Context, tx pgx.Tx, it *item, current int64) result {
	ev := &it.m.Event
	res := result{kind: resGap, current: current, received: ev.AggregateVersion}
	var id, version int64
	err := tx.QueryRow(ctx, `
		SELECT id, aggregate_version FROM consumer_dead_letter
		WHERE consumer = $1 AND status = 'open' AND aggregate_type IS NOT DISTINCT FROM NULLIF($2, '') AND aggregate_id = $3
		  AND aggregate_version > $4 AND aggregate_version < $5
		ORDER BY aggregate_version LIMIT 1`,
		c.cfg.Name, ev.AggregateType, ev.AggregateID, current, ev.AggregateVersion).Scan(&id, &version)
	switch {
	case err == nil:
		res.blockedBy = id
		at := fmt.Sprintf("is at version %d", current)
		if current == math.MinInt64 {
			at = "has no applied version yet"
		}
		res.err = fmt.Errorf("%w: version %d of %s is dead-lettered (record %d), replay it first; %s %s, received version %d",
			ErrGap, version, aggregateName(ev.AggregateType, ev.AggregateID), id, aggregateName(ev.AggregateType, ev.AggregateID), at, ev.AggregateVersion)
	case errors.Is(err, pgx.ErrNoRows):
		if current != math.MinInt64 {
			skipped, err := c.discardedBetween(ctx, tx, it, current)
			if err != nil {
				return failed(err, "look for discarded versions")
			}
			if skipped == ev.AggregateVersion-current-1 {
				// Every missing version was discarded by an operator (dlq
				// discard): they will never be applied, so this one is next.
				return result{kind: resApplied}
			}
		}
		res.err = fmt.Errorf("%w: %s is at version %d, received version %d (missing %s)",
			ErrGap, aggregateName(ev.AggregateType, ev.AggregateID), current, ev.AggregateVersion, missing(current, ev.AggregateVersion))
	default:
		return failed(err, "look for dead-lettered versions")
	}
	return res
}

// discardedBetween counts the versions between current and the event's that
// an operator discarded. `dlq discard` moves the position past a discarded
// version when it is the next one; this covers the other orders (an earlier
// version still open at the discard, an aggregate the consumer had not seen).
func (c *Consumer) discardedBetween(ctx context.Context, tx pgx.Tx, it *item, current int64) (int64, error) {
	ev := &it.m.Event
	var n int64
	err := tx.QueryRow(ctx, `
		SELECT count(DISTINCT aggregate_version) FROM consumer_dead_letter
		WHERE consumer = $1 AND status = 'discarded' AND aggregate_type IS NOT DISTINCT FROM NULLIF($2, '')
		  AND aggregate_id = $3 AND aggregate_version > $4 AND aggregate_version < $5`,
		c.cfg.Name, ev.AggregateType, ev.AggregateID, current, ev.AggregateVersion).Scan(&n)
	return n, err
}

func missing(current, received int64) string {
	if received-current == 2 {
		return fmt.Sprintf("version %d", current+1)
	}
	return fmt.Sprintf("versions %d to %d", current+1, received-1)
}

func aggregateName(typ, id string) string {
	if typ == "" {
		return fmt.Sprintf("aggregate %q", id)
	}
	return fmt.Sprintf("aggregate %s %q", typ, id)
}

// movePosition records the applied version. The row was locked by
// checkVersion; for a new aggregate a concurrent insert (another process
// sharing the durable consumer) makes this attempt fail as transient, and
// the retry sees the other version.
func (c *Consumer) movePosition(ctx context.Context, tx pgx.Tx, it *item, prev *position) error {
	ev := &it.m.Event
	var (
		sql  string
		args = []any{c.cfg.Name, ev.AggregateType, ev.AggregateID, ev.AggregateVersion, ev.ID, it.hash}
	)
	if prev == nil {
		sql = `INSERT INTO consumer_aggregate_position (consumer, aggregate_type, aggregate_id, version, event_id, content_hash)
			VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING`
	} else {
		sql = `UPDATE consumer_aggregate_position
			SET version = $4, event_id = $5, content_hash = $6, updated_at = CURRENT_TIMESTAMP
			WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND version = $7`
		args = append(args, prev.version)
	}
	tag, err := tx.Exec(ctx, sql, args...)
	if err != nil {
		return err
	}
	if tag.RowsAffected() != 1 {
		return Transient(fmt.Errorf("%s moved concurrently", aggregateName(ev.AggregateType, ev.AggregateID)))
	}
	return nil
}

// callHandler runs the handler, turning a panic into an unknown error.
func (c *Consumer) callHandler(ctx context.Context, tx pgx.Tx, it *item) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = &PanicError{Value: r, Stack: debug.Stack()}
		}
	}()
	return c.h.Handle(it.spanContext(ctx), tx, &it.m)
}
