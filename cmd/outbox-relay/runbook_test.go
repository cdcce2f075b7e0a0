package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The runbooks of docs/operations.md, run as written with the real command
// line against the test harness (issue 17). Each command and its output is
// logged (go test -v shows them), so the runbooks' output can be read
// next to the text.

// runbookLayouts are the event stream's layouts every runbook runs in
// (issue 26): events stored as published, and partitioned for consumer
// groups (nats.partitions, set before the stream exists).
var runbookLayouts = []struct {
	name  string
	apply func(*opsFixture)
}{
	{"plain", func(*opsFixture) {}},
	{"partitioned", func(f *opsFixture) { f.setYAML("  ack_timeout: 1s\n", "  ack_timeout: 1s\n  partitions: 8\n") }},
}

// inLayouts runs a runbook test once per layout, on a fixture of its own.
func inLayouts(t *testing.T, run func(t *testing.T, f *opsFixture)) {
	t.Parallel()
	for _, l := range runbookLayouts {
		t.Run(l.name, func(t *testing.T) {
			t.Parallel()
			f := newOpsFixture(t)
			l.apply(f)
			run(t, f)
			s, err := f.js.Stream(context.Background(), f.stream)
			if err != nil {
				t.Fatal(err)
			}
			if got := s.CachedInfo().Config.SubjectTransform != nil; got != (l.name == "partitioned") {
				t.Fatalf("stream %s has a subject transform: %v, in layout %s", f.stream, got, l.name)
			}
		})
	}
}

// step runs one command of a runbook and logs it with its output.
func (f *opsFixture) step(args ...string) (string, error) {
	f.t.Helper()
	out, err := f.cli(args...)
	f.t.Logf("$ outbox-relay -c relay.yaml %s\n%s(exit: %v)", strings.Join(args, " "), out, err)
	return out, err
}

// setYAML replaces old by new in the fixture's configuration file and
// reloads it.
func (f *opsFixture) setYAML(old, new string) {
	f.t.Helper()
	b, err := os.ReadFile(f.file)
	if err != nil {
		f.t.Fatal(err)
	}
	if !strings.Contains(string(b), old) {
		f.t.Fatalf("configuration lacks %q", old)
	}
	if err := os.WriteFile(f.file, []byte(strings.Replace(string(b), old, new, 1)), 0o600); err != nil {
		f.t.Fatal(err)
	}
	if f.cfg, err = config.Load(config.Sources{File: f.file}); err != nil {
		f.t.Fatal(err)
	}
}

// streamOnce checks that the event stream holds n events, each once.
func (f *opsFixture) streamOnce(n int) {
	f.t.Helper()
	ids := map[string]int{}
	for _, m := range relaytest.ReadStream(context.Background(), f.t, f.js, f.stream) {
		ids[m.Event.ID]++
	}
	for id, c := range ids {
		if c != 1 {
			f.t.Errorf("event %s stored %d times", id, c)
		}
	}
	if len(ids) != n {
		f.t.Errorf("stream holds %d distinct events, want %d", len(ids), n)
	}
}

// dropSlotByHand drops the slot as an operator's mistake would, once the
// stopped relay's walsender has released it.
func (f *opsFixture) dropSlotByHand() {
	f.t.Helper()
	var err error
	if !testenv.WaitFor(20*time.Second, func() bool {
		_, err = f.db.Pool.Exec(context.Background(), "SELECT pg_drop_replication_slot($1)", f.cfg.Postgres.Slot)
		return err == nil
	}) {
		f.t.Fatalf("drop slot: %v", err)
	}
}

// relayThenLoseSlot relays n events, stops the relay and drops its slot
// by hand.
func relayThenLoseSlot(t *testing.T, f *opsFixture, n int) *opsFixture {
	t.Helper()
	ctx := context.Background()
	f.setYAML("  interval: 10s\n", "  interval: 0s\n")
	stop := f.start()
	f.insert(ctx, n, "RegistrationConfirmed")
	if !testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.js, f.stream) == uint64(n) }) {
		t.Fatal("events not relayed")
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	f.dropSlotByHand()
	return f
}

// "Recovering after a lost slot" (a slot dropped by mistake), steps 2-5.
func TestRunbookLostSlot(t *testing.T) {
	inLayouts(t, func(t *testing.T, f *opsFixture) {
		ctx := context.Background()
		// Step 1-2: the relay is stopped; the slot was dropped by mistake and
		// writers went on: these 10 rows were never decoded.
		relayThenLoseSlot(t, f, 20)
		f.insert(ctx, 10, "RegistrationConfirmed")
		if _, err := f.step("teardown", "--yes"); err != nil {
			t.Fatal(err)
		}
		out, err := f.step("setup")
		if err != nil || !strings.Contains(out, "backfilled 10 waiting rows") || !strings.Contains(out, "20 skipped: already in stream") {
			t.Fatalf("setup: %v", err)
		}
		// Writers go on while the relay is still stopped.
		f.insert(ctx, 5, "RegistrationConfirmed")
		// Step 3.
		if out, err = f.step("reconcile", "--since", "10m", "--repair", "--include-pending", "--confirm-wait", "0"); err != nil || !strings.Contains(out, "5 republished") {
			t.Fatalf("step 3: %v", err)
		}
		// Step 4: within the duplicate window (2m).
		f.start()
		// Step 5.
		if !testenv.WaitFor(30*time.Second, func() bool {
			out, err = f.cli("reconcile", "--since", "10m")
			return err == nil
		}) {
			t.Fatalf("step 5 keeps reporting differences:\n%s", out)
		}
		f.step("reconcile", "--since", "10m")
		f.streamOnce(35)
	})
}

// "Recovering after a primary failover": the lost-slot runbook from step 2
// with no slot to drop (the new primary has none).
func TestRunbookFailover(t *testing.T) {
	inLayouts(t, func(t *testing.T, f *opsFixture) {
		ctx := context.Background()
		// The promoted standby has no slot; rows written on it before one exists.
		relayThenLoseSlot(t, f, 10)
		f.insert(ctx, 4, "RegistrationConfirmed")
		if out, err := f.step("setup"); err != nil || !strings.Contains(out, "backfilled 4 waiting rows") {
			t.Fatalf("setup: %v", err)
		}
		if _, err := f.step("reconcile", "--since", "10m", "--repair", "--include-pending", "--confirm-wait", "0"); err != nil {
			t.Fatal(err)
		}
		f.start()
		if _, err := f.step("reconcile", "--since", "10m"); err != nil {
			t.Fatal(err)
		}
		f.streamOnce(14)
	})
}

// "Events deleted from the stream or lost by the broker", and the
// reconciliation section's commands.
func TestRunbookEventsDeletedFromTheStream(t *testing.T) {
	inLayouts(t, func(t *testing.T, f *opsFixture) {
		ctx := context.Background()
		// A short duplicate window, so the repair need not wait 2 minutes.
		f.setYAML("  ack_timeout: 1s\n", "  ack_timeout: 1s\n  duplicate_window: 1s\n")
		f.setYAML("  interval: 10s\n", "  interval: 0s\n")
		f.start()
		f.insert(ctx, 20, "RegistrationConfirmed")
		if !testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.js, f.stream) == 20 }) {
			t.Fatal("events not relayed")
		}
		s, err := f.js.Stream(ctx, f.stream)
		if err != nil {
			t.Fatal(err)
		}
		// The first message too (issue 26: a first sequence above 1 was
		// blamed on the stream's limits, and the rows reported expired).
		for _, seq := range []uint64{1, 3, 4, 5} {
			if err := s.DeleteMsg(ctx, seq); err != nil {
				t.Fatal(err)
			}
		}
		if out, err := f.step("reconcile", "--since", "24h"); err == nil || !strings.Contains(out, "Missing: 4") {
			t.Fatalf("reconcile: %v", err)
		}
		time.Sleep(1100 * time.Millisecond) // past nats.duplicate_window
		if out, err := f.step("reconcile", "--since", "1h", "--repair"); err != nil || !strings.Contains(out, "4 republished") {
			t.Fatalf("repair: %v", err)
		}
		if _, err := f.step("reconcile", "--since", "24h", "--json"); err != nil {
			t.Fatal(err)
		}
		f.streamOnce(20)
	})
}

// "Retention": the time-partitioned table and publication as written,
// then cleanup as written.
func TestRunbookRetention(t *testing.T) {
	inLayouts(t, func(t *testing.T, f *opsFixture) {
		ctx := context.Background()
		f.setYAML("  interval: 10s\n", "  interval: 0s\n")
		today := time.Now().UTC().Truncate(24 * time.Hour)
		day := func(d time.Time) string { return d.Format("2006-01-02") }
		part := func(d time.Time) string {
			return fmt.Sprintf("CREATE TABLE outbox_%s PARTITION OF outbox FOR VALUES FROM ('%s') TO ('%s');",
				strings.ReplaceAll(day(d), "-", "_"), day(d), day(d.Add(24*time.Hour)))
		}
		ddl := `DROP TABLE outbox;
	CREATE TABLE outbox (event_id uuid NOT NULL, aggregate_type text NOT NULL DEFAULT '', aggregate_id text NOT NULL,
	    aggregate_version bigint NOT NULL, event_type text, payload jsonb NOT NULL, occurred_at timestamptz NOT NULL DEFAULT now(),
	    publish_state text NOT NULL DEFAULT 'PENDING',
	    UNIQUE (event_id, occurred_at), UNIQUE (aggregate_id, aggregate_version, occurred_at))
	    PARTITION BY RANGE (occurred_at);
	` + part(today.Add(-8*24*time.Hour)) + part(today) + part(today.Add(24*time.Hour)) + `
	CREATE PUBLICATION ` + f.cfg.Postgres.Publication + ` FOR TABLE outbox WITH (publish = 'insert', publish_via_partition_root = true);`
		t.Logf("psql:\n%s", ddl)
		if _, err := f.db.Pool.Exec(ctx, ddl); err != nil {
			t.Fatal(err)
		}
		if _, err := f.step("setup"); err != nil {
			t.Fatal(err)
		}
		f.start()
		// Rows of eight days ago and of now, in two partitions.
		for i := 1; i <= 10; i++ {
			age := "0"
			if i <= 5 {
				age = "8 days"
			}
			if _, err := f.db.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, occurred_at)
	VALUES (gen_random_uuid(), 'registration', 'r', $1, 'E', '{}', now() - $2::interval)`, i, age); err != nil {
				t.Fatal(err)
			}
		}
		if !testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.js, f.stream) == 10 }) {
			t.Fatalf("stream holds %d of 10 events", relaytest.StreamCount(ctx, f.js, f.stream))
		}
		if _, err := f.step("reconcile", "--since", "216h", "--until", "168h"); err != nil {
			t.Fatal(err)
		}
		if out, err := f.step("cleanup", "--older-than", "168h", "--dry-run"); err != nil || !strings.Contains(out, "Dry run") {
			t.Fatalf("cleanup --dry-run: %v", err)
		}
		// Stored seconds ago: kept until the stored margin has passed.
		out, err := f.step("cleanup", "--older-than", "168h", "--batch-size", "1000", "--pause", "10ms")
		if code, ok := err.(exitCode); !ok || code != 1 || !strings.Contains(out, "5 of them have an event stored after") {
			t.Fatalf("cleanup: %v", err)
		}
		var n int
		if err := f.db.Pool.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&n); err != nil || n != 10 {
			t.Fatalf("outbox holds %d rows, want 10: %v", n, err)
		}
	})
}

// "Recovering after a lost slot" on a stream its max_age emptied (issue
// 26): the backfill's skip rule set the cutoff at the last stored event
// plus the clock-skew margin (1m), so rows written in the minute after it,
// never relayed, were skipped as "older than the stream's first message".
// Only the rows dated before the newest event the limits removed are
// skipped now; the rest are backfilled.
func TestRunbookLostSlotOnAStreamEmptiedByMaxAge(t *testing.T) {
	inLayouts(t, func(t *testing.T, f *opsFixture) {
		ctx := context.Background()
		relayThenLoseSlot(t, f, 2)
		s, err := f.js.Stream(ctx, f.stream)
		if err != nil {
			t.Fatal(err)
		}
		cfg := s.CachedInfo().Config
		cfg.MaxAge, cfg.Duplicates = time.Second, time.Second
		if _, err := f.js.UpdateStream(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		if !testenv.WaitFor(30*time.Second, func() bool {
			info, err := s.Info(ctx)
			return err == nil && info.State.Msgs == 0
		}) {
			t.Fatal("the stream's max_age did not empty it")
		}
		// Never relayed: written after the stream's last event.
		f.insert(ctx, 3, "RegistrationConfirmed")
		if _, err := f.step("teardown", "--yes"); err != nil {
			t.Fatal(err)
		}
		out, err := f.step("setup")
		if err != nil || !strings.Contains(out, "backfilled 3 waiting rows") || !strings.Contains(out, "2 skipped: older than the stream's first message") {
			t.Fatalf("setup: %v", err)
		}
	})
}
