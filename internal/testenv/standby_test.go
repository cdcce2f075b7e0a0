package testenv

import (
	"context"
	"testing"
	"time"
)

// TestStandbyPromote makes a standby, checks that it replays the primary's
// writes (and, on 17, synchronises a failover slot), then promotes it.
func TestStandbyPromote(t *testing.T) {
	if testing.Short() {
		t.Skip("starts two PostgreSQL clusters")
	}
	t.Parallel()
	primary, err := StartPostgres()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(primary.Close)
	standby, err := primary.StartStandby(StandbyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(standby.Close)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	Must(t, primary.exec(ctx, "CREATE TABLE t (id int)"), "create table")
	// A synchronous commit: the flush position then covers it.
	Must(t, primary.exec(ctx, "SET synchronous_commit = on; INSERT INTO t VALUES (1)"), "insert")
	if primary.Major() >= 17 {
		Must(t, primary.exec(ctx, "SELECT pg_create_logical_replication_slot('fo', 'pgoutput', false, false, true)"), "create failover slot")
	}
	var lsn string
	Must(t, primary.queryRow(ctx, "SELECT pg_current_wal_flush_lsn()::text", nil, &lsn), "read lsn")
	Must(t, standby.WaitReplayed(ctx, lsn), "replay")
	if primary.Major() >= 17 {
		ok := WaitFor(30*time.Second, func() bool {
			var synced bool
			err := standby.queryRow(ctx, "SELECT synced FROM pg_replication_slots WHERE slot_name = 'fo'", nil, &synced)
			return err == nil && synced
		})
		if !ok {
			t.Fatalf("failover slot not synchronised to the standby:\n%s", standby.Log())
		}
	}
	primary.Stop("immediate")
	Must(t, standby.Promote(), "promote")
	Must(t, standby.exec(ctx, "INSERT INTO t VALUES (2)"), "write on the promoted standby")
	var n int
	Must(t, standby.queryRow(ctx, "SELECT count(*) FROM t", nil, &n), "count")
	if n != 2 {
		t.Fatalf("promoted standby holds %d rows, want 2", n)
	}
}
