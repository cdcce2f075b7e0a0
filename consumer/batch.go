package consumer

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
)

// BatchHandler is a [Handler] that can also apply many events with
// set-based SQL. When the handler passed to [New] implements it and
// Config.BatchSize is above 1, each batch of messages that pass the dedup and
// version checks is given to HandleBatch once, in stream order (so one
// aggregate's events are in version order), inside the batch's transaction,
// instead of Handle per message. The same rules as for Handle apply: write
// only through tx, do not commit or roll back.
//
// An error from HandleBatch says nothing about which message failed: the
// batch's transaction is rolled back and its messages are applied again one
// at a time with Handle, so a failing message is classified, retried or
// dead-lettered on its own exactly as in per-message mode. A failed
// HandleBatch counts as no attempt of any message.
type BatchHandler interface {
	Handler
	HandleBatch(ctx context.Context, tx pgx.Tx, ms []*Message) error
}

// batchOutcome is what processing a batch returns to its worker: a result per
// item, in order. Items left resRequeue were not attempted and go back to the
// front of the queue; with solo they are then taken one at a time, through
// the per-message path.
type batchOutcome struct {
	res  []result
	solo bool
}

// maxBatchRedo bounds how often one batch is rolled back and tried again
// without its failed messages before its remaining messages are taken one at
// a time: each redo repeats the work of the messages before the failure.
const maxBatchRedo = 3

// processItems processes what the worker took: one message through the
// per-message path, several in one batch transaction.
func (c *Consumer) processItems(ctx context.Context, its []*item) batchOutcome {
	c.startSpans(ctx, its)
	if len(its) == 1 {
		return batchOutcome{res: []result{c.process(ctx, its[0])}}
	}
	return c.processBatch(ctx, its)
}

// processBatch applies its (stream deliveries, no replays) in one
// transaction where it can. A message whose attempt fails (the handler, its
// version check or position move) or is rejected makes the transaction roll
// back: the failure is its result, exactly one attempt, and the batch is
// tried again without it and without the later messages of its aggregate,
// which go back to the worker's queue so that the worker holds them behind
// it as in per-message mode; a rejected message is redone in the retried
// batch as a rejection. A failure that belongs to no single message (begin,
// the dedup statement, HandleBatch, the batch's deadline) sends the batch's
// untried messages back to be processed one at a time. So no message is
// applied twice, none fails for a neighbour, and each ends as it would alone.
func (c *Consumer) processBatch(ctx context.Context, its []*item) batchOutcome {
	out := batchOutcome{res: make([]result, len(its))}
	var todo []int
	for i, it := range its {
		switch {
		case it.err != nil:
			out.res[i] = result{kind: resFailed, class: ClassPermanent, err: it.err}
		case c.wanted != nil && !c.wanted[it.m.Type]:
			out.res[i] = result{kind: resSkipped}
		default:
			todo = append(todo, i)
		}
	}
	c.met.batchSize.Observe(float64(len(todo)))
	rejects := map[int]*RejectError{}
	for redo := 0; len(todo) > 0; redo++ {
		if redo > maxBatchRedo {
			return oneByOne(out, todo)
		}
		start := time.Now()
		res, failedAt, ok := c.batchTx(ctx, its, todo, rejects)
		c.met.batchTx.Observe(time.Since(start).Seconds())
		if !ok {
			return oneByOne(out, todo)
		}
		if failedAt < 0 {
			for k, i := range todo {
				out.res[i] = res[k]
			}
			return out
		}
		f, r := todo[failedAt], res[failedAt]
		if r.kind == resRejectRedo {
			rejects[f] = r.reject
			continue
		}
		out.res[f] = r
		rest := todo[:0:0]
		for _, i := range todo {
			switch {
			case i == f:
			case i > f && its[i].key == its[f].key:
				out.res[i] = result{kind: resRequeue}
			default:
				rest = append(rest, i)
			}
		}
		todo = rest
	}
	return out
}

// oneByOne sends the untried messages todo back to be taken one at a time.
func oneByOne(out batchOutcome, todo []int) batchOutcome {
	for _, i := range todo {
		out.res[i] = result{kind: resRequeue}
	}
	out.solo = true
	return out
}

// insertConsumedBatch is the batch's one dedup statement. ON CONFLICT DO
// NOTHING skips an event id already recorded, and also the second of two
// messages with one id in the same batch: RETURNING names the rows it wrote.
const insertConsumedBatch = `
	INSERT INTO consumed_message (consumer, event_id, content_hash, event_type, aggregate_type,
		aggregate_id, aggregate_version, outcome, reason)
	SELECT $1, u.* FROM unnest($2::text[], $3::bytea[], $4::text[], $5::text[], $6::text[], $7::bigint[], $8::text[], $9::text[]) AS u
	ON CONFLICT (consumer, event_id) DO NOTHING
	RETURNING event_id`

// batchTx runs one transaction over the items its[todo[k]]. It returns a
// result per todo entry and commits when every message either applied or
// needs no write (duplicate, conflict, gap). Otherwise it rolls back and
// returns the index k of the first message whose attempt failed (or that is
// to be redone as a rejection: resRejectRedo). ok is false when the
// transaction failed for no single message.
func (c *Consumer) batchTx(ctx context.Context, its []*item, todo []int, rejects map[int]*RejectError) (res []result, failedAt int, ok bool) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.HandlerTimeout)
	defer cancel()
	tx, err := c.db.Begin(ctx)
	if err != nil {
		return nil, -1, false
	}
	committed := false
	defer func() {
		if !committed {
			_ = tx.Rollback(ctx)
		}
	}()
	fresh, err := c.insertBatch(ctx, tx, its, todo, rejects)
	if err != nil {
		return nil, -1, false
	}
	res = make([]result, len(todo))
	var (
		apply     []*Message // for a BatchHandler
		withdrawn map[string]bool
	)
	bh, _ := c.h.(BatchHandler)
	for k, i := range todo {
		it := its[i]
		if !fresh[k] && withdrawn[it.m.ID] {
			// An earlier message of this batch with the same id wrote the
			// row and withdrew it: this one comes next, as it would alone.
			var err error
			if fresh[k], err = c.insertOne(ctx, tx, it, rejects[i]); err != nil {
				res[k] = failed(err, "record consumed message")
				return res, k, true
			}
		}
		if !fresh[k] {
			// Recorded before, or by an earlier message of this batch with
			// the same id: the stored hash decides, as for a single message.
			if res[k] = c.compareConsumed(ctx, tx, it); res[k].kind == resFailed {
				return res, k, true
			}
			continue
		}
		var pos *position
		if c.cfg.VersionCheck {
			var vres result
			if vres, pos = c.checkVersion(ctx, tx, it); vres.kind != resApplied {
				if vres.kind == resFailed {
					res[k] = vres
					return res, k, true
				}
				// Duplicate, conflict or gap: nothing of it may commit.
				if _, err := tx.Exec(ctx, `DELETE FROM consumed_message WHERE consumer = $1 AND event_id = $2`, c.cfg.Name, it.m.ID); err != nil {
					res[k] = failed(err, "withdraw consumed message")
					return res, k, true
				}
				if withdrawn == nil {
					withdrawn = map[string]bool{}
				}
				withdrawn[it.m.ID] = true
				res[k] = vres
				continue
			}
		}
		res[k] = result{kind: resApplied}
		if rejects[i] != nil {
			res[k] = result{kind: resRejected}
		} else if bh != nil {
			apply = append(apply, &it.m)
		} else if err := c.callHandler(ctx, tx, it); err != nil {
			res[k] = handlerResult(err)
			return res, k, ctx.Err() == nil
		}
		if c.cfg.VersionCheck {
			if err := c.movePosition(ctx, tx, it, pos); err != nil {
				res[k] = failed(err, "move aggregate position")
				return res, k, ctx.Err() == nil
			}
		}
	}
	if len(apply) > 0 {
		if err := c.callBatchHandler(ctx, tx, bh, apply); err != nil {
			c.log.Debug("batch handler failed; applying the batch one message at a time", zap.Error(err))
			return nil, -1, false
		}
	}
	if err := tx.Commit(ctx); err != nil {
		committed = true
		if !c.batchCommitted(ctx, its, todo, res) {
			for k := range res {
				if res[k].kind == resApplied || res[k].kind == resRejected {
					res[k] = failed(err, "commit")
				}
			}
			return res, -1, true
		}
	}
	committed = true
	for k, i := range todo {
		if res[k].kind == resApplied || res[k].kind == resRejected {
			c.committed(its[i])
		}
	}
	return res, -1, true
}

// insertBatch runs the batch's dedup statement and reports, per todo entry,
// whether its row was written now (the first message of an id new to the
// consumer).
func (c *Consumer) insertBatch(ctx context.Context, tx pgx.Tx, its []*item, todo []int, rejects map[int]*RejectError) ([]bool, error) {
	n := len(todo)
	var (
		ids, types, aggTypes, aggIDs, outcomes = make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		hashes                                 = make([][]byte, n)
		versions                               = make([]int64, n)
		reasons                                = make([]*string, n)
	)
	for k, i := range todo {
		ev := &its[i].m.Event
		ids[k], hashes[k], types[k], aggTypes[k], aggIDs[k], versions[k] = ev.ID, its[i].hash, ev.Type, ev.AggregateType, ev.AggregateID, ev.AggregateVersion
		outcomes[k] = outcomeApplied
		if r := rejects[i]; r != nil {
			outcomes[k], reasons[k] = outcomeRejected, &r.Reason
		}
	}
	rows, err := tx.Query(ctx, insertConsumedBatch, c.cfg.Name, ids, hashes, types, aggTypes, aggIDs, versions, outcomes, reasons)
	if err != nil {
		return nil, err
	}
	written := map[string]bool{}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return nil, err
		}
		written[id] = true
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	fresh := make([]bool, n)
	for k, id := range ids {
		if written[id] {
			fresh[k] = true
			delete(written, id) // a later message with this id is not the one written
		}
	}
	return fresh, nil
}

// insertOne writes the dedup row of one message, recording the rejection
// when reject is set, and reports whether it was written (false: the event
// id is recorded already).
func (c *Consumer) insertOne(ctx context.Context, tx pgx.Tx, it *item, reject *RejectError) (bool, error) {
	ev := &it.m.Event
	outcome, reason := outcomeApplied, (*string)(nil)
	if reject != nil {
		outcome, reason = outcomeRejected, &reject.Reason
	}
	tag, err := tx.Exec(ctx, insertConsumed, c.cfg.Name, ev.ID, it.hash, ev.Type, ev.AggregateType,
		ev.AggregateID, ev.AggregateVersion, outcome, reason)
	return tag.RowsAffected() == 1, err
}

// batchCommitted reports whether a batch whose commit returned an error went
// through after all: the dedup row of one of its applied messages is there
// with that message's hash (the transaction commits entirely or not at all).
func (c *Consumer) batchCommitted(ctx context.Context, its []*item, todo []int, res []result) bool {
	for k, i := range todo {
		if res[k].kind == resApplied || res[k].kind == resRejected {
			return c.wasCommitted(ctx, its[i])
		}
	}
	return false
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

// callBatchHandler runs HandleBatch, turning a panic into an error.
func (c *Consumer) callBatchHandler(ctx context.Context, tx pgx.Tx, bh BatchHandler, ms []*Message) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = &PanicError{Value: r}
		}
	}()
	return bh.HandleBatch(ctx, tx, ms)
}
