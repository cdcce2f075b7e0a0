package replication_test

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/watermark"
)

// A stream opened on a slot with committed transactions not yet read is
// Behind until it has read them, whatever the socket holds at the moment
// (the relay's batch spans count on it while a walsender short of CPU
// sends the backlog slower than the relay reads it), and no longer once
// a change written after it started has come.
func TestBehindUntilTheStartBacklogIsRead(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	db, cfg := outboxDB(t, testenv.Get(t).PG)
	if _, err := replication.Setup(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	insert := func(v int) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_id, aggregate_version, event_type, payload)
			VALUES (gen_random_uuid(), 'a', $1, 'T', '{}')`, v); err != nil {
			t.Fatalf("insert %d: %v", v, err)
		}
	}
	const backlog = 5
	for v := range backlog {
		insert(v + 1)
	}
	st, err := replication.Open(ctx, cfg, watermark.NewTracker(0))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close(ctx)
	if !st.Behind() {
		t.Fatalf("a stream opened with %d transactions to read is not Behind", backlog)
	}
	commits := func(n int) {
		t.Helper()
		for seen := 0; seen < n; {
			ev, err := st.Next(ctx)
			if err != nil {
				t.Fatalf("after %d of %d commits: %v", seen, n, err)
			}
			if _, ok := ev.(*replication.Commit); ok {
				seen++
			}
		}
	}
	commits(backlog - 1)
	if !st.Behind() {
		t.Fatalf("Behind false with the last of the %d transactions of the backlog still to read", backlog)
	}
	commits(1)
	insert(backlog + 1)
	commits(1)
	if st.Behind() {
		t.Fatal("Behind after a change written since the stream started")
	}
}
