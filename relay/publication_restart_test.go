package relay_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/relay"
)

// Adversarial review of issue 25: a relay that stops (restart, crash,
// deploy) while a publication gap waits to be filled forgets the gap; the
// next relay finds the publication right, streams from the slot's
// confirmed position (held before the gap), and pgoutput never sends the
// rows written while the table was out of the publication.
func TestRelayPublicationGapSurvivesRestart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.Cfg.PublicationCheck = 200 * time.Millisecond
	f.Setup(ctx)
	rl, stop := f.Start(ctx)
	pub := `"` + f.Cfg.Replication.Publication + `"`
	exec := sqlExec(t, ctx, f.DB.Pool)
	w := f.NewWriter(5)
	all := w.Write(ctx, 50, 5)
	f.WaitCount(ctx, f.Stream, 50, 30*time.Second)
	exec(`ALTER PUBLICATION ` + pub + ` DROP TABLE outbox`)
	all = append(all, w.Write(ctx, 50, 5)...)
	if !testenv.WaitFor(10*time.Second, func() bool { return errors.Is(rl.PublicationProblem(), relay.ErrPublicationGap) }) {
		t.Fatalf("no gap noticed: %v", rl.PublicationProblem())
	}
	if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
		t.Logf("first relay: %v", err)
	}
	exec(`ALTER PUBLICATION ` + pub + ` ADD TABLE outbox`)
	f.Start(ctx)
	all = append(all, w.Write(ctx, 50, 5)...)
	testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.JS, f.Stream) >= uint64(len(all)) })
	if rep := relaytest.Check(all, f.Read(ctx, f.Stream)); !rep.OK() {
		t.Fatalf("stream check after a restart during the gap: %s", rep)
	}
}

// Adversarial review of issue 25: the active relay stops during a
// publication gap; a standby that checked the publication before the gap
// takes over once it is fixed and must publish the gap's rows.
func TestRelayPublicationGapStandbyTakesOver(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.Cfg.PublicationCheck = 200 * time.Millisecond
	f.Setup(ctx)
	rl, stop := f.Start(ctx)
	w := f.NewWriter(5)
	all := w.Write(ctx, 50, 5)
	f.WaitCount(ctx, f.Stream, 50, 30*time.Second)
	obs := &countingObserver{}
	f.Start(ctx, relay.WithObserver(obs))
	if !testenv.WaitFor(30*time.Second, func() bool { return obs.standby.Load() >= 1 }) {
		t.Fatal("the second relay did not stand by")
	}
	pub := `"` + f.Cfg.Replication.Publication + `"`
	exec := sqlExec(t, ctx, f.DB.Pool)
	exec(`ALTER PUBLICATION ` + pub + ` DROP TABLE outbox`)
	all = append(all, w.Write(ctx, 50, 5)...)
	if !testenv.WaitFor(10*time.Second, func() bool { return errors.Is(rl.PublicationProblem(), relay.ErrPublicationGap) }) {
		t.Fatalf("no gap noticed: %v", rl.PublicationProblem())
	}
	_ = stop()
	exec(`ALTER PUBLICATION ` + pub + ` ADD TABLE outbox`)
	all = append(all, w.Write(ctx, 50, 5)...)
	testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.JS, f.Stream) >= uint64(len(all)) })
	if rep := relaytest.Check(all, f.Read(ctx, f.Stream)); !rep.OK() {
		t.Fatalf("stream check after a standby took over during the gap: %s", rep)
	}
}
