package consumer

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestResetsDoNotHurryARetry: a message fails (an unclassified error,
// MaxAttempts 3) and is naked for its backoff, a minute. Resets of the
// durable made by another party deliver it again at once, and its
// redelivery goes ahead of its worker's queue (enqueue). Five resets in a
// few seconds must not spend its attempts: RetryBase and RetryMax say
// when a failed message is tried again, and a dead letter three attempts
// in is a message lost to an operator's replay that the backoff would
// have given a minute each.
func TestResetsDoNotHurryARetry(t *testing.T) {
	const resets = 5
	f := newFixture(t)
	r := newRecorder("hurry")
	failing := uuidN(0)
	r.fail = func(m *Message, call int) error {
		if m.ID == failing {
			return errors.New("downstream refuses") // ClassUnknown
		}
		return nil
	}
	cfg := f.baseConfig("hurry")
	cfg.Workers = 1
	cfg.BatchSize = 1
	cfg.RetryBase = time.Minute
	cfg.RetryMax = time.Minute
	cfg.MaxAttempts = 3
	cfg.GapWait = 2 * time.Minute
	f.start(cfg, r)
	f.publish(event{ID: failing, AggID: "f", Version: 1})
	f.waitFor("the first attempt", 30*time.Second, func() bool { return r.callCount(failing) == 1 })
	for i := range resets {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := f.js.ResetConsumer(ctx, f.stream, cfg.Name)
		cancel()
		testenv.Must(t, err, "reset the durable")
		// Each reset adopted before the next: each is a run of its own.
		f.waitFor("the reset adopted", 30*time.Second, func() bool { return resumesByReason(t, f.reg)[resumeAdopted] >= float64(i+1) })
	}
	// An attempt made at a reset's adoption ends within moments.
	testenv.WaitFor(3*time.Second, func() bool { return r.callCount(failing) > 1+resets/2 })
	calls := r.callCount(failing)
	dead := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = $1`, cfg.Name)
	t.Logf("%d resets within the first attempt's minute of backoff: %d attempts, %d dead-lettered", resets, calls, dead)
	if calls != 1 || dead != 0 {
		t.Errorf("%d resets made the failed message's %d attempts within its backoff of %s (MaxAttempts %d), %d dead-lettered: want 1 attempt, none dead-lettered",
			resets, calls, cfg.RetryBase, cfg.MaxAttempts, dead)
	}
}
