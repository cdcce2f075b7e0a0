package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/publisher"
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
	if wal, err = r.settleStretch(ctx, wal, undecodable); err != nil {
		return fmt.Errorf("%w: %v", ErrPublicationGap, err)
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
	if undecodable {
		if err := r.fillMessages(ctx, wal); err != nil {
			return fmt.Errorf("%w: %v", ErrPublicationGap, err)
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
		r.log.Warn("advanced the slot past WAL it cannot decode (the publication was dropped and created again): its outbox rows are published from the table, its logical messages read through the message publication",
			zap.Stringer("to_lsn", wal))
	}
	r.releaseGapLock()
	r.recordPublication(nil, false)
	r.log.Warn("publication gap filled: published the outbox rows the event stream lacked; streaming again",
		zap.Int("published", published), zap.Int("dead_lettered", dead), zap.Int("already_streamed", skipped),
		zap.Stringer("checked_lsn", wal), zap.Duration("took", time.Since(begun)))
	return nil
}

// settleStretch waits until the outbox's writers that may hold rows of
// the gap are visible to the fill's snapshot (SettleCommits), and returns
// the position the fill vouches for: wal, or, when the slot is advanced
// past an undecodable stretch, a position read now, not before the check
// that found the publication right: the check saw the new publication's
// creation, whose commit record may lie after a position read before the
// check (with synchronous_commit off, after the server's write position
// too), and a slot advanced short of it fails on the stretch again. While
// a writer stays open the relay is not ready and says which.
func (r *Relay) settleStretch(ctx context.Context, wal replication.LSN, undecodable bool) (replication.LSN, error) {
	sctx, cancel := context.WithTimeout(ctx, r.probeTimeout())
	defer cancel()
	if undecodable {
		var err error
		if wal, err = r.guard.position(sctx); err != nil {
			return 0, err
		}
	}
	err := r.guard.settle(sctx)
	var blocked *replication.SettleBlockedError
	if errors.As(err, &blocked) {
		r.log.Warn("publication gap: waiting for transactions that wrote the outbox to end before filling the gap; streaming resumes after they commit or roll back",
			zap.Stringers("transactions", blocked.Writers))
		r.recordPublication(blocked, true)
	}
	return wal, err
}

// fillMessages publishes the logical messages (router.Config.Messages)
// of the undecodable stretch up to wal, which advancing the slot would
// skip: relayed, or dead-lettered when unroutable, in commit order, as the
// stream would have. When they cannot be read (the message publication
// missing from part of the stretch) the loss is logged and counted as
// ClassStretchUnread.
func (r *Relay) fillMessages(ctx context.Context, wal replication.LSN) error {
	if len(r.cfg.Router.Messages) == 0 {
		return nil
	}
	prefixes := newMessagePrefixes(r.cfg.Router.MessagePrefixes())
	var relayed, dead int
	err := r.guard.stretchMessages(ctx, wal, func(m *replication.StretchMessage) error {
		if !prefixes[m.Prefix] {
			return nil
		}
		commit := router.CommitInfo{LSN: m.Commit.FinalLSN, Time: m.Commit.CommitTime}
		if !m.Transactional {
			commit = router.CommitInfo{LSN: m.LSN, Time: time.Now()}
		}
		env, err := envelope(&m.Message)
		if err == nil {
			var rm *router.Message
			if rm, err = r.router.RouteEnvelope(&m.Message, env, commit); err == nil {
				relayed++
				return r.pub.Publish(ctx, routedMessage(r.router, rm))
			}
		}
		dead++
		r.obs.Unroutable(reasonClass(err))
		dl := r.router.DeadLetterLogical(&m.Message, env, commit, err)
		return r.pub.Publish(ctx, &publisher.Message{Subject: dl.Subject, Header: dl.Header, Data: dl.Data})
	})
	var pgErr *pgconn.PgError
	switch {
	case errors.Is(err, replication.ErrStretchUnreadable):
		r.log.Error("logical messages of the WAL the slot cannot decode are lost: advancing past them, a dead-letter record per message prefix names the stretch; outbox rows are published from the table (run `outbox-relay setup` to create the message publication, so that a later recreation loses none)",
			zap.Stringer("to_lsn", wal), zap.Error(err))
		return r.deadLetterStretch(ctx, wal, err)
	case errors.As(err, &pgErr) && pgErr.Code == pgerrcode.ObjectInUse:
		return nil // another session streams the slot: it reads them (filled)
	case err != nil:
		return fmt.Errorf("publish the logical messages of the stretch: %w", err)
	}
	if relayed+dead > 0 {
		r.log.Warn("published the logical messages of the WAL the slot cannot decode", zap.Int("published", relayed), zap.Int("dead_lettered", dead), zap.Stringer("to_lsn", wal))
	}
	return nil
}

// deadLetterStretch records, for each message prefix, that the logical
// messages of the stretch up to wal could not be read: the loss is in the
// dead-letter stream, at the stretch's end LSN (so a fill repeated over
// the same stretch records it once), and counted as ClassStretchUnread.
func (r *Relay) deadLetterStretch(ctx context.Context, wal replication.LSN, cause error) error {
	commit := router.CommitInfo{LSN: wal, Time: time.Now()}
	for _, prefix := range r.cfg.Router.MessagePrefixes() {
		reason := &messageError{class: ClassStretchUnread, reason: fmt.Sprintf(
			"logical messages with prefix %q written while publication %q was dropped and created again, up to %s, could not be read and are lost: %v; find them in the producers' records",
			prefix, r.cfg.Replication.Publication, wal, cause)}
		r.obs.Unroutable(ClassStretchUnread)
		dl := r.router.DeadLetterLogical(&replication.Message{Transactional: true, Prefix: prefix, LSN: wal}, nil, commit, reason)
		if err := r.pub.Publish(ctx, &publisher.Message{Subject: dl.Subject, Header: dl.Header, Data: dl.Data}); err != nil {
			return fmt.Errorf("dead-letter the unread logical messages of the stretch: %w", err)
		}
	}
	return nil
}
