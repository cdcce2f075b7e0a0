package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"
)

// A zombie is a backend of the consumer's own role left idle in a
// transaction that holds a message's dedup row: an earlier attempt whose Go
// side gave up (its connection was lost, or pgx broke it at the deadline)
// while the server still keeps the transaction open, until it notices the
// client is gone — which an idle backend does only when it next reads, or
// after the kernel's keepalive. Every later attempt's dedup insert waits for
// it and runs into HandlerTimeout: charged as failures, they dead-letter an
// event that nothing is wrong with. endZombies ends such a backend; the
// attempt that found it is in doubt (resInDoubt), retried and not charged.

// zombieQuery looks at the backends that block the backend $1 and may be
// zombies: the same login role as this session (terminating them needs no
// further privilege) and idle in a transaction. It terminates those whose
// transaction began over $2 seconds ago, AckWait: longer than a live
// attempt of any process of this consumer can last (its HandlerTimeout is
// below the durable's AckWait), even one whose HandlerTimeout is longer
// than this process's, as in a rolling deploy that lowers it. It returns
// how many it found and how many it signalled. CASE, not AND, keeps the
// age test ahead of pg_terminate_backend: PostgreSQL may evaluate an AND's
// operands in any order.
const zombieQuery = `
	SELECT count(*),
	       count(*) FILTER (WHERE CASE WHEN a.xact_start < now() - make_interval(secs => $2)
	                              THEN pg_terminate_backend(a.pid) ELSE false END)
	FROM pg_stat_activity a
	WHERE a.pid = ANY (pg_blocking_pids($1))
	  AND a.usesysid = (SELECT usesysid FROM pg_stat_activity WHERE pid = pg_backend_pid())
	  AND a.state = 'idle in transaction'`

// zombiePoll is how often endZombies looks for what blocks its probe.
const zombiePoll = 25 * time.Millisecond

// endZombies is called after the dedup insert of it ran into its attempt's
// deadline. The attempt's backend no longer waits (pgx broke or cancelled
// it), so a probe waits in its place: it writes the dedup row again in a
// transaction it rolls back, and while it waits, the backends blocking it
// that are zombies are terminated. It reports whether a backend of this
// role idle in a transaction held the row: one ended, or one too young to
// be judged abandoned (a live attempt elsewhere, or a zombie that has not
// outlived AckWait yet); either way the attempt was not the message's
// fault. It is bounded by HandlerTimeout of its own.
func (c *Consumer) endZombies(ctx context.Context, it *item) (bool, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.HandlerTimeout)
	defer cancel()
	tx, err := c.db.Begin(ctx)
	if err != nil {
		return false, fmt.Errorf("begin zombie probe: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }() // the probe leaves nothing behind
	conn := tx.Conn()
	if conn == nil {
		return false, errors.New("zombie probe: the transaction has no connection to name")
	}
	pid := conn.PgConn().PID()
	probed := make(chan error, 1)
	probeCtx, stop := context.WithCancel(ctx)
	go func() {
		_, err := c.insertOne(probeCtx, tx, it, nil)
		probed <- err
	}()
	done := false
	defer func() {
		if stop(); !done {
			<-probed
		}
	}()
	held := false
	tick := time.NewTicker(zombiePoll)
	defer tick.Stop()
	for {
		select {
		case err := <-probed:
			done = true
			return held, err
		case <-ctx.Done():
			if held {
				return true, nil // still held by a transaction too young to end
			}
			return false, fmt.Errorf("zombie probe still blocked: %w", ctx.Err())
		case <-tick.C:
		}
		var found, ended int
		if err := c.db.QueryRow(ctx, zombieQuery, pid, c.cfg.AckWait.Seconds()).Scan(&found, &ended); err != nil {
			return held, fmt.Errorf("look up blocking backends: %w", err)
		}
		if ended > 0 {
			c.log.Warn("terminated an abandoned transaction of this role that held a message's dedup row",
				zap.String(fieldEventID, it.m.ID), zap.Uint64(fieldSeq, it.m.StreamSeq), zap.Int("backends", ended))
		}
		held = held || found > 0
	}
}

// blockedInsert is the step's result for a dedup insert that failed with
// err: after the deadline, in doubt when a zombie held the row and was
// ended, so that the retry is not charged; otherwise the attempt, as
// before. A batch does not look: its deadline may have passed in a
// neighbour's handler, and a broken batch's messages are applied one at a
// time next, where a zombie is met alone.
func (c *Consumer) blockedInsert(ctx context.Context, in stepIn, err error) stepResult {
	it := in.it
	res := failedStep(ctx, failed(err, "record consumed message"))
	if res.outcome != stepBroken || in.shared {
		return res
	}
	held, zerr := c.endZombies(ctx, it)
	if !held {
		if zerr != nil {
			c.log.Debug("no zombie found behind a blocked dedup insert", zap.String(fieldEventID, it.m.ID), zap.Error(zerr))
		}
		return res
	}
	res.res = result{kind: resInDoubt, class: ClassTransient,
		err: fmt.Errorf("record consumed message: %w; another transaction of this role held the row (ended once idle in it for over AckWait)", err)}
	return res
}
