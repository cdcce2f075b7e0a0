package cleanup_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outbox-relay/outbox-relay/internal/cleanup"
	"github.com/outbox-relay/outbox-relay/internal/opstest"
	"github.com/outbox-relay/outbox-relay/internal/reconcile"
)

// partRow is one row of a partitioned outbox test: its id, age and
// whether it was relayed (in the stream, or marked PUBLISHED).
type partRow struct {
	id      string
	age     time.Duration
	relayed bool
}

// Issue 17, case 1: a ctid is unique only within one partition. Cleanup
// keyed its DELETE on ctid alone and deleted, in every other partition, the
// rows at the same (block, offset): unrelayed and young ones included.
// Each layout has rows of several partitions at the same ctids; only the
// old relayed rows may go, in both modes.
func TestCleanupPartitionedOutboxDeletesOnlyProvenRows(t *testing.T) {
	t.Parallel()
	const cols = `event_id uuid NOT NULL, aggregate_type text NOT NULL DEFAULT '', aggregate_id text NOT NULL,
aggregate_version bigint NOT NULL, event_type text NOT NULL, payload jsonb NOT NULL,
occurred_at timestamptz NOT NULL DEFAULT now(), publish_state text NOT NULL DEFAULT 'PENDING'`
	layouts := []struct {
		name string
		ddl  string
		// rows are inserted in this order; in the range layout the age
		// picks the partition, in the hash layout the id does.
		rows func(t *testing.T, f *opstest.Fixture) []partRow
	}{
		{
			name: "range",
			ddl: `CREATE TABLE outbox (` + cols + `, UNIQUE (event_id, occurred_at)) PARTITION BY RANGE (occurred_at);
CREATE TABLE outbox_old1 PARTITION OF outbox FOR VALUES FROM (now() - interval '10 days') TO (now() - interval '3 hours');
CREATE TABLE outbox_old2 PARTITION OF outbox FOR VALUES FROM (now() - interval '3 hours') TO (now() - interval '1 hour');
CREATE TABLE outbox_new PARTITION OF outbox FOR VALUES FROM (now() - interval '1 hour') TO (now() + interval '1 day');`,
			rows: func(t *testing.T, f *opstest.Fixture) []partRow {
				var out []partRow
				for i := 0; i < 5; i++ { // old, relayed: outbox_old1
					out = append(out, partRow{uuid.NewString(), 5 * time.Hour, true})
				}
				for i := 0; i < 5; i++ { // old, not relayed: outbox_old2
					out = append(out, partRow{uuid.NewString(), 2 * time.Hour, false})
				}
				for i := 0; i < 5; i++ { // new, not relayed: outbox_new
					out = append(out, partRow{uuid.NewString(), 0, false})
				}
				return out
			},
		},
		{
			name: "hash",
			ddl: `CREATE TABLE outbox (` + cols + `, UNIQUE (event_id)) PARTITION BY HASH (event_id);
CREATE TABLE outbox_h0 PARTITION OF outbox FOR VALUES WITH (MODULUS 2, REMAINDER 0);
CREATE TABLE outbox_h1 PARTITION OF outbox FOR VALUES WITH (MODULUS 2, REMAINDER 1);`,
			rows: func(t *testing.T, f *opstest.Fixture) []partRow {
				// Partition 0: old relayed rows, then new ones; partition
				// 1: old unrelayed rows, then new ones. Both start at
				// ctid (0,1).
				p0, p1 := hashIDs(t, f, 0, 10), hashIDs(t, f, 1, 10)
				var out []partRow
				for i := 0; i < 5; i++ {
					out = append(out, partRow{p0[i], 5 * time.Hour, true}, partRow{p1[i], 2 * time.Hour, false})
				}
				for i := 5; i < 10; i++ {
					out = append(out, partRow{p0[i], 0, false}, partRow{p1[i], 0, false})
				}
				return out
			},
		},
	}
	for _, l := range layouts {
		for _, mode := range []cleanup.Mode{cleanup.ModeStream, cleanup.ModePublished} {
			t.Run(l.name+"/"+string(mode), func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				f := opstest.New(t, "", 0)
				if _, err := f.DB.Pool.Exec(ctx, "DROP TABLE outbox; "+l.ddl); err != nil {
					t.Fatal(err)
				}
				f.CreateStreams(ctx)
				rows := l.rows(t, f)
				var relayed []reconcile.Event
				for i, r := range rows {
					state := "PENDING"
					if r.relayed {
						state = "PUBLISHED"
					}
					if _, err := f.DB.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_id, aggregate_version, event_type, payload, occurred_at, publish_state)
VALUES ($1, $2, 1, 'E', '{}', now() - $3::interval, $4)`, r.id, fmt.Sprintf("a%d", i), r.age, state); err != nil {
						t.Fatal(err)
					}
					if r.relayed {
						relayed = append(relayed, reconcile.Event{Table: "public.outbox", AggregateID: fmt.Sprintf("a%d", i), AggregateVersion: "1", EventID: r.id})
					}
				}
				if n := sameCTIDs(t, f); n == 0 {
					t.Fatal("no two partitions share a ctid: the test would prove nothing")
				}
				if mode == cleanup.ModeStream {
					// The relayed rows' events, stored as the relay would.
					rep, err := reconcile.Repair(ctx, f.DB.Pool, f.JS, reconcile.RepairConfig{Router: f.Cfg.Router, Stream: f.Stream}, relayed)
					if err != nil || rep.Published != len(relayed) {
						t.Fatalf("publish the relayed rows: %+v, %v", rep, err)
					}
				}
				rep, err := cleanup.Run(ctx, f.DB.Pool, f.JS, cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, Mode: mode, OlderThan: 30 * time.Minute, BatchSize: 3, StoredMargin: time.Nanosecond}, cleanup.WithMinStoredMargin(0))
				if err != nil {
					t.Fatal(err)
				}
				left := remainingIDs(t, f)
				for _, r := range rows {
					if r.relayed == left[r.id] {
						t.Errorf("row %s (age %s, relayed %v): kept %v", r.id, r.age, r.relayed, left[r.id])
					}
				}
				tr := rep.Tables[0]
				if tr.Candidates != 10 || tr.Deleted != int64(len(relayed)) || tr.Remaining != 5 {
					t.Errorf("report %+v: want 10 candidates, %d deleted, 5 remaining", tr, len(relayed))
				}
			})
		}
	}
}

// hashIDs returns n new uuids that the hash-partitioned outbox puts into
// the partition with this remainder (modulus 2).
func hashIDs(t *testing.T, f *opstest.Fixture, remainder, n int) []string {
	t.Helper()
	var out []string
	for len(out) < n {
		id := uuid.NewString()
		var ok bool
		if err := f.DB.Pool.QueryRow(context.Background(), "SELECT satisfies_hash_partition('outbox'::regclass, 2, $1, $2::uuid)", remainder, id).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		if ok {
			out = append(out, id)
		}
	}
	return out
}

// sameCTIDs counts the rows whose ctid another partition's row has too.
func sameCTIDs(t *testing.T, f *opstest.Fixture) int {
	t.Helper()
	var n int
	if err := f.DB.Pool.QueryRow(context.Background(),
		"SELECT count(*) FROM outbox a JOIN outbox b ON a.ctid = b.ctid AND a.tableoid <> b.tableoid").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
