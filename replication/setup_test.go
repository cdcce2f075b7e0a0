package replication_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/watermark"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

func outboxDB(t *testing.T, pg *testenv.Postgres) (*testenv.Database, replication.Config) {
	t.Helper()
	db := testenv.NewDatabaseOn(t, pg)
	db.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "outbox.sql"))
	name := testenv.UniqueName("r")
	return db, replication.Config{URL: db.URL, Slot: name, Publication: name, Tables: []string{"public.outbox"}}
}

// openedStream is outboxDB with its slot and publication set up and a
// stream open on them, which the caller closes.
func openedStream(ctx context.Context, t *testing.T) (*testenv.Database, replication.Config, *replication.Stream) {
	t.Helper()
	db, cfg := outboxDB(t, testenv.Get(t).PG)
	return db, cfg, setUpAndOpen(ctx, t, cfg, watermark.NewTracker(0))
}

// setUpAndOpen sets up cfg's slot and publication and opens a stream on
// them with the watermark tr, which the caller closes.
func setUpAndOpen(ctx context.Context, t *testing.T, cfg replication.Config, tr *watermark.Tracker) *replication.Stream {
	t.Helper()
	if _, err := replication.Setup(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	st, err := replication.Open(ctx, cfg, tr)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func TestSetupIsIdempotent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, cfg := outboxDB(t, testenv.Get(t).PG)
	rep, err := replication.Setup(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(rep.Actions, "\n"); !strings.Contains(got, "created publication") || !strings.Contains(got, "created logical replication slot") {
		t.Fatalf("first setup: %v", rep.Actions)
	}
	rep, err = replication.Setup(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(rep.Actions, "\n"); !strings.Contains(got, "already exists") || strings.Contains(got, "created") {
		t.Fatalf("second setup: %v", rep.Actions)
	}
	if err := replication.Check(ctx, cfg); err != nil {
		t.Fatalf("Check after setup: %v", err)
	}
}

func TestSetupErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := testenv.Get(t)
	db, cfg := outboxDB(t, env.PG)

	t.Run("missing table", func(t *testing.T) {
		c := cfg
		c.Tables = []string{"public.nope"}
		_, err := replication.Setup(ctx, c)
		if !errors.Is(err, replication.ErrTableMissing) || !strings.Contains(err.Error(), "public.nope") {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("role without REPLICATION", func(t *testing.T) {
		role := testenv.UniqueName("norepl")
		if _, err := db.Pool.Exec(ctx, "CREATE ROLE "+role+" LOGIN"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = db.Pool.Exec(context.Background(), "DROP ROLE IF EXISTS "+role) })
		u := strings.Replace(db.URL, "postgres@", role+"@", 1)
		c := cfg
		c.URL = u
		_, err := replication.Setup(ctx, c)
		if !errors.Is(err, replication.ErrNoReplicationRole) || !strings.Contains(err.Error(), "ALTER ROLE") {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("failover slot on PostgreSQL < 17", func(t *testing.T) {
		var version int
		if err := db.Pool.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
			t.Fatal(err)
		}
		if version >= 170000 {
			t.Skip("server supports failover slots")
		}
		c := cfg
		c.FailoverSlot = true
		_, err := replication.Setup(ctx, c)
		if !errors.Is(err, replication.ErrFailoverUnsupported) || !strings.Contains(err.Error(), "PostgreSQL 17") {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("slot in use", func(t *testing.T) {
		if _, err := replication.Setup(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		st, err := replication.Open(ctx, cfg, watermark.NewTracker(0))
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close(ctx)
		_, err = replication.Open(ctx, cfg, watermark.NewTracker(0))
		if !errors.Is(err, replication.ErrSlotInUse) {
			t.Fatalf("second Open: %v, want ErrSlotInUse", err)
		}
	})
}

// teardown right after a relay stopped: the relay closed its replication
// connection, but its walsender exits in its own time and holds the slot
// until then (on a loaded machine CI saw teardown refused, "slot is
// streaming to pid N", after a clean stop). DropSlot waits for the release,
// within SlotReleaseGrace, and still refuses a slot a relay streams from.
func TestDropSlotWaitsForARelease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, cfg, st := openedStream(ctx, t)
	start := time.Now()
	_, err := replication.DropSlot(ctx, cfg)
	if !errors.Is(err, replication.ErrSlotInUse) || !strings.Contains(err.Error(), "stop the relay") {
		t.Fatalf("DropSlot while streaming: %v, want ErrSlotInUse", err)
	}
	if waited := time.Since(start); waited < replication.SlotReleaseGrace {
		t.Fatalf("refused after %s, want the grace of %s first", waited, replication.SlotReleaseGrace)
	}
	// Released while DropSlot looks: the slot is dropped.
	released := make(chan error, 1)
	go func() {
		time.Sleep(time.Second) // DropSlot's first look sees the slot active
		released <- st.Close(ctx)
	}()
	dropped, err := replication.DropSlot(ctx, cfg)
	if err != nil || !dropped {
		t.Fatalf("DropSlot as the slot is released: dropped %v, %v", dropped, err)
	}
	if err := <-released; err != nil {
		t.Logf("close: %v", err)
	}
	if s, err := replication.Status(ctx, cfg.URL, cfg.Slot); err != nil || s.Exists {
		t.Fatalf("slot after DropSlot: %+v, %v", s, err)
	}
}

func TestWalLevelNotLogical(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("starts a private cluster")
	}
	pg, err := testenv.StartPostgres(testenv.WithSetting("wal_level", "replica"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	_, cfg := outboxDB(t, pg)
	_, err = replication.Setup(context.Background(), cfg)
	if !errors.Is(err, replication.ErrWalLevel) || !strings.Contains(err.Error(), "wal_level = logical") {
		t.Fatalf("err = %v", err)
	}
}

// A slot whose WAL was removed (max_slot_wal_keep_size exceeded while the
// relay was away) must stop the relay with an error that says events were
// lost and how to recover.
func TestSlotLost(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("starts a private cluster")
	}
	pg, err := testenv.StartPostgres(testenv.WithSetting("max_slot_wal_keep_size", "1MB"), testenv.WithSetting("max_wal_size", "32MB"), testenv.WithSetting("min_wal_size", "32MB"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	db, cfg := outboxDB(t, pg)
	ctx := context.Background()
	if _, err := replication.Setup(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE filler (v text)"); err != nil {
		t.Fatal(err)
	}
	lost := testenv.WaitFor(60*time.Second, func() bool {
		_, _ = db.Pool.Exec(ctx, "INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 5000)")
		_, _ = db.Pool.Exec(ctx, "SELECT pg_switch_wal()")
		_, _ = db.Pool.Exec(ctx, "CHECKPOINT")
		var status *string
		_ = db.Pool.QueryRow(ctx, "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1", cfg.Slot).Scan(&status)
		return status != nil && *status == "lost"
	})
	if !lost {
		t.Fatal("slot never became lost")
	}
	_, err = replication.Open(ctx, cfg, watermark.NewTracker(0))
	if !errors.Is(err, replication.ErrSlotLost) || !replication.IsPermanent(err) {
		t.Fatalf("Open = %v, want ErrSlotLost", err)
	}
	for _, want := range []string{"events were lost", "teardown", "setup", "max_slot_wal_keep_size"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	if _, err := replication.Setup(ctx, cfg); !errors.Is(err, replication.ErrSlotLost) {
		t.Fatalf("Setup on a lost slot = %v", err)
	}
}
