package failover

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// TestFailoverWithoutFailoverSlot is a failover that the slot does not
// survive: PostgreSQL 15 (no failover slots), or 17 with
// postgres.failover_slot off. Before it, CheckFailover says a failover
// would lose the slot. After the promotion the relay stops with ErrSlotMissing,
// whose message names the recovery; the test follows that recovery with the
// binary, as docs/operations.md gives it (setup, reconcile --repair
// --include-pending from the last event in the stream, then the relay),
// and ends with nothing missing, no duplicate and order per aggregate. A
// relay restarted before that recovery (auto_setup on) stops with the same
// error instead of creating a slot after the gap.
// Phantom events (relayed from the old primary, lost with it) are counted:
// without synchronized_standby_slots (17 only) nothing prevents them.
func TestFailoverWithoutFailoverSlot(t *testing.T) {
	t.Parallel()
	c := newCluster(t, clusterOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	_, err := replication.Setup(ctx, c.cfg.Replication)
	testenv.Must(t, err, "setup")
	risk, err := replication.CheckFailover(ctx, c.multiHostURL(), c.cfg.Replication.Slot)
	testenv.Must(t, err, "check failover")
	want := "has failover = false"
	if c.primary.Major() < 17 {
		want = "has no failover slots"
	}
	if !risk.AtRisk() || !strings.Contains(strings.Join(risk.Problems, "\n"), want) {
		t.Fatalf("before the failover, CheckFailover says %+v; want a problem with %q", risk, want)
	}
	r := c.startRelay()
	const total, killAt = 6000, 3000
	st, wait := c.write(ctx, c.pool(ctx, c.multiHostURL()), writeLoad{total: total, aggregates: 100, writers: 4, bigTx: 50})
	if !testenv.WaitFor(time.Minute, func() bool { return st.acked.Load() >= killAt }) {
		t.Fatalf("writers acknowledged only %d events in a minute", st.acked.Load())
	}
	// The relay has streamed before the failover (on a loaded machine it
	// may still be starting): that is what makes a new slot a gap.
	if !testenv.WaitFor(time.Minute, func() bool { return relaytest.StreamCount(ctx, c.js, c.stream) > 0 }) {
		t.Fatal("the relay stored no event within a minute")
	}
	testenv.Must(t, c.primary.Stop("immediate"), "kill the primary")
	testenv.Must(t, c.standby.Promote(), "promote the standby")
	promoted := time.Now()
	var relayErr error
	select {
	case relayErr = <-r.done:
		r.done <- relayErr // stop() reads it again
	case <-time.After(30 * time.Second):
		t.Fatal("the relay did not stop within 30 s of the promotion")
	}
	stopped := time.Since(promoted)
	if !errors.Is(relayErr, replication.ErrSlotMissing) {
		t.Fatalf("relay stopped with %v, want ErrSlotMissing", relayErr)
	}
	for _, s := range []string{"promoted from a standby", "outbox-relay setup", "outbox-relay reconcile", "--repair", "--include-pending"} {
		if !strings.Contains(relayErr.Error(), s) {
			t.Errorf("the relay's error does not name %q: %v", s, relayErr)
		}
	}
	wait()
	relayed := relaytest.ReadStream(ctx, t, c.js, c.stream)

	// A relay restarted by its supervisor must not paper over the gap with
	// auto_setup: it stops with the same recovery and creates no slot.
	cfg := c.writeConfig(nil)
	out, code := c.run(time.Minute, nil, "run", "--config", cfg)
	if code == 0 || !strings.Contains(out, "promoted from a standby") || !strings.Contains(out, "reconcile") {
		t.Fatalf("outbox-relay run after the failover exited %d, want the failover recovery:\n%s", code, out)
	}
	if s, err := replication.Status(ctx, c.standbyURL(), c.cfg.Replication.Slot); err != nil || s.Exists {
		t.Fatalf("auto_setup created slot %q on the promoted server (%v)", c.cfg.Replication.Slot, err)
	}

	// The recovery, as docs/operations.md gives it.
	since := time.Now().Add(-time.Hour)
	if len(relayed) > 0 {
		since = relayed[len(relayed)-1].Event.CommitTime.Add(-time.Minute)
	}
	recovery := time.Now()
	// Without backfill: setup would otherwise republish every PENDING row
	// of the table, not only the window.
	if out, code := c.run(time.Minute, []string{"OUTBOX_RELAY_POSTGRES_BACKFILL=false"}, "setup", "--config", cfg); code != 0 {
		t.Fatalf("setup on the new primary exited %d:\n%s", code, out)
	}
	out, code = c.run(2*time.Minute, nil, "reconcile", "--since", since.UTC().Format(time.RFC3339Nano), "--repair", "--include-pending", "--confirm-wait", "0", "--config", cfg)
	if code > 1 {
		t.Fatalf("reconcile --repair exited %d:\n%s", code, out)
	}
	t.Logf("reconcile --repair:\n%s", out)
	r = c.startRelay()
	rows := c.rows(ctx, c.standbyURL())
	inStream := func() int {
		ids := map[string]bool{}
		for _, m := range relaytest.ReadStream(ctx, t, c.js, c.stream) {
			ids[m.Event.ID] = true
		}
		n := 0
		for _, e := range rows {
			if ids[e.ID] {
				n++
			}
		}
		return n
	}
	if !testenv.WaitFor(time.Minute, func() bool { return inStream() == len(rows) }) {
		t.Fatalf("after the recovery the stream holds %d of the new primary's %d rows", inStream(), len(rows))
	}
	recovered := time.Since(recovery)
	out, code = c.run(2*time.Minute, nil, "reconcile", "--since", since.UTC().Format(time.RFC3339Nano), "--config", cfg)
	if code != 0 {
		t.Errorf("reconcile after the recovery exited %d:\n%s", code, out)
	}
	testenv.Must(t, r.stop(), "relay")
	got := relaytest.ReadStream(ctx, t, c.js, c.stream)
	rep := relaytest.Check(rows, got)
	if rep.Missing != 0 || rep.Duplicates != 0 || rep.OutOfOrder != 0 || rep.BadContent != 0 {
		t.Errorf("after the recovery: %s", rep)
	}
	t.Logf("PostgreSQL %d failover without a failover slot: %d events in the new primary (%d acknowledged by writers, %d transactions failed), %d relayed before the failover; "+
		"relay stopped %.1f s after the promotion; recovery (setup, reconcile --repair, relay) %.1f s; stream %d: missing %d, duplicates %d, out of order %d, phantom %d",
		c.primary.Major(), len(rows), st.acked.Load(), st.failed.Load(), len(relayed), stopped.Seconds(), recovered.Seconds(),
		rep.Received, rep.Missing, rep.Duplicates, rep.OutOfOrder, rep.Unexpected)
}
