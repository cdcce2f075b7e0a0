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

// resultKind is what happened to one message.
type resultKind int

const (
	resApplied    resultKind = iota // effect and dedup row committed
	resRejected                     // business rejection recorded
	resDuplicate                    // already consumed: nothing to do
	resSkipped                      // event type not wanted
	resGap                          // an earlier aggregate version is missing
	resConflict                     // same id or version, other content
	resFailed                       // the attempt failed with class
	resStale                        // replay request withdrawn meanwhile
	resRejectRedo                   // internal: redo as a rejection
	resRequeue                      // internal: not attempted in its batch, back to the queue
)

type result struct {
	kind  resultKind
	class Class // resFailed
	err   error // resFailed, resConflict, resGap: the reason
	// resGap: the aggregate's current version and the received one, and the
	// open dead letter holding a missing version (0 if none).
	current, received int64
	blockedBy         int64
	reject            *RejectError // resRejectRedo
}

func failed(err error, what string) result {
	return result{kind: resFailed, class: ClassOf(err), err: fmt.Errorf("%s: %w", what, err)}
}

// failedBegin classifies a failed Begin. A deadline there was spent
// waiting for a connection (the pool is exhausted, or the server does not
// answer after a failover): nothing of the handler ran, so it is the
// database's unavailability, transient, not the handler's budget.
func failedBegin(err error) result {
	res := failed(err, "begin transaction")
	if res.class == ClassUnknown && errors.Is(err, context.DeadlineExceeded) {
		res.class = ClassTransient
	}
	return res
}

// process runs one message through the dedup, version check, handler and
// commit. It never acknowledges: the worker decides that from the result.
func (c *Consumer) process(ctx context.Context, it *item) result {
	if it.err != nil {
		return result{kind: resFailed, class: ClassPermanent, err: it.err}
	}
	if c.wanted != nil && !c.wanted[it.m.Type] {
		return result{kind: resSkipped}
	}
	// Shutdown must not cut a transaction in half: the message's own
	// timeout bounds it instead.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.HandlerTimeout)
	defer cancel()
	start := time.Now()
	res := c.runTx(ctx, it, nil)
	if res.kind == resRejectRedo {
		res = c.runTx(ctx, it, res.reject)
	}
	c.met.handle.Observe(time.Since(start).Seconds())
	return res
}

const insertConsumed = `
	INSERT INTO consumed_message (consumer, event_id, content_hash, event_type, aggregate_type,
		aggregate_id, aggregate_version, outcome, reason)
	VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
	ON CONFLICT (consumer, event_id) DO NOTHING`

// runTx is one transaction for it. With reject set, the handler is not
// called and the dedup row records the rejection instead of an effect.
func (c *Consumer) runTx(ctx context.Context, it *item, reject *RejectError) (res result) {
	tx, err := c.db.Begin(ctx)
	if err != nil {
		return failedBegin(err)
	}
	committed := false
	defer func() {
		if !committed {
			// A failed rollback means a broken connection, which the pool
			// discards; nothing of the transaction survives it.
			_ = tx.Rollback(ctx)
		}
	}()
	outcome := outcomeApplied
	if reject != nil {
		outcome = outcomeRejected
	}
	written, err := c.insertOne(ctx, tx, it, reject)
	if err != nil {
		return failed(err, "record consumed message")
	}
	if !written {
		res = c.compareConsumed(ctx, tx, it)
		if res.kind == resDuplicate && it.replay != nil {
			return c.commitReplay(ctx, tx, it, outcomeDuplicate, res, &committed)
		}
		return res
	}
	var pos *position
	if c.cfg.VersionCheck {
		var vres result
		vres, pos = c.checkVersion(ctx, tx, it)
		if vres.kind != resApplied {
			if vres.kind == resDuplicate && it.replay != nil {
				return c.commitReplay(ctx, tx, it, outcomeDuplicate, vres, &committed)
			}
			return vres
		}
	}
	if reject == nil {
		if err := c.callHandler(ctx, tx, it); err != nil {
			return handlerResult(err)
		}
	}
	if c.cfg.VersionCheck {
		if err := c.movePosition(ctx, tx, it, pos); err != nil {
			return failed(err, "move aggregate position")
		}
	}
	res = result{kind: resApplied}
	if reject != nil {
		res = result{kind: resRejected}
	}
	if it.replay != nil {
		return c.commitReplay(ctx, tx, it, outcome, res, &committed)
	}
	if err := tx.Commit(ctx); err != nil {
		committed = true // nothing is left to roll back
		if c.wasCommitted(ctx, it) {
			c.committed(it)
			return res
		}
		// Not known to have committed: a retry finds the dedup row if it did.
		return failed(err, "commit")
	}
	committed = true
	c.committed(it)
	return res
}

// wasCommitted reports whether a commit that returned an error went through
// after all (a deadline or a broken connection after the server committed):
// the dedup row is there with this message's hash. Looking, in a new
// transaction, keeps an applied event from being retried and dead-lettered
// on its last attempt. When the database cannot be asked, it reports false
// and the retry finds out instead.
func (c *Consumer) wasCommitted(ctx context.Context, it *item) bool {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.HandlerTimeout)
	defer cancel()
	var hash []byte
	err := c.db.QueryRow(ctx, `SELECT content_hash FROM consumed_message WHERE consumer = $1 AND event_id = $2`,
		c.cfg.Name, it.m.ID).Scan(&hash)
	return err == nil && bytes.Equal(hash, it.hash)
}

// committed runs what follows a successful commit and precedes the ack.
func (c *Consumer) committed(it *item) {
	if !it.m.CommitTime.IsZero() && it.replay == nil {
		c.met.latency.Observe(time.Since(it.m.CommitTime).Seconds())
	}
	if c.afterCommit != nil {
		c.afterCommit(&it.m)
	}
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
