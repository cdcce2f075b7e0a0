package replication_test

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/watermark"
)

// behindAfter opens a stream on a private cluster after a backlog of
// three outbox transactions followed by tail (SQL run just before Open),
// reads the backlog, then keeps reading until the stream is no longer
// Behind or wait has passed, and reports whether it still is, and how many
// Wakes it returned while a reader asked for one 200 ms ahead (as
// holdBehind does).
func behindAfter(t *testing.T, pg *testenv.Postgres, tail string, wait time.Duration) (behind bool, wakes int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	db, cfg := outboxDB(t, pg)
	if _, err := replication.Setup(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	for v := range 3 {
		if _, err := db.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_id, aggregate_version, event_type, payload)
			VALUES (gen_random_uuid(), 'a', $1, 'T', '{}')`, v+1); err != nil {
			t.Fatal(err)
		}
	}
	if tail != "" {
		if _, err := db.Pool.Exec(ctx, tail); err != nil {
			t.Fatalf("%s: %v", tail, err)
		}
	}
	var ins, flush string
	if err := db.Pool.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text, pg_current_wal_flush_lsn()::text").Scan(&ins, &flush); err != nil {
		t.Fatal(err)
	}
	st, err := replication.Open(ctx, cfg, watermark.NewTracker(0))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close(ctx)
	for commits := 0; commits < 3; {
		ev, err := st.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := ev.(*replication.Commit); ok {
			commits++
		}
	}
	start := time.Now()
	st.WakeAt(start.Add(200 * time.Millisecond))
	for st.Behind() && time.Since(start) < wait {
		ev, err := st.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		switch ev.(type) {
		case *replication.Wake:
			wakes++
			st.WakeAt(time.Now().Add(200 * time.Millisecond))
		default:
			t.Logf("unexpected %T", ev)
		}
	}
	rec, srv, end := st.Ends()
	t.Logf("tail %q: insert %s flush %s before Open; waited at most %s: received %s serverEnd %s startEnd %s, Behind %v, %d Wakes",
		tail, ins, flush, wait, rec, srv, end, st.Behind(), wakes)
	return st.Behind(), wakes
}

// Once the backlog of the stream's start is read and the walsender has
// nothing more to send, Behind must turn false (a keepalive at or past
// the start's end): whatever ends the WAL when the stream opens. Private
// clusters: nothing else writes WAL that would hide a stuck Behind.
func TestBehindClearsAfterTheBacklog(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, tail string }{
		{"plain", ""},
		// The insert position after a switch is the next segment's start
		// plus its long page header; the walsender's sent position stops
		// at the segment boundary.
		{"wal switch", "SELECT pg_switch_wal()"},
		// A WAL record nobody flushes (no commit, no async commit LSN):
		// the walsender cannot read past the flush position.
		{"unflushed record", "SELECT pg_logical_emit_message(false, 'not-ours', 'x')"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pg, err := testenv.StartPostgres()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pg.Close)
			// Under 15 s: the background writer's next running-transactions
			// record, WAL after the switch, would end a stuck Behind then.
			if behind, _ := behindAfter(t, pg, tc.tail, 10*time.Second); behind {
				t.Errorf("still Behind 10 s after the backlog was read: batch spans are held to maxBatchAge")
			}
		})
	}
}
