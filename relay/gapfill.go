package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

// holdGapLock takes the slot's backfill lock, if this relay does not hold
// it yet, and keeps it until the gap is filled: a standby's CheckBackfill
// then stands by instead of streaming past the withheld rows. The stream
// goroutine owns the lock.
func (r *Relay) holdGapLock(ctx context.Context) error {
	if r.gapLock != nil {
		return nil
	}
	lctx, cancel := context.WithTimeout(ctx, r.probeTimeout())
	defer cancel()
	g, err := replication.LockBackfill(lctx, r.cfg.Replication)
	if err != nil {
		return fmt.Errorf("%w: hold the slot's backfill lock until the gap is filled: %v", ErrPublicationGap, err)
	}
	r.gapLock = g
	return nil
}

func (r *Relay) releaseGapLock() {
	if r.gapLock != nil {
		_ = r.gapLock.Close(context.Background())
		r.gapLock = nil
	}
}

// fillGap publishes, before streaming resumes, the outbox rows the
// publication may have withheld: every waiting row whose event the event
// stream does not hold yet (as a backfill selects them), in (aggregate id,
// version) order through the per-aggregate publisher. Rows written after
// the gap reach the stream only when the next session replays them from
// the slot's confirmed position, which the confirm limit kept before the
// gap: after these, as each aggregate's order needs. A row both published
// here and replayed is de-duplicated by its Nats-Msg-Id. wal is the
// position read before the check that found the publication right again:
// once the rows are acknowledged, nothing before it is missing.
func (r *Relay) fillGap(ctx context.Context, wal replication.LSN) error {
	if err := r.holdGapLock(ctx); err != nil {
		return err
	}
	// The ended session's messages are older than any row of the gap.
	dctx, cancel := context.WithTimeout(ctx, r.cfg.ShutdownTimeout)
	err := r.eventPublisher().Drain(dctx)
	if err == nil {
		err = r.pub.Drain(dctx)
	}
	cancel()
	if err != nil {
		return fmt.Errorf("%w: wait for the acks of the last session before publishing the gap: %v", ErrPublicationGap, err)
	}
	begun := time.Now()
	undecodable := r.guard.fillState()
	if undecodable {
		// The slot is advanced to wal after the fill, so the snapshot must
		// see every transaction that committed before it.
		sctx, cancel := context.WithTimeout(ctx, r.probeTimeout())
		err := r.guard.settle(sctx)
		cancel()
		var blocked *replication.SettleBlockedError
		if errors.As(err, &blocked) {
			r.log.Warn("publication gap: waiting for transactions that wrote the outbox to end before filling the gap; streaming resumes after they commit or roll back",
				zap.Stringers("transactions", blocked.Writers))
		}
		if err != nil {
			return fmt.Errorf("%w: %v", ErrPublicationGap, err)
		}
	}
	tx, closeTx, err := snapshotTx(ctx, r.cfg.Replication.URL, "")
	if err != nil {
		return fmt.Errorf("%w: read the outbox: %v", ErrPublicationGap, err)
	}
	defer closeTx()
	known, err := streamedIDs(ctx, r.js, tx, r.cfg)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrPublicationGap, err)
	}
	commit := router.CommitInfo{LSN: wal, Time: time.Now()}
	var published, dead, skipped int
	for _, table := range r.cfg.Replication.Tables {
		n, d, s, err := backfillTable(ctx, tx, table, tableConfig(r.cfg.Router, table), r.router, r.pub, commit, nil, known)
		published, dead, skipped = published+n, dead+d, skipped+s
		if err != nil {
			return fmt.Errorf("%w: publish the rows of %s: %v", ErrPublicationGap, table, err)
		}
	}
	if err := r.pub.Drain(ctx); err != nil {
		return fmt.Errorf("%w: wait for the acks of the gap's rows: %v", ErrPublicationGap, err)
	}
	fctx, cancel := context.WithTimeout(ctx, r.probeTimeout())
	err = r.guard.filled(fctx, wal)
	cancel()
	if err != nil {
		return fmt.Errorf("%w: the gap's rows are published: %v", ErrPublicationGap, err)
	}
	if undecodable {
		r.log.Warn("advanced the slot past WAL it cannot decode (the publication was dropped and created again): its outbox rows are published from the table",
			zap.Stringer("to_lsn", wal), zap.Bool("logical_messages_skipped", len(r.cfg.Router.Messages) > 0))
	}
	r.releaseGapLock()
	r.recordPublication(nil, false)
	r.log.Warn("publication gap filled: published the outbox rows the event stream lacked; streaming again",
		zap.Int("published", published), zap.Int("dead_lettered", dead), zap.Int("already_streamed", skipped),
		zap.Stringer("checked_lsn", wal), zap.Duration("took", time.Since(begun)))
	return nil
}
