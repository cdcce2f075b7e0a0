package relay

import (
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// Issue 27: a standby logged "slot in use … standing by" at info every
// ~2 s. It says so once at info, then at debug, with a summary at info
// every standbySummaryEvery; after streaming it says so at info again.
func TestStandbyLog(t *testing.T) {
	t.Parallel()
	core, logs := observer.New(zap.DebugLevel)
	log := zap.New(core)
	var s standbyLog
	start := time.Unix(0, 0)
	inUse := errors.New("slot in use")
	// An hour of retries every 2 s.
	for at := time.Duration(0); at < time.Hour; at += 2 * time.Second {
		s.retry(log, start.Add(at), 2*time.Second, inUse)
	}
	s.reset()
	s.retry(log, start.Add(2*time.Hour), 2*time.Second, inUse)
	var info, debug int
	for _, e := range logs.All() {
		switch e.Level {
		case zapcore.InfoLevel:
			info++
		case zapcore.DebugLevel:
			debug++
		}
	}
	// 1 first, 11 summaries (at 5, 10, …, 55 minutes), 1 after the reset.
	if info != 13 || debug != 1800-12 {
		t.Errorf("%d info and %d debug lines, want 13 and %d", info, debug, 1800-12)
	}
	sums := logs.FilterMessage("still standing by: slot in use by another instance").All()
	if len(sums) == 0 || sums[0].ContextMap()["retries"] != int64(151) {
		t.Errorf("summaries %v, want the first to count 151 retries", sums)
	}
}
