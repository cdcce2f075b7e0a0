package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Regression (issue 16, case 2): per aggregate, a message stuck on one key
// let everything behind it be published while the watermark stood still,
// so the unsettled transactions, the retained WAL and the re-sends after a
// restart grew without limit. Intake stops at MaxUnsettledTxs, the message
// holding the watermark is named, and everything flows once it is stored.
// In batches the stuck message stops the others anyway; the stall is named
// all the same.
func TestRelayBoundsUnsettledTail(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"off", "on"} {
		t.Run("batch_publish "+mode, func(t *testing.T) {
			t.Parallel()
			boundUnsettledTail(t, mode)
		})
	}
}

func boundUnsettledTail(t *testing.T, mode string) {
	ctx := context.Background()
	f := newFixture(t, "")
	const bound = 50
	f.Cfg.BatchPublish = mode
	f.Cfg.MaxUnsettledTxs = bound
	f.Cfg.StallWarning = time.Second
	// One message per subject, new ones refused: the second version of an
	// aggregate is retried until the limit is lifted.
	f.Cfg.CreateStreams = false
	sc := jetstream.StreamConfig{Name: f.Stream, Subjects: f.Cfg.Stream.Subjects, Duplicates: 2 * time.Minute,
		MaxMsgsPerSubject: 1, Discard: jetstream.DiscardNew, DiscardNewPerSubject: true, MaxMsgs: -1, MaxBytes: -1, AllowBatchPublish: true}
	if _, err := f.JS.CreateStream(ctx, sc); err != nil {
		t.Fatal(err)
	}
	if _, err := f.JS.CreateStream(ctx, jetstream.StreamConfig{Name: f.DLQ, Subjects: f.Cfg.DeadLetterStream.Subjects}); err != nil {
		t.Fatal(err)
	}
	f.Setup(ctx)
	rl, _ := f.Start(ctx)
	insert := func(agg string, version int) {
		t.Helper()
		if _, err := f.DB.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload)
			VALUES (gen_random_uuid(), 'registration', $1, $2, 'T', '{}')`, agg, version); err != nil {
			t.Fatal(err)
		}
	}
	insert("stuck", 1)
	insert("stuck", 2)
	const others = 300
	for i := range others {
		insert(fmt.Sprintf("a%d", i), 1)
	}
	if !testenv.WaitFor(30*time.Second, rl.IntakePaused) {
		t.Fatal("intake never paused")
	}
	info, err := f.JS.Stream(ctx, f.Stream)
	if err != nil {
		t.Fatal(err)
	}
	if n := info.CachedInfo().State.Msgs; n > bound {
		t.Fatalf("%d events stored behind the stuck one, bound %d", n, bound)
	}
	if !testenv.WaitFor(30*time.Second, func() bool {
		st := rl.WatermarkStall()
		return st.Known && st.Blocker.Key == "registration\x00stuck" && st.For >= time.Second
	}) {
		t.Fatalf("stall not reported: %+v", rl.WatermarkStall())
	}

	sc.MaxMsgsPerSubject, sc.DiscardNewPerSubject = -1, false
	if _, err := f.JS.UpdateStream(ctx, sc); err != nil {
		t.Fatal(err)
	}
	f.WaitCount(ctx, f.Stream, 2+others, 60*time.Second)
	f.waitConfirmed(ctx, 10*time.Second, func() bool { return !rl.IntakePaused() })
	if !testenv.WaitFor(10*time.Second, func() bool { return rl.WatermarkStall().For == 0 }) {
		t.Fatalf("stall still reported: %+v", rl.WatermarkStall())
	}
}
