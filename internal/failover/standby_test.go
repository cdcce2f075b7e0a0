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
	"github.com/outbox-relay/outbox-relay/watermark"
)

// setupOnStandby runs Setup against the standby while the primary logs
// running-transactions records: creating a slot on a standby waits for one.
func (c *cluster) setupOnStandby(ctx context.Context) (*replication.SetupReport, error) {
	type result struct {
		rep *replication.SetupReport
		err error
	}
	done := make(chan result, 1)
	go func() {
		rep, err := replication.Setup(ctx, c.cfg.Replication)
		done <- result{rep, err}
	}()
	for {
		select {
		case r := <-done:
			return r.rep, r.err
		case <-time.After(200 * time.Millisecond):
			_ = c.primary.Exec(ctx, "SELECT pg_log_standby_snapshot()")
		}
	}
}

// TestDecodeOnStandby points the relay at a hot standby (PostgreSQL 16+):
// it creates its slot there, streams and confirms what the primary writes,
// survives the standby's restart mid-load, and keeps streaming when that
// standby is promoted (its own slot stays). The bad inputs around it: a
// publication missing on the standby, hot_standby_feedback off, and a URL
// whose only host is a standby while target_session_attrs asks for a
// primary. On PostgreSQL 15 the relay refuses a standby, naming 16.
func TestDecodeOnStandby(t *testing.T) {
	t.Parallel()
	c := newCluster(t, clusterOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c.cfg.Replication.URL = c.standbyURL()
	if c.primary.Major() < 16 {
		_, err := replication.Setup(ctx, c.cfg.Replication)
		if !errors.Is(err, replication.ErrStandbyDecoding) || !strings.Contains(err.Error(), "PostgreSQL 16") {
			t.Fatalf("setup on a PostgreSQL %d standby: %v, want ErrStandbyDecoding naming PostgreSQL 16", c.primary.Major(), err)
		}
		t.Logf("PostgreSQL %d standby: %v", c.primary.Major(), err)
		return
	}
	// The publication comes from the primary.
	_, err := c.setupOnStandby(ctx)
	if !errors.Is(err, replication.ErrPublicationMissing) || !strings.Contains(err.Error(), "against the primary") {
		t.Fatalf("setup on a standby without the publication: %v, want ErrPublicationMissing naming the primary", err)
	}
	pubOnly := c.cfg.Replication
	pubOnly.URL, pubOnly.Slot = c.primary.URL(c.db), "unused_"+c.prefix
	_, err = replication.Setup(ctx, pubOnly)
	testenv.Must(t, err, "setup on the primary")
	_, err = replication.DropSlot(ctx, pubOnly)
	testenv.Must(t, err, "drop the primary's slot")
	var lsn string
	testenv.Must(t, queryRow(ctx, c.primary.URL(c.db), "SELECT pg_current_wal_lsn()::text", nil, &lsn), "primary LSN")
	testenv.Must(t, c.standby.WaitReplayed(ctx, lsn), "standby replays the publication")

	// hot_standby_feedback off: the error names it.
	testenv.Must(t, c.standby.Exec(ctx, "ALTER SYSTEM SET hot_standby_feedback = off"), "feedback off")
	testenv.Must(t, c.standby.Exec(ctx, "SELECT pg_reload_conf()"), "reload")
	if !testenv.WaitFor(10*time.Second, func() bool {
		err = replication.Check(ctx, c.cfg.Replication)
		return errors.Is(err, replication.ErrStandbyDecoding)
	}) || !strings.Contains(err.Error(), "hot_standby_feedback = on") {
		t.Fatalf("check on a standby without hot_standby_feedback: %v", err)
	}
	testenv.Must(t, c.standby.Exec(ctx, "ALTER SYSTEM RESET hot_standby_feedback"), "feedback on")
	testenv.Must(t, c.standby.Exec(ctx, "SELECT pg_reload_conf()"), "reload")
	if !testenv.WaitFor(10*time.Second, func() bool {
		var on string
		return queryRow(ctx, c.standbyURL(), "SHOW hot_standby_feedback", nil, &on) == nil && on == "on"
	}) {
		t.Fatal("hot_standby_feedback did not come back on")
	}

	// Only standbys, but a primary asked for.
	needPrimary := c.cfg.Replication
	needPrimary.URL = c.standbyURL() + "&target_session_attrs=read-write"
	_, err = replication.Open(ctx, needPrimary, watermark.NewTracker(0))
	if !errors.Is(err, replication.ErrNoPrimary) || !strings.Contains(err.Error(), "target_session_attrs") || !replication.IsConnectFailure(err) {
		t.Fatalf("open on a standby-only URL with target_session_attrs=read-write: %v, want ErrNoPrimary naming target_session_attrs", err)
	}

	rep, err := c.setupOnStandby(ctx)
	testenv.Must(t, err, "setup on the standby")
	t.Logf("setup on the standby: %v", rep.Actions)
	r := c.startRelay()
	if !testenv.WaitFor(30*time.Second, func() bool { _, ok := r.readyAfter(time.Time{}); return ok }) {
		t.Fatal("the relay did not stream from the standby")
	}
	const total = 4000
	st, wait := c.write(ctx, c.pool(ctx, c.primary.URL(c.db)), writeLoad{total: total, aggregates: 100, writers: 2, bigTx: 50})
	if !testenv.WaitFor(time.Minute, func() bool { return st.acked.Load() >= total/2 }) {
		t.Fatalf("writers acknowledged only %d events in a minute", st.acked.Load())
	}
	restarted := time.Now()
	testenv.Must(t, c.standby.Stop("fast"), "stop the standby")
	testenv.Must(t, c.standby.Start(), "start the standby")
	var resumed time.Time
	if !testenv.WaitFor(30*time.Second, func() bool {
		var ok bool
		resumed, ok = r.readyAfter(restarted)
		return ok
	}) {
		t.Fatal("the relay did not resume after the standby's restart")
	}
	wait()
	rows := c.rows(ctx, c.primary.URL(c.db))
	c.waitStream(ctx, len(rows), time.Minute)
	// The standby's slot confirms the primary's position.
	testenv.Must(t, queryRow(ctx, c.primary.URL(c.db), "SELECT pg_current_wal_lsn()::text", nil, &lsn), "primary LSN")
	end, _ := replication.ParseLSN(lsn)
	var confirmed replication.LSN
	if !testenv.WaitFor(30*time.Second, func() bool {
		var s string
		if queryRow(ctx, c.standbyURL(), "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1", []any{c.cfg.Replication.Slot}, &s) != nil {
			return false
		}
		confirmed, _ = replication.ParseLSN(s)
		return confirmed >= end
	}) {
		t.Errorf("the standby's slot confirmed %s, not the primary's %s", confirmed, end)
	}

	// Promoting this standby keeps its own slot: the relay goes on.
	testenv.Must(t, c.primary.Stop("fast"), "stop the primary")
	testenv.Must(t, c.standby.Promote(), "promote")
	promoted := time.Now()
	more, waitMore := c.write(ctx, c.pool(ctx, c.standbyURL()), writeLoad{total: 200, aggregates: 10, writers: 1, bigTx: 20})
	waitMore()
	rows = c.rows(ctx, c.standbyURL())
	c.waitStream(ctx, len(rows), time.Minute)
	testenv.Must(t, r.stop(), "relay")
	got := relaytest.ReadStream(ctx, t, c.js, c.stream)
	res := check(t, rows, got)
	t.Logf("PostgreSQL %d decoding on a standby: %d events (%d after its promotion), stream %d: missing %d, duplicates %d, out of order %d; "+
		"resumed %.1f s after the standby's restart; slot on the standby confirmed %s; streaming continued across the promotion (%.1f s of writes after it)",
		c.primary.Major(), len(rows), more.acked.Load(), res.Received, res.Missing, res.Duplicates, res.OutOfOrder,
		resumed.Sub(restarted).Seconds(), confirmed, time.Since(promoted).Seconds())
}
