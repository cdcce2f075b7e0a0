package replication_test

import (
	"context"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// A role that may read the gap table but not write it: recording a gap
// fails with the grant to run, naming the gap table and the role the
// relay connects as (issue 25: it printed "<the relay's role>" and a
// backfill's reason).
func TestRecordGapRefusedNamesRoleAndTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, cfg := outboxDB(t, testenv.Get(t).PG)
	role := strings.ToLower(testenv.UniqueName("gaprole"))
	for _, q := range []string{
		"CREATE ROLE " + role + " LOGIN",
		`CREATE TABLE public.outbox_relay_gap (slot_name name PRIMARY KEY, since_lsn pg_lsn NOT NULL,
	undecodable boolean NOT NULL DEFAULT false, noticed_at timestamptz NOT NULL)`,
		"GRANT SELECT ON public.outbox_relay_gap TO PUBLIC",
	} {
		if _, err := db.Pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { _, _ = db.Pool.Exec(context.Background(), "DROP OWNED BY "+role+"; DROP ROLE "+role) })
	cfg.URL = strings.Replace(cfg.URL, "postgres@", role+"@", 1)
	w, err := replication.NewPublicationWatch(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close(ctx)
	err = w.RecordGap(ctx, replication.Gap{Since: 1})
	if err == nil {
		t.Fatal("recorded a gap without INSERT on the gap table")
	}
	want := `GRANT SELECT, INSERT, UPDATE, DELETE ON "public"."outbox_relay_gap" TO "` + role + `"`
	if msg := err.Error(); !strings.Contains(msg, want) || !strings.Contains(msg, "publication gap") || strings.Contains(msg, "backfill") {
		t.Fatalf("refused record: %v\nwant it to name %s and the gap, not a backfill", err, want)
	}
}
