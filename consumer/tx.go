package consumer

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A transaction's BEGIN and its dedup statement travel in one round trip
// when the DB is a *pgxpool.Pool (a batch begun with pgx.Batch.BeginTx):
// three round trips per message with a one-statement handler instead of
// four, and for a batch one fewer per transaction. With any other DB the
// transaction is begun alone and the dedup statement sent after it. Either
// way the errors are the ones the statements give when sent one after the
// other, so their results (failedBegin, "record consumed message", a
// broken batch) are classified as before.

// beginRecorded begins the transaction of it alone and writes its dedup
// row; recorded says whether the INSERT wrote it. A row not written (the
// event recorded before) is left to the step, whose own INSERT finds it
// again and compares it. Without a pool, recorded is false and the step
// writes the row.
//
// tx is nil when BEGIN failed: err is its error (insertWaited: see
// beginPipelined), nothing is left open. tx is set with err when the
// INSERT failed: the caller rolls tx back.
func (c *Consumer) beginRecorded(ctx context.Context, it *item, reject *RejectError) (tx pgx.Tx, recorded bool, err error) {
	pool, ok := c.db.(*pgxpool.Pool)
	if !ok {
		tx, err := c.db.Begin(ctx)
		return tx, false, err
	}
	br, tx, err := beginPipelined(ctx, pool, insertConsumed, c.insertArgs(it, reject))
	if err != nil {
		return nil, false, err
	}
	tag, err := br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return tx, false, err
	}
	return tx, tag.RowsAffected() == 1, nil
}

// beginBatch begins the transaction of the batch its[todo[k]] and runs its
// dedup statement; fresh says, per todo entry, whether its row was written
// now (insertBatch). tx is nil when BEGIN failed, and set with err when the
// dedup statement failed: the caller rolls tx back.
func (c *Consumer) beginBatch(ctx context.Context, its []*item, todo []int) (tx pgx.Tx, fresh []bool, err error) {
	pool, ok := c.db.(*pgxpool.Pool)
	if !ok {
		if tx, err = c.db.Begin(ctx); err != nil {
			return nil, nil, err
		}
		fresh, err = c.insertBatch(ctx, tx, its, todo)
		return tx, fresh, err
	}
	query, args := batchInsert(c.cfg.Name, its, todo)
	br, tx, err := beginPipelined(ctx, pool, query, args)
	if err != nil {
		return nil, nil, err
	}
	rows, err := br.Query()
	if err == nil {
		fresh, err = readFresh(rows, its, todo)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return tx, fresh, err
}

// beginPipelined sends BEGIN and query in one round trip and reads BEGIN's
// answer; the caller reads query's from br and closes br.
//
// On error nothing is left open and br is closed. Without a connection
// (the pool had none to give before ctx ended) nothing was sent: the
// error is Begin's, as alone. An answer to BEGIN that did not come before
// ctx ended is insertWaited: the server answers the round trip's
// statements together, so it was most likely the dedup INSERT waiting
// (for a dedup row's lock: zombie.go).
func beginPipelined(ctx context.Context, pool *pgxpool.Pool, query string, args []any) (pgx.BatchResults, pgx.Tx, error) {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(query, args...)
	br := pool.SendBatch(ctx, b)
	tx := br.Tx()
	if _, err := br.Exec(); err != nil {
		sent := tx.Conn() != nil
		_ = br.Close()
		// The transaction is closed, or on a broken connection: this only
		// gives the connection back to the pool.
		_ = tx.Rollback(ctx)
		if sent && ctx.Err() != nil {
			return nil, nil, insertWaited{err}
		}
		return nil, nil, err
	}
	return br, tx, nil
}

// insertWaited is the error of a pipelined BEGIN unanswered until the
// deadline: the wait was the INSERT's, and is judged as a blocked INSERT
// (blockedInsert), as it is when the two are sent one after the other.
type insertWaited struct{ err error }

func (e insertWaited) Error() string { return e.err.Error() }
func (e insertWaited) Unwrap() error { return e.err }

// rollback ends tx on a context of its own, bounded by HandlerTimeout.
// After the attempt's deadline (a handler that overran in Go, no statement
// in flight) a ROLLBACK on the attempt's ctx is never sent: pgx closes the
// connection instead, and the server holds the transaction's locks, the
// dedup rows among them, until its backend notices; on a loaded machine
// the next attempt of the same messages waited for them past its own
// deadline. Sent, the ROLLBACK releases them before the attempt ends, and
// the connection goes back to the pool. On a broken connection it fails at
// once.
func (c *Consumer) rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.HandlerTimeout)
	defer cancel()
	_ = tx.Rollback(rctx)
}
