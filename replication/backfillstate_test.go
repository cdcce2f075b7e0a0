package replication_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// The backfill guard (issue 16, cases 3 and 4): while a backfill holds the
// lock a relay stands by; a record left unfinished refuses the slot until
// the slot is dropped, which forgets it.
func TestBackfillGuard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, cfg := outboxDB(t, testenv.Get(t).PG)
	if _, err := replication.CheckBackfill(ctx, cfg); err != nil {
		t.Fatalf("never backfilled: %v", err)
	}
	g, err := replication.LockBackfill(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := replication.CheckBackfill(ctx, cfg); !errors.Is(err, replication.ErrBackfillInProgress) || replication.IsPermanent(err) {
		t.Fatalf("while the lock is held: %v, want ErrBackfillInProgress (not permanent)", err)
	}
	if _, err := replication.Setup(ctx, cfg); err != nil { // the slot the backfill would create
		t.Fatal(err)
	}
	_ = g.Close(ctx) // the backfill dies
	// The server releases the lock once it sees the connection gone.
	var err2 error
	testenv.WaitFor(10*time.Second, func() bool {
		_, err2 = replication.CheckBackfill(ctx, cfg)
		return !errors.Is(err2, replication.ErrBackfillInProgress)
	})
	if err := err2; !errors.Is(err, replication.ErrBackfillIncomplete) || !replication.IsPermanent(err) {
		t.Fatalf("after the backfill died: %v, want ErrBackfillIncomplete (permanent)", err)
	}
	if dropped, err := replication.DropSlot(ctx, cfg); err != nil || !dropped {
		t.Fatalf("drop slot: %v, %v", dropped, err)
	}
	if _, err := replication.Setup(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if st, err := replication.CheckBackfill(ctx, cfg); err != nil || st.Known {
		t.Fatalf("after teardown and setup: %+v, %v", st, err)
	}
	if _, err := replication.DropSlot(ctx, cfg); err != nil {
		t.Fatal(err)
	}
}
