package failover

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// needMajor skips the test unless private clusters run at least version.
func needMajor(t *testing.T, version int, why string) int {
	t.Helper()
	major, err := testenv.PGMajor()
	if err != nil {
		t.Fatal(err)
	}
	if major < version {
		t.Skipf("%s needs PostgreSQL %d; this run uses %d (OUTBOX_TEST_PG_VERSION=17, or make test-pg17)", why, version, major)
	}
	return major
}

// waitFailoverReady waits until CheckFailover, run as the relay's monitor
// runs it, finds the standby's copy of the slot failover-ready.
func (c *cluster) waitFailoverReady(ctx context.Context, timeout time.Duration) replication.FailoverReport {
	c.t.Helper()
	var rep replication.FailoverReport
	var err error
	poked := time.Time{}
	if !testenv.WaitFor(timeout, func() bool {
		rep, err = replication.CheckFailover(ctx, c.multiHostURL(), c.cfg.Replication.Slot)
		if err == nil && !rep.AtRisk() && len(rep.Checked) == 1 && rep.Checked[0].Ready {
			return true
		}
		// The standby persists its copy only once the primary's slot has
		// moved past the standby's own horizon: a running-transactions
		// record, decoded by the streaming relay, moves it.
		if time.Since(poked) > 500*time.Millisecond {
			poked = time.Now()
			_ = c.primary.Exec(ctx, "SELECT pg_log_standby_snapshot()")
		}
		return false
	}) {
		c.t.Fatalf("the standby's copy of the slot never became failover-ready: %+v, %v\n%s", rep, err, c.standby.Log())
	}
	return rep
}

// TestFailoverSlotSurvivesPromotion is the PostgreSQL 17 failover: a
// failover slot synchronised to the standby, synchronized_standby_slots on
// the primary, 20,000 events in transactions of 1 and 50 rows, the primary
// stopped with an immediate stop halfway, the standby promoted after a
// 3-second outage. The relay, on a multi-host URL, resumes from the
// synchronised slot: nothing missing, order per aggregate, no duplicate,
// the stream's ids exactly the new primary's rows (no phantom), and the
// slot never confirmed an event before it was stored.
func TestFailoverSlotSurvivesPromotion(t *testing.T) {
	needMajor(t, 17, "a failover slot")
	t.Parallel()
	c := newCluster(t, clusterOptions{failoverSlot: true})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	_, err := replication.Setup(ctx, c.cfg.Replication)
	testenv.Must(t, err, "setup")
	r := c.startRelay()
	ready := c.waitFailoverReady(ctx, time.Minute)
	if !ready.FailoverSlot || ready.SynchronizedStandbySlots != c.standby.PhysicalSlot {
		t.Fatalf("failover report %+v", ready)
	}
	samples := c.sampleSlot(c.standbyURL())
	const total, killAt = 20000, 10000
	st, wait := c.write(ctx, c.pool(ctx, c.multiHostURL()), writeLoad{total: total, aggregates: 200, writers: 4, bigTx: 50})
	if !testenv.WaitFor(time.Minute, func() bool { return st.acked.Load() >= killAt }) {
		t.Fatalf("writers acknowledged only %d events in a minute", st.acked.Load())
	}
	// The primary dies at once, with transactions in flight and WAL the
	// standby may not have received.
	killed := time.Now()
	testenv.Must(t, c.primary.Stop("immediate"), "kill the primary")
	ackedBefore := st.acked.Load()
	// A failover manager's detection time: long enough for a backoff to
	// grow, as it did before the relay capped it for connection failures.
	<-time.After(3 * time.Second)
	testenv.Must(t, c.standby.Promote(), "promote the standby")
	promoted := time.Now()
	var streaming time.Time
	if !testenv.WaitFor(30*time.Second, func() bool {
		var ok bool
		streaming, ok = r.readyAfter(promoted.Add(-time.Second))
		return ok
	}) {
		t.Fatal("the relay did not stream from the promoted standby within 30 s")
	}
	wait()
	rows := c.rows(ctx, c.standbyURL())
	c.waitStream(ctx, len(rows), 2*time.Minute)
	// Let the slot confirm the end, so the last samples cover everything.
	if !testenv.WaitFor(30*time.Second, func() bool {
		s, err := replication.Status(ctx, c.standbyURL(), c.cfg.Replication.Slot)
		return err == nil && s.LagBytes < 64<<10
	}) {
		t.Error("the slot on the new primary did not confirm the end of the load")
	}
	testenv.Must(t, r.stop(), "relay")
	got := relaytest.ReadStream(ctx, t, c.js, c.stream)
	rep := check(t, rows, got)
	bad, n := samples.violations(t, got)
	inTable := map[string]bool{}
	for _, e := range rows {
		inTable[e.ID] = true
	}
	lost := 0
	st.ids.Range(func(k, _ any) bool {
		if !inTable[k.(string)] {
			lost++
		}
		return true
	})
	afterPromotion := streaming.Sub(promoted)
	t.Logf("PostgreSQL 17 failover: %d events in the new primary (%d acknowledged by writers, %d before the kill; %d acknowledged by the old primary and lost with it; %d transactions failed), "+
		"stream %d: missing %d, duplicates %d, out of order %d, phantom %d; kill→streaming %.1f s, promotion→streaming %.1f s; slot samples %d, confirmed ahead of the stream %d",
		len(rows), st.acked.Load(), ackedBefore, lost, st.failed.Load(), rep.Received, rep.Missing, rep.Duplicates, rep.OutOfOrder, rep.Unexpected,
		streaming.Sub(killed).Seconds(), afterPromotion.Seconds(), n, bad)
	if int64(len(rows)) < st.acked.Load()-int64(lost) {
		t.Errorf("the new primary holds %d rows, fewer than the %d acknowledged less the %d lost", len(rows), st.acked.Load(), lost)
	}
	if afterPromotion > 5*time.Second {
		t.Errorf("streaming resumed %.1f s after the promotion, want ≤ 5 s", afterPromotion.Seconds())
	}
	// While no host takes the session, the relay retries at least every
	// second: a backoff grown during the outage would delay streaming
	// after the promotion by up to its size.
	waits := r.retryWaits(killed)
	for _, w := range waits {
		if w > time.Second {
			t.Errorf("reconnect waits during the outage %v: want each ≤ 1 s", waits)
			break
		}
	}
	if !strings.Contains(c.cfg.Replication.URL, "target_session_attrs=read-write") {
		t.Fatal("the relay's URL must follow the primary")
	}
}
