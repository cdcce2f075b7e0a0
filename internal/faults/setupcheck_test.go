package faults

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// Issue 16, case 3, end to end: `setup` killed (SIGKILL) while it
// backfills. `run` refuses the slot, `status` exits 1 and says why, the
// next `setup` backfills again from a new snapshot, and `run` then relays
// everything once, in order. Before, `run` streamed from the slot and the
// rest of the snapshot was never published.
func TestBackfillKilled(t *testing.T) {
	t.Parallel()
	env := testenv.Get(t)
	s := newScenario(t, env.PG, env.NATS.URL)
	ctx := context.Background()
	if _, err := replication.DropSlot(ctx, replication.Config{URL: s.db.URL, Slot: s.name, Publication: s.name, Tables: []string{"public.outbox"}}); err != nil {
		t.Fatal(err)
	}
	ld := startLoad(t, s.db.Pool, loadSpec{Writers: 2, Aggregates: 20, TxRows: []int{1, 50}, Events: 4000})
	ld.wait()
	s.set("nats.max_in_flight", 1) // a backfill slow enough to kill half-way
	setup := s.startCmd(nil, "setup", "--config", s.writeConfig())
	s.waitCount(s.stream, 50, 60*time.Second)
	setup.kill()
	msgs, _ := s.streamState(ctx, s.stream)
	s.logf("setup killed with %d events stored", msgs)

	s.set("postgres.auto_setup", false)
	out, code := s.runCmd(60*time.Second, nil, "run", "--config", s.writeConfig())
	if code == 0 || !strings.Contains(out, "did not finish") || !strings.Contains(out, "outbox-relay setup") {
		t.Fatalf("run after a killed backfill: exit %d\n%s", code, out)
	}
	out, code = s.runCmd(30*time.Second, nil, "status", "--config", s.writeConfig())
	if code != 1 || !strings.Contains(out, "never finished") {
		t.Fatalf("status after a killed backfill: exit %d\n%s", code, out)
	}

	s.unset("nats.max_in_flight")
	if out, code := s.runCmd(120*time.Second, nil, "setup", "--config", s.writeConfig()); code != 0 || !strings.Contains(out, "backfilled") {
		t.Fatalf("setup again: exit %d\n%s", code, out)
	}
	s.sample()
	s.startRelay()
	late := startLoad(t, s.db.Pool, loadSpec{Writers: 1, Aggregates: 5, Events: 200, Type: "late"})
	late.wait()
	o := s.verify(time.Minute)
	s.mustHold("backfill killed, setup again", o, 0, "run refuses, status exits 1, setup backfills again")
}

// Issue 16, case 6, end to end: with auto_setup off and a publication that
// does not carry the outbox, `run` refuses and `status` exits 1, both
// naming the ALTER PUBLICATION; before, run was ready and relayed nothing.
func TestPublicationMissingTable(t *testing.T) {
	t.Parallel()
	env := testenv.Get(t)
	s := newScenario(t, env.PG, env.NATS.URL)
	ctx := context.Background()
	s.exec(ctx, "CREATE TABLE other (id int)")
	s.exec(ctx, `ALTER PUBLICATION "`+s.name+`" ADD TABLE other`)
	s.exec(ctx, `ALTER PUBLICATION "`+s.name+`" DROP TABLE outbox`)
	s.set("postgres.auto_setup", false)
	fix := `ALTER PUBLICATION "` + s.name + `" ADD TABLE "public"."outbox"`
	out, code := s.runCmd(60*time.Second, nil, "run", "--config", s.writeConfig())
	if code == 0 || !strings.Contains(out, fix) {
		t.Fatalf("run: exit %d, want a refusal naming %s\n%s", code, fix, out)
	}
	out, code = s.runCmd(30*time.Second, nil, "status", "--config", s.writeConfig())
	if code != 1 || !strings.Contains(out, fix) {
		t.Fatalf("status: exit %d\n%s", code, out)
	}
	s.exec(ctx, fix)
	if out, code := s.runCmd(30*time.Second, nil, "status", "--config", s.writeConfig()); strings.Contains(out, "ALTER PUBLICATION") {
		t.Fatalf("status after the fix: exit %d\n%s", code, out)
	}
}

// Issue 16, case 4, end to end: the first deploy of an HA pair, both with
// auto_setup and backfill. The first instance backfills a hot aggregate
// one message at a time; the second starts meanwhile, and later versions
// of that aggregate are written. The second waits for the backfill (its
// lock), so every version is stored once, in order. Before, it streamed
// the later versions ahead of the backfill.
func TestHAFirstDeployBackfill(t *testing.T) {
	t.Parallel()
	env := testenv.Get(t)
	s := newScenario(t, env.PG, env.NATS.URL)
	ctx := context.Background()
	if _, err := replication.DropSlot(ctx, replication.Config{URL: s.db.URL, Slot: s.name, Publication: s.name, Tables: []string{"public.outbox"}}); err != nil {
		t.Fatal(err)
	}
	insert := func(from, to int) {
		s.exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload)
			SELECT gen_random_uuid(), 'registration', 'hot', g, 'T', jsonb_build_object('n', g) FROM generate_series($1::int, $2::int) g`, from, to)
	}
	const before = 10000
	insert(1, before)
	s.set("nats.max_in_flight", 1)
	s.startRelay() // the first instance: creates the slot and backfills
	s.waitCount(s.stream, 100, 60*time.Second)
	insert(before+1, before+10)
	s.startRelay() // the second instance, while the backfill runs
	s.sample()
	o := s.verify(2 * time.Minute)
	s.mustHold("HA first deploy during the backfill", o, 0, "the second instance waits for the backfill lock")
}
