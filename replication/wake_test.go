package replication_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/watermark"
)

// A Wake whose time has long passed still waits for what the server has
// already sent: a backlog several times the connection's read buffer (8
// KB) is read to its end before it, as the relay's batch spans need to
// tell a backlog from a stream that caught up (Pending). A read past the
// connection's deadline fails at once, bytes waiting or not, so a stream
// that set that deadline would wake at its first read of the socket.
func TestWakeWaitsForPendingChanges(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db, _, st := openedStream(ctx, t)
	defer st.Close(ctx)
	// About 1 KB each, 24 KB in all: three read buffers, and well within
	// what the sockets hold (the walsender must not wait to write).
	const txs = 24
	sentBacklog(ctx, t, db, st, txs)
	wakeAfterBacklog(ctx, t, st, txs)
}

// A reader that keeps its wake time in the past while it reads a backlog,
// asking again at every commit as the relay's batch spans do, still sends
// its status updates on time: the wake only moves the read deadline once
// nothing is waiting (Pending), never past the next status update, so the
// confirmed position follows the settled commits while the backlog is
// read, and the server's slot reaches the last one. The Wake still comes
// once the backlog is read, and Pending on the closed stream is false.
func TestStatusUpdatesWhileWakeWaitsForABacklog(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db, cfg := outboxDB(t, testenv.Get(t).PG)
	cfg.StatusInterval = 20 * time.Millisecond
	tr := watermark.NewTracker(0)
	st := setUpAndOpen(ctx, t, cfg, tr)
	closed := false
	defer func() {
		if !closed {
			_ = st.Close(ctx)
		}
	}()
	// About 1 KB each: well within what the sockets hold, so that all of
	// it is waiting once sent.
	const txs = 48
	sentBacklog(ctx, t, db, st, txs)
	st.WakeAt(time.Now().Add(-time.Second))
	var (
		inserts, commits, advances int
		tx                         *watermark.Tx
		last                       replication.LSN
		confirmed                  = st.Confirmed()
	)
	for {
		ev, err := st.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if c := st.Confirmed(); c > confirmed {
			confirmed = c
			advances++
		}
		switch e := ev.(type) {
		case *replication.Begin:
			tx = tr.Begin(e.CommitTime)
		case *replication.Insert:
			inserts++
		case *replication.Commit:
			tx.Commit(e.EndLSN)
			commits, last = commits+1, e.EndLSN
			// A reader slower than the status interval: each
			// transaction's processing takes a few milliseconds.
			time.Sleep(4 * time.Millisecond)
			st.WakeAt(time.Now().Add(-time.Second))
		}
		if _, ok := ev.(*replication.Wake); ok {
			break
		}
	}
	if inserts != txs || commits != txs {
		t.Fatalf("Wake after %d inserts and %d commits of the %d waiting, want after all of them", inserts, commits, txs)
	}
	// ~200 ms of reading at one status update every 20 ms: a stalled
	// update would leave the confirmed position where it was.
	if advances < 3 {
		t.Errorf("the confirmed position advanced %d times while %d settled transactions were read, want it to follow them", advances, txs)
	}
	if err := st.SendStatus(ctx); err != nil {
		t.Fatal(err)
	}
	if !testenv.WaitFor(20*time.Second, func() bool {
		var ok bool
		err := db.Pool.QueryRow(ctx, "SELECT coalesce(confirmed_flush_lsn >= $1::pg_lsn, false) FROM pg_replication_slots WHERE slot_name = $2", last.String(), cfg.Slot).Scan(&ok)
		return err == nil && ok
	}) {
		t.Fatalf("the slot's confirmed position did not reach the last commit's end %s", last)
	}
	closed = true
	if err := st.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if st.Pending() {
		t.Error("Pending is true on a closed stream")
	}
}

// sentBacklog writes txs outbox transactions of about 1 KB each and waits
// until the walsender of st has sent them all.
func sentBacklog(ctx context.Context, t *testing.T, db *testenv.Database, st *replication.Stream, txs int) {
	t.Helper()
	for i := range txs {
		if _, err := db.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_id, aggregate_version, event_type, payload)
			VALUES (gen_random_uuid(), 'a', $1, 'T', jsonb_build_object('pad', repeat('x', 1000)))`, i+1); err != nil {
			t.Fatalf("insert %d: %v", i, err)
		}
	}
	// Once the walsender is past the last commit, everything before it
	// is written to the socket: it flushes each message as it decodes
	// it, before it moves past the record. The insert position, not
	// pg_current_wal_lsn: the test cluster commits asynchronously, and
	// what is written out may still end before the last commits.
	var end string
	if err := db.Pool.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&end); err != nil {
		t.Fatal(err)
	}
	if !testenv.WaitFor(20*time.Second, func() bool {
		var sent bool
		err := db.Pool.QueryRow(ctx, "SELECT coalesce(sent_lsn >= $1::pg_lsn, false) FROM pg_stat_replication WHERE pid = $2", end, st.BackendPID()).Scan(&sent)
		return err == nil && sent
	}) {
		t.Fatalf("the walsender did not send up to %s in 20 s", end)
	}
}

// TestWakeWaitsForPendingChanges over TLS: Pending looks at the socket
// beneath the TLS connection, and what the TLS layer has already taken
// from it is read without the socket, so a backlog is still read to its
// end before a Wake whose time has long passed.
func TestWakeWaitsForPendingChangesOverTLS(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	testenv.Get(t) // skips under -short
	dir, err := os.MkdirTemp("", "outbox-relay-certs-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	certs, err := testenv.NewCerts(dir)
	if err != nil {
		t.Fatal(err)
	}
	pg, err := testenv.StartPostgres(certs.PostgresTLS()...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	db, cfg := outboxDB(t, pg)
	cfg.URL = strings.Replace(cfg.URL, "sslmode=disable", "sslmode=require", 1)
	if !strings.Contains(cfg.URL, "sslmode=require") {
		t.Fatalf("no sslmode to replace in %s", cfg.URL)
	}
	st := setUpAndOpen(ctx, t, cfg, watermark.NewTracker(0))
	defer st.Close(ctx)
	var ssl bool
	if err := db.Pool.QueryRow(ctx, "SELECT ssl FROM pg_stat_ssl WHERE pid = $1", st.BackendPID()).Scan(&ssl); err != nil || !ssl {
		t.Fatalf("the stream's connection uses TLS: %v (%v), want true", ssl, err)
	}
	const txs = 24
	sentBacklog(ctx, t, db, st, txs)
	wakeAfterBacklog(ctx, t, st, txs)
}

// wakeAfterBacklog checks that st, with its backlog of txs one-insert
// transactions sent and nothing read, has it pending, and that with a wake
// time a second past it reads all of it before the Wake.
func wakeAfterBacklog(ctx context.Context, t *testing.T, st *replication.Stream, txs int) {
	t.Helper()
	if !st.Pending() {
		t.Fatal("Pending is false with the backlog sent and nothing read")
	}
	st.WakeAt(time.Now().Add(-time.Second))
	inserts := 0
	for {
		ev, err := st.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := ev.(*replication.Wake); ok {
			break
		}
		if _, ok := ev.(*replication.Insert); ok {
			inserts++
		}
	}
	if inserts != txs {
		t.Fatalf("Wake after %d of the %d inserts waiting, want after all of them", inserts, txs)
	}
}
