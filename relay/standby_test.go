package relay_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
)

// countingObserver counts the replication session's restarts and a
// standby's retries.
type countingObserver struct {
	relay.NopObserver
	restarts, standby atomic.Int64
}

func (o *countingObserver) Reconnected() { o.restarts.Add(1) }
func (o *countingObserver) StandingBy()  { o.standby.Add(1) }

// A standby's retries for a slot another instance holds are not restarts:
// counted as such they fired OutboxReplicationRestarting forever in every
// HA pair.
func TestStandbyRetriesAreNotRestarts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.Setup(ctx)
	f.start(ctx)
	if !testenv.WaitFor(30*time.Second, func() bool { return f.slot(ctx).Active }) {
		t.Fatal("the first relay did not take the slot")
	}
	obs := &countingObserver{}
	f.Start(ctx, relay.WithObserver(obs))
	if !testenv.WaitFor(30*time.Second, func() bool { return obs.standby.Load() >= 3 }) {
		t.Fatalf("the second relay retried for the slot %d times, want ≥ 3", obs.standby.Load())
	}
	if n := obs.restarts.Load(); n != 0 {
		t.Errorf("a standby counted %d replication restarts, want 0", n)
	}
}

// Regression (issue 25): on a first deploy without auto_setup, a standby's
// backfill check passed (no slot yet, no backfill running) and let go of
// the lock before the session started; a backfill then created the slot,
// and the standby streamed new rows while the backfill was still
// publishing the snapshot's older versions: "stream position 1515 holds
// version 10001". The check's lock is held until the session started, so
// the backfill waits for it.
func TestStandbyHoldsBackfillLockUntilStreaming(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.Cfg.Publisher.MaxInFlight = 1 // a backfill slow enough to stream alongside
	f.CreateStreams(ctx)
	const before, after = 10000, 100
	f.insertVersions(ctx, "agg", 1, before)
	standby, err := relay.New(f.Cfg, f.NC, relay.WithLogger(zaptest.NewLogger(t).Named("standby")))
	if err != nil {
		t.Fatal(err)
	}
	checked := make(chan struct{})
	var once sync.Once
	relay.SetAfterBackfillCheck(standby, func() {
		once.Do(func() { close(checked) })
		// The delay that let a backfill in: until the slot exists, or 3s.
		testenv.WaitFor(3*time.Second, func() bool { return f.slot(ctx).Exists })
	})
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	standbyDone := make(chan error, 1)
	go func() { standbyDone <- standby.Run(sctx) }()
	<-checked
	wait := f.backfillAsync(ctx)
	if !testenv.WaitFor(30*time.Second, func() bool { return f.slot(ctx).Exists }) {
		t.Fatal("the backfill never created the slot")
	}
	f.insertVersions(ctx, "agg", before+1, before+after)
	if err := wait(); err != nil {
		t.Fatalf("backfill: %v", err)
	}
	// The standby either found no slot (and stopped) or streams after the
	// backfill; a relay streams the rest either way.
	select {
	case err := <-standbyDone:
		if !errors.Is(err, replication.ErrSlotMissing) {
			t.Fatalf("standby: %v, want ErrSlotMissing or streaming", err)
		}
		f.start(ctx)
	case <-time.After(time.Second):
	}
	f.WaitCount(ctx, f.Stream, before+after, 60*time.Second)
	f.versionsInOrder(ctx, "agg", before+after)
}
