package main

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/replication"
)

// A stream whose subjects do not cover the configuration stops setup
// before PostgreSQL is changed: it left a slot behind that retained WAL.
func TestSetupChecksStreamsBeforeTheSlot(t *testing.T) {
	for _, backfill := range []bool{true, false} {
		t.Run(fmt.Sprintf("backfill=%v", backfill), func(t *testing.T) {
			t.Parallel()
			testSetupChecksStreamsBeforeTheSlot(t, backfill)
		})
	}
}

func testSetupChecksStreamsBeforeTheSlot(t *testing.T, backfill bool) {
	f := newOpsFixture(t)
	if !backfill {
		pub := "  publication: " + f.cfg.Postgres.Publication + "\n"
		f.setYAML(pub, pub+"  backfill: false\n")
	}
	ctx := context.Background()
	if _, err := f.js.CreateStream(ctx, jetstream.StreamConfig{Name: f.stream, Subjects: []string{"elsewhere.>"}}); err != nil {
		t.Fatal(err)
	}
	out, err := f.step("setup")
	if err == nil || !strings.Contains(err.Error(), "do not cover") {
		t.Fatalf("setup = %v, want the uncovered subjects named\n%s", err, out)
	}
	st, err := replication.Status(ctx, f.cfg.Postgres.URL, f.cfg.Postgres.Slot)
	if err != nil {
		t.Fatal(err)
	}
	if st.Exists {
		t.Errorf("setup failed on the stream but left slot %s behind", f.cfg.Postgres.Slot)
	}
	var pubs int
	if err := f.db.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_publication WHERE pubname = $1", f.cfg.Postgres.Publication).Scan(&pubs); err != nil {
		t.Fatal(err)
	}
	if pubs != 0 {
		t.Errorf("setup failed on the stream but created publication %s", f.cfg.Postgres.Publication)
	}
}

// A fresh setup prints what it did, in the order it did it, and claims
// "already exists" of nothing it has just created; a second run says
// everything exists.
func TestSetupPrintsWhatItDid(t *testing.T) {
	t.Parallel()
	f := newOpsFixture(t)
	f.insert(context.Background(), 3, "Happened")
	out, err := f.step("setup")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(out, "already exists") {
		t.Errorf("a fresh setup says something already exists:\n%s", out)
	}
	want := []string{
		"nats: created stream " + f.stream + " ",
		"nats: created stream " + f.stream + "_DLQ ",
		"postgres: created publication " + f.cfg.Postgres.Publication,
		"postgres: created logical replication slot " + f.cfg.Postgres.Slot,
		"postgres: backfilled 3 waiting rows",
	}
	at := 0
	for _, w := range want {
		i := strings.Index(out[at:], w)
		if i < 0 {
			t.Fatalf("setup output lacks %q after position %d:\n%s", w, at, out)
		}
		at += i + len(w)
	}
	out, err = f.step("setup")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(out, "created") || strings.Count(out, "already exists") < 4 {
		t.Errorf("a second setup should find everything there:\n%s", out)
	}
}
