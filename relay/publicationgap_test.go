package relay_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
)

// Regression (issue 25): the outbox table dropped from the publication
// while the relay streamed was a silent loss: the idle session confirmed
// the server's WAL end past the inserts the publication withheld, and after
// ADD TABLE later rows were relayed and the gap's never. Now the relay
// confirms nothing past the last right check, stops streaming, and once
// the table is back publishes the gap's rows before any later row of the
// same aggregate — also when the table is added back before a periodic
// check could see it missing ("quick": the Relation message that precedes
// the first row after ADD TABLE triggers a check that sees the
// publication redefined). In both publishing modes.
func TestRelayPublicationGap(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"auto", "off"} {
		for _, quick := range []bool{false, true} {
			name := mode + "/checked"
			if quick {
				name = mode + "/quick"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				publicationGap(t, mode, quick)
			})
		}
	}
}

func publicationGap(t *testing.T, mode string, quick bool) {
	ctx := context.Background()
	f := newFixture(t, "")
	f.Cfg.BatchPublish = mode
	f.Cfg.PublicationCheck = 200 * time.Millisecond
	if quick {
		// No periodic check in the test's time: only the Relation hook.
		f.Cfg.PublicationCheck = time.Hour
		f.Cfg.Replication.StatusInterval = time.Second
		f.Cfg.Replication.ReceiveTimeout = 3 * time.Second
	}
	f.Setup(ctx)
	var ready atomic.Bool
	f.Start(ctx, relay.WithReadiness(ready.Store))
	pub := `"` + f.Cfg.Replication.Publication + `"`
	exec := sqlExec(t, ctx, f.DB.Pool)
	w := f.NewWriter(5)
	all := w.Write(ctx, 50, 5)
	f.WaitCount(ctx, f.Stream, 50, 30*time.Second)

	var before replication.LSN
	if err := f.DB.Pool.QueryRow(ctx, "SELECT pg_current_wal_lsn()").Scan(&before); err != nil {
		t.Fatal(err)
	}
	exec(`ALTER PUBLICATION ` + pub + ` DROP TABLE outbox`)
	all = append(all, w.Write(ctx, 50, 5)...)
	if !quick {
		if !testenv.WaitFor(10*time.Second, func() bool { return !ready.Load() }) {
			t.Fatal("still ready with the outbox missing from the publication")
		}
		// Keepalives come every third of the receive timeout: give the
		// idle session time to confirm what it should not.
		deadline := time.Now().Add(2 * time.Second)
		for time.Now().Before(deadline) {
			if got := f.slot(ctx).ConfirmedFlushLSN; got > before {
				t.Fatalf("slot confirmed %s, past %s, before which the table left the publication", got, before)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	exec(`ALTER PUBLICATION ` + pub + ` ADD TABLE outbox`)
	all = append(all, w.Write(ctx, 50, 5)...)
	f.WaitCount(ctx, f.Stream, uint64(len(all)), 60*time.Second)
	if !testenv.WaitFor(10*time.Second, ready.Load) {
		t.Fatal("not ready after the publication was fixed and the gap filled")
	}
	if rep := relaytest.Check(all, f.Read(ctx, f.Stream)); !rep.OK() || rep.Duplicates > 0 {
		t.Fatalf("stream check: %s", rep)
	}
}
