package consumer

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// beginRecorded begins the transaction of it alone. With a *pgxpool.Pool,
// BEGIN and the dedup row's INSERT travel in one round trip (a batch
// begun with pgx.Batch.BeginTx), which leaves three per message with a
// one-statement handler instead of four; recorded then says whether the
// INSERT wrote the row. With any other DB the transaction is begun alone,
// recorded is false and the step writes the row.
//
// tx is nil when BEGIN failed: err is its error, nothing is left open;
// an insertWaited error when it was sent and its answer did not come
// before ctx ended (one that waited for a connection is Begin's error). tx
// is set with err when the INSERT failed: the caller rolls tx back. Either
// error is the one the same statement gives when sent on its own, so the
// results (failedBegin, "record consumed message") are classified as
// before. A row not written by the INSERT (recorded before) is left to the
// step, whose own INSERT finds it again and compares it.
func (c *Consumer) beginRecorded(ctx context.Context, it *item, reject *RejectError) (tx pgx.Tx, recorded bool, err error) {
	pool, ok := c.db.(*pgxpool.Pool)
	if !ok {
		tx, err := c.db.Begin(ctx)
		return tx, false, err
	}
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(insertConsumed, c.insertArgs(it, reject)...)
	br := pool.SendBatch(ctx, b)
	tx = br.Tx()
	if _, err := br.Exec(); err != nil {
		// Without a connection (the pool had none to give before ctx
		// ended) nothing was sent: the Begin's failure, as alone.
		sent := tx.Conn() != nil
		_ = br.Close()
		// The transaction is closed, or on a broken connection: this only
		// gives the connection back to the pool.
		_ = tx.Rollback(ctx)
		if sent && ctx.Err() != nil {
			// The server answers the batch's statements together, so an
			// answer to BEGIN that did not come in time is most likely the
			// INSERT waiting (for the dedup row's lock: zombie.go).
			return nil, false, insertWaited{err}
		}
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
