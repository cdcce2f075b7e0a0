package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/contract"
)

// maxReasonBytes bounds the stored reason; a panic's stack is cut there.
const maxReasonBytes = 16 << 10

// reasonText renders a failure for the reason column, with the stack of a
// recovered panic, which is what the owner needs to fix it.
func reasonText(err error) string {
	s := unclassed(err).Error()
	var pe *PanicError
	if errors.As(err, &pe) {
		s += "\n" + string(pe.Stack)
	}
	if len(s) > maxReasonBytes {
		s = strings.ToValidUTF8(s[:maxReasonBytes], "") + "…"
	}
	return s
}

// unclassed drops the outermost ClassError, whose class prefix would repeat
// the failure_class column in a reason.
func unclassed(err error) error {
	if ce, ok := err.(*ClassError); ok && ce.Err != nil {
		return ce.Err
	}
	return err
}

// insertDeadLetter writes the record of a message that failed for good. A
// redelivery of a message whose record is still open (the process died
// before terminating it) updates that record; a record is that message's
// only if the event id and payload match too, since a recreated stream
// reuses sequence numbers for other messages.
func (c *Consumer) insertDeadLetter(ctx context.Context, it *item, class Class, reason error, f *failState) (int64, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.HandlerTimeout)
	defer cancel()
	headers, err := json.Marshal(it.m.Header)
	if err != nil {
		return 0, fmt.Errorf("encode headers: %w", err)
	}
	ev := &it.m.Event
	var id int64
	err = c.db.QueryRow(ctx, `
		INSERT INTO consumer_dead_letter (consumer, owner, event_id, event_type, aggregate_type, aggregate_id,
			aggregate_version, subject, stream, stream_seq, deliveries, headers, payload, failure_class, reason,
			attempts, first_failed_at, last_failed_at)
		VALUES ($1, $2, $3, NULLIF($4, ''), NULLIF($5, ''), $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18)
		ON CONFLICT (consumer, stream, stream_seq, event_id, sha256(payload)) WHERE status IN ('open', 'replaying') DO UPDATE
		SET deliveries = EXCLUDED.deliveries, failure_class = EXCLUDED.failure_class, reason = EXCLUDED.reason,
			attempts = consumer_dead_letter.attempts + EXCLUDED.attempts, last_failed_at = EXCLUDED.last_failed_at
		RETURNING id`,
		c.cfg.Name, c.cfg.Owner, ev.ID, ev.Type, ev.AggregateType, aggregateIDOrNil(it), versionOrNil(it),
		it.m.Subject, it.m.Stream, int64(it.m.StreamSeq), int64(it.m.Deliveries), headers, payloadBytes(ev.Payload),
		string(class), reasonText(reason), max(f.attempts, 1), f.first, f.last).Scan(&id)
	if err != nil {
		return 0, err
	}
	return id, nil
}

// aggregateIDOrNil keeps an empty aggregate id (legal in the contract) apart
// from a missing one.
func aggregateIDOrNil(it *item) *string {
	ids := it.m.Header.Values(contract.AggregateID)
	if len(ids) == 0 {
		return nil
	}
	return &ids[0]
}

// versionOrNil is the aggregate version when the header holds a valid one.
func versionOrNil(it *item) *int64 {
	v, err := strconv.ParseInt(it.m.Header.Get(contract.AggregateVersion), 10, 64)
	if err != nil {
		return nil
	}
	return &v
}

func payloadBytes(p []byte) []byte {
	if p == nil {
		return []byte{}
	}
	return p
}

// commitReplay closes the replayed record in the replay's transaction and
// commits, so the effect and the record's new status cannot disagree.
func (c *Consumer) commitReplay(ctx context.Context, tx pgx.Tx, it *item, outcome string, res result, committed *bool) result {
	tag, err := tx.Exec(ctx, `
		UPDATE consumer_dead_letter
		SET status = 'replayed', replay_outcome = $3, resolved_at = CURRENT_TIMESTAMP,
			resolved_by = replay_requested_by, replay_count = replay_count + 1
		WHERE consumer = $1 AND id = $2 AND status = 'replaying'`, c.cfg.Name, it.m.DeadLetterID, outcome)
	if err != nil {
		return failed(err, "close replayed dead letter")
	}
	if tag.RowsAffected() == 0 {
		// The request was withdrawn, or an earlier event of the aggregate
		// failed its replay and reopened this record: applying it now would
		// break the aggregate's order.
		return result{kind: resStale}
	}
	if err := tx.Commit(ctx); err != nil {
		return failed(err, "commit")
	}
	*committed = true
	c.committed(it)
	return res
}

// reopenDeadLetter puts a record whose replay failed back to open with the
// new failure, and reopens the aggregate's later records of the same replay
// so that they are not applied out of order.
func (c *Consumer) reopenDeadLetter(ctx context.Context, it *item, class Class, reason error) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.HandlerTimeout)
	defer cancel()
	tx, err := c.db.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	tag, err := tx.Exec(ctx, `
		UPDATE consumer_dead_letter
		SET status = 'open', failure_class = $3, reason = $4, attempts = attempts + 1,
			last_failed_at = CURRENT_TIMESTAMP, replay_count = replay_count + 1
		WHERE consumer = $1 AND id = $2 AND status = 'replaying'`,
		c.cfg.Name, it.m.DeadLetterID, string(class), "replay failed: "+reasonText(reason))
	if err != nil {
		return err
	}
	if tag.RowsAffected() == 1 && it.err == nil {
		if _, err := tx.Exec(ctx, `
			UPDATE consumer_dead_letter SET status = 'open'
			WHERE consumer = $1 AND status = 'replaying' AND aggregate_type IS NOT DISTINCT FROM NULLIF($2, '')
			  AND aggregate_id = $3 AND id <> $4`,
			c.cfg.Name, it.m.AggregateType, it.m.AggregateID, it.m.DeadLetterID); err != nil {
			return err
		}
	}
	return tx.Commit(ctx)
}

// replayRequest ties a replayed item to the poll that dispatched it.
type replayRequest struct {
	done func()
}

// replayLoop applies the dead letters an operator asked to replay. The
// records are read in aggregate order and dispatched to the aggregate's
// worker like live messages, so they are applied in order with respect to
// each other; a batch is finished before the next one is read.
func (c *Consumer) replayLoop(ctx context.Context) error {
	t := time.NewTicker(c.cfg.ReplayPollInterval)
	defer t.Stop()
	var failing loopHealth
	for {
		n, err := c.replayBatch(ctx)
		if ctx.Err() == nil {
			// The next poll retries; the records stay 'replaying'.
			failing.report(c.log, "read replay requests", err)
		}
		if err == nil && n == c.cfg.ReplayBatch {
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

func (c *Consumer) replayBatch(ctx context.Context) (int, error) {
	rows, err := c.db.Query(ctx, `
		SELECT id, subject, stream, stream_seq, deliveries, headers, payload
		FROM consumer_dead_letter
		WHERE consumer = $1 AND status = 'replaying'
		ORDER BY aggregate_type NULLS FIRST, aggregate_id NULLS FIRST, aggregate_version NULLS FIRST, stream_seq, id
		LIMIT $2`, c.cfg.Name, c.cfg.ReplayBatch)
	if err != nil {
		return 0, err
	}
	var items []*item
	done := make(chan struct{}, c.cfg.ReplayBatch)
	req := &replayRequest{done: func() { done <- struct{}{} }}
	for rows.Next() {
		var (
			it       = &item{replay: req, received: time.Now()}
			seq, del int64
			headers  map[string][]string
			payload  []byte
		)
		if err := rows.Scan(&it.m.DeadLetterID, &it.m.Subject, &it.m.Stream, &seq, &del, &headers, &payload); err != nil {
			rows.Close()
			return 0, err
		}
		it.m.StreamSeq, it.m.Deliveries, it.m.Header = uint64(seq), uint64(del), headers
		c.parse(it, payload)
		items = append(items, it)
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	for i, it := range items {
		select {
		case c.workers[c.workerIndex(it.key)].in <- it:
		case <-ctx.Done():
			return i, nil
		}
	}
	for range items {
		select {
		case <-done:
		case <-ctx.Done():
			return len(items), nil
		}
	}
	return len(items), nil
}
