package relay_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/relay"
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
