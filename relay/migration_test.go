package relay_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/router"
)

// Migrations of the outbox table while the relay streams (issue 25): each
// is what users hit first, and each must neither drop events silently nor
// stop the stream. ADD COLUMN, widening mapped columns' types (a table
// rewrite) and dropping an unmapped column relay on; renaming a mapped
// column dead-letters its rows as missing_column naming the column and
// the setting to fix, and undoing the rename relays again. Every step's
// ALTER TABLE makes PostgreSQL describe the table again, which the relay
// answers with a publication check: it must find the publication
// unchanged and stream on.
func TestRelayOutboxMigrations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.relayTable(ctx, "mig_outbox", `event_id uuid NOT NULL, aggregate_type text NOT NULL DEFAULT 'registration',
		aggregate_id varchar(16) NOT NULL, aggregate_version integer NOT NULL, event_type text NOT NULL, payload jsonb NOT NULL,
		occurred_at timestamptz NOT NULL DEFAULT now(), note text`)
	f.Setup(ctx)
	f.start(ctx)
	var written []relaytest.Event
	version := 0
	insert := func(agg string) relaytest.Event {
		t.Helper()
		version++
		ev := relaytest.Event{ID: uuid.NewString(), Aggregate: agg, Version: int64(version), Payload: `{"v": ` + relaytest.Itoa(version) + `}`}
		col := "event_type"
		if agg == "renamed" {
			col = "kind"
		}
		if _, err := f.DB.Pool.Exec(ctx, `INSERT INTO mig_outbox (event_id, aggregate_id, aggregate_version, `+col+`, payload) VALUES ($1, $2, $3, 'T', $4)`,
			ev.ID, ev.Aggregate, ev.Version, ev.Payload); err != nil {
			t.Fatal(err)
		}
		return ev
	}
	relayed := func(step string) {
		t.Helper()
		written = append(written, insert("agg"))
		f.WaitCount(ctx, f.Stream, uint64(len(written)), 30*time.Second)
		if rep := relaytest.Check(written, f.Read(ctx, f.Stream)); !rep.OK() {
			t.Fatalf("after %s: %s", step, rep)
		}
	}
	exec := sqlExec(t, ctx, f.DB.Pool)
	relayed("start")
	exec(`ALTER TABLE mig_outbox ADD COLUMN tenant text NOT NULL DEFAULT 'acme'`)
	relayed("ADD COLUMN")
	exec(`ALTER TABLE mig_outbox ALTER COLUMN aggregate_version TYPE bigint, ALTER COLUMN aggregate_id TYPE varchar(64)`)
	relayed("widening aggregate_version and aggregate_id")
	exec(`ALTER TABLE mig_outbox DROP COLUMN note`)
	relayed("DROP of an unmapped column")

	exec(`ALTER TABLE mig_outbox RENAME COLUMN event_type TO kind`)
	lost := insert("renamed")
	f.WaitCount(ctx, f.DLQ, 1, 30*time.Second)
	dl := relaytest.ReadStream(ctx, t, f.JS, f.DLQ)
	h := dl[0].Headers
	if c := h[contract.DLQReasonClass]; len(c) != 1 || c[0] != router.ClassMissingColumn {
		t.Fatalf("renamed column: reason class %v, want %s", c, router.ClassMissingColumn)
	}
	if r := strings.Join(h[contract.DLQReason], ""); !strings.Contains(r, `"event_type"`) || !strings.Contains(r, "fix tables[0].columns.event_type") {
		t.Fatalf("renamed column: reason %q does not name the column and the setting to fix", r)
	}
	if id := strings.Join(h[contract.MsgID], ""); !strings.HasSuffix(id, ":event:"+lost.ID) {
		t.Fatalf("dead-letter record %q, want the record of event %s", id, lost.ID)
	}

	exec(`ALTER TABLE mig_outbox RENAME COLUMN kind TO event_type`)
	relayed("the rename undone")
}
