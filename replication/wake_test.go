package replication_test

import (
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
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
