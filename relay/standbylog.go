package relay

import (
	"time"

	"go.uber.org/zap"
)

// standbySummaryEvery is how often a standby says, at info, that it still
// stands by; its retries in between (every 2 s at most) are logged at
// debug, so a healthy HA pair does not fill the log.
const standbySummaryEvery = 5 * time.Minute

// standbyLog logs a standby's retries for the slot: the first at info,
// the rest at debug, with a summary at info every standbySummaryEvery. It
// belongs to the stream loop's goroutine.
type standbyLog struct {
	since, lastSummary time.Time
	retries            int
}

// retry logs one retry at now.
func (s *standbyLog) retry(log *zap.Logger, now time.Time, wait time.Duration, err error) {
	s.retries++
	switch {
	case s.since.IsZero():
		s.since, s.lastSummary = now, now
		// The message is the same as the debug lines' (and what the HA
		// fault tests and operators' log queries match); the cadence of the
		// lines that follow is in a field.
		log.Info("slot in use by another instance; standing by",
			zap.Duration("retry_in", wait), zap.String("then", "retries at debug, a summary at info every "+standbySummaryEvery.String()), zap.Error(err))
	case now.Sub(s.lastSummary) >= standbySummaryEvery:
		s.lastSummary = now
		log.Info("still standing by: slot in use by another instance",
			zap.Duration("standing_by_for", now.Sub(s.since).Round(time.Second)), zap.Int("retries", s.retries), zap.Error(err))
	default:
		log.Debug("slot in use by another instance; standing by", zap.Duration("retry_in", wait), zap.Error(err))
	}
}

// reset ends the standby phase: the next retry is logged at info again.
func (s *standbyLog) reset() { *s = standbyLog{} }
