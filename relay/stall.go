package relay

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/watermark"
)

// Stall is the watermark standing still while messages are unsettled.
type Stall struct {
	// For is how long the watermark has not moved.
	For time.Duration
	// Blocker is the oldest unsettled message, the one holding the
	// watermark; Known is false when no publisher holds one.
	Blocker publisher.Stuck
	Known   bool
}

// WatermarkStall returns how long the watermark has stood still waiting for
// acks (zero while it moves, while nothing is pending, or while the oldest
// transaction is still being read), and what holds it once that exceeds
// StallWarning.
func (r *Relay) WatermarkStall() Stall {
	if s := r.stall.Load(); s != nil {
		return *s
	}
	return Stall{}
}

// IntakePaused reports whether the pipeline stopped reading the WAL
// because the unsettled tail reached MaxUnsettledTxs or MaxUnsettledBytes.
func (r *Relay) IntakePaused() bool { return r.paused.Load() }

// oldest returns the oldest unsettled message of either publisher: handed
// over in commit order, it is the one holding the watermark.
func (r *Relay) oldest() (publisher.Stuck, bool) {
	st, ok := r.pub.Oldest()
	if r.Batched() {
		if bst, bok := r.batch.Oldest(); bok && (!ok || bst.Since.Before(st.Since)) {
			return bst, true
		}
	}
	return st, ok
}

// stallSample is how often watchStall looks at the watermark.
const stallSample = time.Second

// watchStall samples the watermark until ctx ends. Once it has stood still
// for StallWarning with transactions unsettled, it names the message
// holding it, in the log (again every StallWarning) and in WatermarkStall.
func (r *Relay) watchStall(ctx context.Context) {
	t := time.NewTicker(stallSample)
	defer t.Stop()
	var (
		last     watermark.LSN
		since    = time.Now()
		lastWarn time.Time
	)
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			tr := r.Tracker()
			c := tr.Confirmed()
			txs, walBytes := tr.Unsettled()
			if c != last || txs == 0 || !tr.WaitingForAcks() {
				last, since = c, now
				r.stall.Store(&Stall{})
				continue
			}
			st := Stall{For: now.Sub(since)}
			if st.For >= r.cfg.StallWarning {
				st.Blocker, st.Known = r.oldest()
				if now.Sub(lastWarn) >= r.cfg.StallWarning {
					lastWarn = now
					r.log.Warn("watermark stuck: nothing is confirmed to PostgreSQL until the message holding it is stored or dead-lettered",
						zap.Duration("for", st.For.Round(time.Second)), zap.String("key", st.Blocker.Key), zap.String("subject", st.Blocker.Subject),
						zap.Int("attempts", st.Blocker.Attempts), zap.Int("unsettled_transactions", txs), zap.Uint64("unsettled_wal_bytes", walBytes),
						zap.Stringer("confirmed_lsn", c))
				}
			}
			r.stall.Store(&st)
		}
	}
}
