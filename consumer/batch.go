package consumer

import (
	"context"
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
// the per-message path. overran: a batch transaction ran into its
// HandlerTimeout (the worker takes smaller batches next, see
// worker.adapt); took: how long the processing took.
type batchOutcome struct {
	res     []result
	solo    bool
	overran bool
	took    time.Duration
}

// maxBatchRedo bounds how often one batch is rolled back and tried again
// without its failed messages before its remaining messages are taken one at
// a time: each redo repeats the work of the messages before the failure.
const maxBatchRedo = 3

// processItems processes what the worker took: one message through the
// per-message path, several in one batch transaction.
func (c *Consumer) processItems(ctx context.Context, its []*item) batchOutcome {
	start := time.Now()
	c.startSpans(ctx, its)
	var out batchOutcome
	if len(its) == 1 {
		out = batchOutcome{res: []result{c.process(ctx, its[0])}}
	} else {
		out = c.processBatch(ctx, its)
	}
	out.took = time.Since(start)
	return out
}

// processBatch applies its (stream deliveries, no replays) in one
// transaction where it can, running each message's step in order (see
// step). A message whose attempt fails or is rejected makes the transaction
// roll back: the failure is its result, exactly one attempt, and the batch
// is tried again without it and without the later messages of its
// aggregate, which go back to the worker's queue so that the worker holds
// them behind it as in per-message mode; a rejected message is redone in
// the retried batch as a rejection. A failure that belongs to no single
// message (begin, the dedup statement, HandleBatch, the batch's deadline, a
// commit not known to have gone through) sends the batch's messages back to
// be processed one at a time. So no message is applied twice, none fails
// for a neighbour, and each ends as it would alone.
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
	var failed []int // the messages whose attempt failed in an earlier try
	for redo := 0; len(todo) > 0; redo++ {
		if redo > maxBatchRedo {
			return oneByOne(out, its, todo)
		}
		start := time.Now()
		try := c.batchTx(ctx, its, todo)
		c.met.batchTx.Observe(time.Since(start).Seconds())
		switch try.end {
		case batchBroken:
			out.overran = try.overran
			return oneByOne(out, its, todo)
		case batchCommitted:
			for k, i := range todo {
				out.res[i] = try.res[k]
			}
			return out
		}
		f := todo[try.at]
		if try.failed.kind == resRejectRedo {
			// Kept on the item, not in this loop: taken one at a time
			// after all (oneByOne), it is recorded as rejected there too,
			// without a second call of the handler, unless an earlier
			// message of its aggregate is still to be applied.
			its[f].rejected = try.failed.reject
			continue
		}
		out.res[f] = try.failed
		for _, j := range failed {
			if j > f && its[j].key == its[f].key {
				// Its failure was judged after f's effect, which did not
				// commit: it counts as not attempted, and goes back to be
				// held behind f. Left failed, it was naked for a retry of
				// its own, and its redelivery could be applied before f's.
				out.res[j] = result{kind: resRequeue}
			}
		}
		failed = append(failed, f)
		rest := todo[:0:0]
		for _, i := range todo {
			switch {
			case i == f:
			case i > f && its[i].key == its[f].key:
				// Judged after f's effect, which does not commit here.
				its[i].rejected = nil
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
// A rejection learnt in the batch is kept only by a message without an
// earlier one of its aggregate among them: it was judged with those
// applied in the same transaction, and alone each of them may yet fail.
func oneByOne(out batchOutcome, its []*item, todo []int) batchOutcome {
	before := make(map[string]bool, len(todo))
	for _, i := range todo {
		if before[its[i].key] {
			its[i].rejected = nil
		}
		before[its[i].key] = true
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

// insertAppliedBatch is insertConsumedBatch for a batch without a
// rejection, nearly every one: the outcome and reason are constants rather
// than two more arrays to encode per batch.
const insertAppliedBatch = `
	INSERT INTO consumed_message (consumer, event_id, content_hash, event_type, aggregate_type,
		aggregate_id, aggregate_version, outcome, reason)
	SELECT $1, u.*, '` + outcomeApplied + `', NULL FROM unnest($2::text[], $3::bytea[], $4::text[], $5::text[], $6::text[], $7::bigint[]) AS u
	ON CONFLICT (consumer, event_id) DO NOTHING
	RETURNING event_id`

// batchEnd is how a batch's transaction ended.
type batchEnd int

const (
	// batchCommitted: committed; batchTry.res holds every message's result.
	batchCommitted batchEnd = iota
	// batchOneFailed: rolled back because of the message todo[batchTry.at],
	// whose attempt is batchTry.failed (resRejectRedo: redo it as a
	// rejection); the other messages were not attempted.
	batchOneFailed
	// batchBroken: rolled back, or not known to have committed, for no
	// single message: no message was attempted, and no result from inside
	// the transaction stands (a duplicate may be one of the dedup row its
	// own earlier delivery wrote in it). overran: it broke after its
	// deadline passed.
	batchBroken
)

// batchTry is what one batch transaction came to.
type batchTry struct {
	end     batchEnd
	res     []result // batchCommitted: per todo entry
	at      int      // batchOneFailed
	failed  result   // batchOneFailed
	overran bool     // batchBroken
}

// batchTx runs one transaction over the items its[todo[k]]: the batch's
// dedup statement, then each message's step, then HandleBatch and the
// commit.
func (c *Consumer) batchTx(ctx context.Context, its []*item, todo []int) batchTry {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.HandlerTimeout)
	defer cancel()
	broken := func() batchTry { return batchTry{end: batchBroken, overran: ctx.Err() != nil} }
	tx, fresh, err := c.beginBatch(ctx, its, todo)
	if tx == nil {
		return broken()
	}
	committed := false
	defer func() {
		if !committed {
			c.rollback(ctx, tx)
		}
	}()
	if err != nil {
		return broken()
	}
	res := make([]result, len(todo))
	var apply []*Message // for a BatchHandler
	bh, _ := c.h.(BatchHandler)
	for k, i := range todo {
		s := c.step(ctx, tx, stepIn{it: its[i], reject: its[i].rejected, recorded: fresh[k], deferred: bh != nil, shared: true})
		switch s.outcome {
		case stepBroken:
			return broken()
		case stepFailed:
			return batchTry{end: batchOneFailed, at: k, failed: s.res}
		case stepWrote:
			if bh != nil && its[i].rejected == nil {
				apply = append(apply, &its[i].m)
			}
		}
		res[k] = s.res
	}
	if len(apply) > 0 {
		if err := c.callBatchHandler(ctx, tx, bh, apply); err != nil {
			c.log.Debug("batch handler failed; applying the batch one message at a time", zap.Error(err))
			return broken()
		}
	}
	err = tx.Commit(ctx)
	committed = true // after a failed commit nothing is left to roll back
	if err != nil && c.batchCommitted(ctx, its, todo, res) != commitDone {
		return broken()
	}
	for k, i := range todo {
		if res[k].kind == resApplied || res[k].kind == resRejected {
			c.committed(its[i])
		}
	}
	return batchTry{end: batchCommitted, res: res}
}

// insertBatch runs the batch's dedup statement in tx and reports, per
// todo entry, whether its row was written now (the first message of an id
// new to the consumer).
func (c *Consumer) insertBatch(ctx context.Context, tx pgx.Tx, its []*item, todo []int) ([]bool, error) {
	query, args := batchInsert(c.cfg.Name, its, todo)
	rows, err := tx.Query(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return readFresh(rows, its, todo)
}

// batchInsert is the dedup statement of the batch its[todo[k]] for the
// consumer name, and its arguments.
func batchInsert(name string, its []*item, todo []int) (string, []any) {
	n := len(todo)
	var (
		ids, types, aggTypes, aggIDs = make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		hashes                       = make([][]byte, n)
		versions                     = make([]int64, n)
		rejected                     bool
	)
	for k, i := range todo {
		ev := &its[i].m.Event
		ids[k], hashes[k], types[k], aggTypes[k], aggIDs[k], versions[k] = ev.ID, its[i].hash, ev.Type, ev.AggregateType, ev.AggregateID, ev.AggregateVersion
		rejected = rejected || its[i].rejected != nil
	}
	if !rejected {
		return insertAppliedBatch, []any{name, ids, hashes, types, aggTypes, aggIDs, versions}
	}
	outcomes, reasons := make([]string, n), make([]*string, n)
	for k, i := range todo {
		outcomes[k] = outcomeApplied
		if r := its[i].rejected; r != nil {
			outcomes[k], reasons[k] = outcomeRejected, &r.Reason
		}
	}
	return insertConsumedBatch, []any{name, ids, hashes, types, aggTypes, aggIDs, versions, outcomes, reasons}
}

// readFresh reads the event ids the batch's dedup statement returned (the
// rows it wrote) and closes rows: per todo entry, whether its row was
// written now. Of two messages with one id only the first counts as
// written.
func readFresh(rows pgx.Rows, its []*item, todo []int) ([]bool, error) {
	defer rows.Close()
	written := map[string]bool{}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		written[id] = true
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	fresh := make([]bool, len(todo))
	for k, i := range todo {
		if id := its[i].m.ID; written[id] {
			fresh[k] = true
			delete(written, id) // a later message with this id is not the one written
		}
	}
	return fresh, nil
}

// batchCommitted tells whether a batch whose commit returned an error went
// through after all, by the dedup rows of the messages it wrote. One row
// does not tell: a transaction commits entirely or not at all, but another
// transaction may have written that event's row meanwhile (a group member
// that took the partition over while this process stalled past its
// deadline, and ended this transaction as a zombie), and reading this batch
// as committed by it acknowledged the batch's other messages unapplied.
// Done needs every row recorded: then each event is applied, by this
// transaction or another, and acknowledging them all is right. One absent
// means this transaction rolled back.
func (c *Consumer) batchCommitted(ctx context.Context, its []*item, todo []int, res []result) commitState {
	state := commitUnknown // nothing was written that could tell
	for k, i := range todo {
		if res[k].kind == resApplied || res[k].kind == resRejected {
			if s, _ := c.wasCommitted(ctx, its[i]); s != commitDone {
				return s
			}
			state = commitDone
		}
	}
	return state
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
