package consumer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"
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
	resInDoubt                      // the commit failed and whether it went through is unknown: retried, never charged
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

// misses reports whether version v of the aggregate is one a gap result
// lacks: above its current version, below the received one.
func (r result) misses(v int64) bool { return v > r.current && v < r.received }

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
	res := c.runTx(ctx, it, it.rejected)
	if res.kind == resRejectRedo {
		it.rejected = res.reject
		res = c.runTx(ctx, it, it.rejected)
	}
	c.met.handle.Observe(time.Since(start).Seconds())
	return res
}

// runTx is one transaction for it alone. With reject set, the handler is
// not called and the dedup row records the rejection instead of an effect.
func (c *Consumer) runTx(ctx context.Context, it *item, reject *RejectError) result {
	tx, recorded, err := c.beginRecorded(ctx, it, reject)
	var waited insertWaited
	switch {
	case errors.As(err, &waited):
		return c.blockedInsert(ctx, stepIn{it: it, reject: reject}, waited.err).res
	case tx == nil:
		return failedBegin(err)
	}
	committed := false
	defer func() {
		if !committed {
			// A failed rollback means a broken connection, which the pool
			// discards; nothing of the transaction survives it.
			c.rollback(ctx, tx)
		}
	}()
	if err != nil {
		return c.blockedInsert(ctx, stepIn{it: it, reject: reject}, err).res
	}
	s := c.step(ctx, tx, stepIn{it: it, reject: reject, recorded: recorded})
	switch {
	case s.outcome == stepDecided && s.res.kind == resDuplicate && it.replay != nil:
		return c.commitReplay(ctx, tx, it, outcomeDuplicate, s.res, &committed)
	case s.outcome != stepWrote:
		// Alone, a broken transaction's deadline was the message's own
		// budget: the result is its attempt.
		return s.res
	case it.replay != nil && reject != nil:
		return c.commitReplay(ctx, tx, it, outcomeRejected, s.res, &committed)
	case it.replay != nil:
		return c.commitReplay(ctx, tx, it, outcomeApplied, s.res, &committed)
	}
	err = tx.Commit(ctx)
	committed = true // after a failed commit nothing is left to roll back
	return c.commitResult(ctx, it, s.res, err)
}

// commitResult is the result of a transaction for it alone that would be
// res, once its commit returned err. A failed commit may have gone through
// (a deadline, or a connection lost after the server committed): the dedup
// row decides, and when the database cannot be asked, the result is
// resInDoubt, which is retried and never dead-lettered.
func (c *Consumer) commitResult(ctx context.Context, it *item, res result, err error) result {
	if err == nil {
		c.committed(it)
		return res
	}
	switch state, checkErr := c.wasCommitted(ctx, it); state {
	case commitDone:
		c.committed(it)
		return res
	case commitAbsent:
		return failed(err, "commit")
	default:
		return result{kind: resInDoubt, class: ClassTransient,
			err: fmt.Errorf("commit: %w; whether it went through is unknown: %w", err, checkErr)}
	}
}

// commitState is what the dedup row tells of a commit that returned an
// error.
type commitState int

const (
	commitUnknown commitState = iota // the database could not be asked
	commitDone                       // the row is there with the message's hash
	commitAbsent                     // it is not: the transaction did not commit
)

// wasCommitted asks the database whether the transaction that wrote the
// dedup row of it, and whose commit returned an error, went through. A
// read on another connection is not enough: after a lost connection the
// old backend may still be committing (waiting for its WAL flush, or in a
// deferred trigger), and its row is invisible until it has. The probe
// writes the dedup row again, in a transaction it rolls back: that insert
// waits for a transaction holding the same key uncommitted, so "absent" is
// read after the old transaction ended. A probe that cannot reach the
// database is tried again until HandlerTimeout; then the state is unknown.
func (c *Consumer) wasCommitted(ctx context.Context, it *item) (commitState, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.HandlerTimeout)
	defer cancel()
	for attempt := 1; ; attempt++ {
		state, err := c.probeCommit(ctx, it)
		if state != commitUnknown {
			return state, nil
		}
		t := time.NewTimer(backoff(attempt, probeRetryBase, probeRetryMax, jitter))
		select {
		case <-ctx.Done():
			t.Stop()
			return commitUnknown, err
		case <-t.C:
		}
	}
}

// The pauses between commit probes: short, since the message's aggregate
// waits meanwhile, and capped well below any HandlerTimeout.
const (
	probeRetryBase = 50 * time.Millisecond
	probeRetryMax  = time.Second
)

// probeCommit is one attempt of wasCommitted.
func (c *Consumer) probeCommit(ctx context.Context, it *item) (commitState, error) {
	tx, err := c.db.Begin(ctx)
	if err != nil {
		return commitUnknown, fmt.Errorf("begin commit probe: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }() // the probe leaves nothing behind
	written, err := c.insertOne(ctx, tx, it, nil)
	if err != nil {
		return commitUnknown, fmt.Errorf("probe dedup row: %w", err)
	}
	if written {
		return commitAbsent, nil // no transaction holds the key: the old one rolled back
	}
	var hash []byte
	err = tx.QueryRow(ctx, `SELECT content_hash FROM consumed_message WHERE consumer = $1 AND event_id = $2`,
		c.cfg.Name, it.m.ID).Scan(&hash)
	switch {
	case err == nil && bytes.Equal(hash, it.hash):
		return commitDone, nil
	case err == nil:
		return commitAbsent, nil // a row with other content is another message's
	}
	// ErrNoRows: pruned between the two statements; the next probe tells.
	return commitUnknown, fmt.Errorf("read dedup row: %w", err)
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

// recordedBefore reports whether the message's own dedup row (its id with
// its hash) is committed: some attempt of it was applied or rejected, so
// it must not be dead-lettered, whatever its later attempts met. A row
// with another hash is a conflict, another message's.
func (c *Consumer) recordedBefore(ctx context.Context, it *item) (bool, error) {
	if it.hash == nil {
		return false, nil // not parsed: nothing of it was ever written
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.HandlerTimeout)
	defer cancel()
	found, err := c.recordedAmong(ctx, []string{it.m.ID}, [][]byte{it.hash})
	return found[0], err
}

// recordedAmong reports, for each event id with its hash, whether its
// dedup row is committed.
func (c *Consumer) recordedAmong(ctx context.Context, ids []string, hashes [][]byte) ([]bool, error) {
	found := make([]bool, len(ids))
	rows, err := c.db.Query(ctx, `
		SELECT u.i FROM unnest($2::text[], $3::bytea[]) WITH ORDINALITY AS u(id, hash, i)
		JOIN consumed_message m ON m.consumer = $1 AND m.event_id = u.id AND m.content_hash = u.hash`,
		c.cfg.Name, ids, hashes)
	if err != nil {
		return found, err
	}
	defer rows.Close()
	for rows.Next() {
		var i int64
		if err := rows.Scan(&i); err != nil {
			return found, err
		}
		found[i-1] = true
	}
	return found, rows.Err()
}
