package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

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
	return s
}

// truncateReason cuts s to maxReasonBytes on a character boundary.
func truncateReason(s string) string {
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

// storedClasses are the classes consumer_dead_letter's CHECK accepts.
var storedClasses = map[Class]bool{
	ClassTransient: true, ClassPermanent: true, ClassUnknown: true, ClassConflict: true, ClassGap: true,
}

// storableClass maps a class the table cannot hold (a handler's own
// ClassError.Class) to ClassUnknown, keeping the original in the reason.
func storableClass(class Class, reason error) (Class, error) {
	if storedClasses[class] {
		return class, reason
	}
	return ClassUnknown, fmt.Errorf("class %q is not a dead-letter class, recorded as unknown: %w", cleanText(string(class)), reason)
}

// cleanText makes s storable in a text column: PostgreSQL refuses invalid
// UTF-8 and NUL characters (SQLSTATE 22021), which headers, handler errors
// and panic values may carry.
func cleanText(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	return strings.ReplaceAll(s, "\x00", `\x00`)
}

// cleanHeaders is h made storable in jsonb, which refuses \u0000 as well.
func cleanHeaders(h map[string][]string, clean func(string) string) map[string][]string {
	out := make(map[string][]string, len(h))
	for k, vs := range h {
		cv := make([]string, len(vs))
		for i, v := range vs {
			cv[i] = clean(v)
		}
		out[clean(k)] = cv
	}
	return out
}

// escapeText renders s in printable ASCII: the last resort for a record the
// database refused.
func escapeText(s string) string {
	q := strconv.QuoteToASCII(s)
	return q[1 : len(q)-1]
}

// deadLetterRecord is one consumer_dead_letter row to write.
type deadLetterRecord struct {
	eventID, eventType, aggType, subject, stream, reason string
	aggID                                                *string
	version                                              *int64
	headers                                              map[string][]string
	class                                                Class
}

func (c *Consumer) newDeadLetterRecord(it *item, class Class, reason error, clean func(string) string) deadLetterRecord {
	r := deadLetterRecord{
		eventID: clean(it.m.ID), eventType: clean(it.m.Type), aggType: clean(it.m.AggregateType),
		subject: clean(it.m.Subject), stream: clean(it.m.Stream), version: versionOrNil(it),
		headers: cleanHeaders(it.m.Header, clean), class: class, reason: truncateReason(clean(reasonText(reason))),
	}
	if id := aggregateIDOrNil(it); id != nil {
		s := clean(*id)
		r.aggID = &s
	}
	return r
}

// insertDeadLetter writes the record of a message that failed for good. A
// redelivery of a message whose record is still open (the process died
// before terminating it) updates that record; a record is that message's
// only if the event id and payload match too, since a recreated stream
// reuses sequence numbers for other messages.
func (c *Consumer) insertDeadLetter(ctx context.Context, it *item, class Class, reason error, f *failState) (int64, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.HandlerTimeout)
	defer cancel()
	id, err := c.writeDeadLetter(ctx, it, c.newDeadLetterRecord(it, class, reason, cleanText), f)
	var pgErr *pgconn.PgError
	if err == nil || !errors.As(err, &pgErr) || IsTransientDB(err) {
		return id, err
	}
	// The database refused the record itself (a value it cannot store, a
	// constraint): retrying cannot help, and the aggregate would stall
	// behind the message for good. Store every text field escaped to
	// printable ASCII instead, with what the refusal was.
	min := c.newDeadLetterRecord(it, class, reason, escapeText)
	min.reason = truncateReason(fmt.Sprintf("dead letter stored escaped: the database refused it as is (SQLSTATE %s: %s); %s",
		pgErr.Code, escapeText(pgErr.Message), min.reason))
	id, err2 := c.writeDeadLetter(ctx, it, min, f)
	if err2 != nil {
		return 0, fmt.Errorf("%w; escaped record refused too: %w", err, err2)
	}
	return id, nil
}

func (c *Consumer) writeDeadLetter(ctx context.Context, it *item, r deadLetterRecord, f *failState) (int64, error) {
	headers, err := json.Marshal(r.headers)
	if err != nil {
		return 0, fmt.Errorf("encode headers: %w", err)
	}
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
		c.cfg.Name, cleanText(c.cfg.Owner), r.eventID, r.eventType, r.aggType, r.aggID, r.version,
		r.subject, r.stream, int64(it.m.StreamSeq), int64(it.m.Deliveries), headers, payloadBytes(it.m.Payload),
		string(r.class), r.reason, max(f.attempts, 1), f.first, f.last).Scan(&id)
	if err != nil {
		return 0, err
	}
	return id, nil
}

// aggregateIDOrNil keeps an empty aggregate id (legal in the contract) apart
// from a missing one.
func aggregateIDOrNil(it *item) *string {
	if it.err == nil && it.m.AggregateID != "" {
		// Parsed, from the Outbox-* headers or a CloudEvents-only message.
		id := it.m.AggregateID
		return &id
	}
	ids := it.m.Header.Values(contract.AggregateID)
	if len(ids) == 0 {
		return nil
	}
	return &ids[0]
}

// versionOrNil is the aggregate version when the header holds a valid one.
func versionOrNil(it *item) *int64 {
	if it.err == nil && it.m.AggregateVersion != 0 {
		v := it.m.AggregateVersion
		return &v
	}
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
	err = tx.Commit(ctx)
	*committed = true // after a failed commit nothing is left to roll back
	return c.commitResult(ctx, it, res, err)
}

// reopenDeadLetter puts a record whose replay failed back to open with the
// new failure, and reopens the aggregate's later records of the same replay
// so that they are not applied out of order.
func (c *Consumer) reopenDeadLetter(ctx context.Context, it *item, class Class, reason error) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.HandlerTimeout)
	defer cancel()
	class, reason = storableClass(class, reason) // a record the table refuses would stay 'replaying'

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
		c.cfg.Name, it.m.DeadLetterID, string(class), truncateReason(cleanText("replay failed: "+reasonText(reason))))
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

// replayRequest ties a replayed item to the poll that dispatched it. The
// workers of the aggregates in the batch share it.
type replayRequest struct {
	done   func()
	mu     sync.Mutex
	failed map[string]bool // aggregate keys whose replay failed in this batch
}

// fail notes that a record of the aggregate key failed its replay, so that
// its later records in the batch wait for the next poll. Reopening them
// with the failed one is not enough: that write can fail too, and they
// would be applied ahead of the earlier record.
func (r *replayRequest) fail(key string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.failed == nil {
		r.failed = map[string]bool{}
	}
	r.failed[key] = true
}

func (r *replayRequest) failedBefore(key string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.failed[key]
}

// replayLoop applies the dead letters an operator asked to replay. The
// records are read in aggregate order and dispatched to the aggregate's
// worker like live messages, so they are applied in order with respect to
// each other; a batch is finished before the next one is read.
func (c *Consumer) replayLoop(ctx context.Context, e *engine) error {
	t := time.NewTicker(c.cfg.ReplayPollInterval)
	defer t.Stop()
	var failing loopHealth
	for {
		n, err := c.replayBatch(ctx, e)
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

func (c *Consumer) replayBatch(ctx context.Context, e *engine) (int, error) {
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
		if e.send(ctx, it) != nil {
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
