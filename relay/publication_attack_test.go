package relay_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

// Adversarial review of issue 25 (second round): the publication dropped
// and created again while a transaction stays open (a long batch job, a
// session idle in a transaction). The fill of the undecodable stretch
// waited for every transaction running at the time to end (SettleCommits),
// so the relay relayed nothing until that transaction ended, even one in
// another database of the cluster (50 of 150 in 30 s). It now waits only
// for the writers of the outbox that may be committing.
//
// unrelated: the open transaction wrote another table.
// idle_outbox_writer: it inserted an outbox row and sits idle in its
// transaction: it may hold rows of the gap (TestRelayGapWriterCommitsAfterFill),
// so the fill waits for it and the relay says so, naming it; committed, its
// row is relayed with the others.
func TestRelayPublicationRecreatedBesideOpenTransaction(t *testing.T) {
	t.Parallel()
	boolSubtests(t, "unrelated", "idle_outbox_writer", recreatedBesideOpenTransaction)
}

func recreatedBesideOpenTransaction(t *testing.T, outbox bool) {
	ctx := context.Background()
	f := newFixture(t, "")
	s := startStreaming(t, ctx, f)
	rl, pub, exec, w, all := s.rl, s.pub, s.exec, s.w, s.all

	// A transaction with an xid, left open for the test.
	exec("CREATE TABLE unrelated_job (id int)")
	tx, err := f.DB.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	idle := relaytest.Event{ID: uuid.NewString(), Aggregate: "idle-" + f.Stream[2:8], Version: 1, Payload: `{"n": 1}`}
	stmt, args := "INSERT INTO unrelated_job VALUES (1)", []any{}
	if outbox {
		stmt = `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ($1, 'registration', $2, 1, 'RegistrationConfirmed', $3)`
		args = []any{idle.ID, idle.Aggregate, idle.Payload}
	}
	if _, err := tx.Exec(ctx, stmt, args...); err != nil {
		t.Fatal(err)
	}

	exec(`DROP PUBLICATION ` + pub)
	all = append(all, w.Write(ctx, 50, 5)...)
	exec(`CREATE PUBLICATION ` + pub + ` FOR TABLE outbox WITH (publish = 'insert')`)
	all = append(all, w.Write(ctx, 50, 5)...)
	if outbox {
		// It may hold rows of the gap: the fill waits for it, naming it.
		if !testenv.WaitFor(30*time.Second, func() bool { return strings.Contains(rl.NotReadyReason(), "still open") }) {
			t.Fatalf("the relay does not say it waits for the open writer of the outbox: %v", rl.NotReadyReason())
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		all = append(all, idle)
	}
	if !testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.JS, f.Stream) >= uint64(len(all)) }) {
		t.Fatalf("%d of %d events relayed 30 s after the publication was recreated, beside a transaction left open",
			relaytest.StreamCount(ctx, f.JS, f.Stream), len(all))
	}
	if rep := relaytest.Check(all, f.Read(ctx, f.Stream)); !rep.OK() {
		t.Fatalf("stream check: %s", rep)
	}
}

// Adversarial review of issue 25 (second round): logical messages
// (router.Config.Messages) emitted while the publication did not exist.
// After the fill of the recreated publication's stretch the slot is
// advanced past it; the fill reads only the outbox tables, so a message
// of the stretch is neither relayed nor dead-lettered (invariant 3).
//
// after_right: m3, emitted as soon as the relay reports the publication
// right (after the first fill), is lost too: the next session failed with
// 42704 again, and the second fill advanced the slot past m3 (4 of 5 runs; one ran the
// session long enough to relay m2 and m3).
func TestRelayPublicationRecreatedLogicalMessages(t *testing.T) {
	t.Parallel()
	boolSubtests(t, "in_stretch", "after_right", func(t *testing.T, afterRight bool) { recreatedLogicalMessages(t, afterRight, false) })
}

// Without the message publication (a deployment set up before it
// existed, or whose owner did not create it) the logical messages of the
// stretch cannot be read: the relay advances past them all the same, and
// says so (an error log naming the fix, a dead-letter record naming the
// stretch, reason class stretch_unread), rather than stopping for good;
// m3, after the stretch, is relayed.
func TestRelayPublicationRecreatedLogicalMessagesUnreadable(t *testing.T) {
	t.Parallel()
	recreatedLogicalMessages(t, false, true)
}

// unroutableObserver counts the unroutable classes.
type unroutableObserver struct {
	relay.NopObserver
	mu      sync.Mutex
	classes map[string]int
}

func (o *unroutableObserver) Unroutable(class string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.classes[class]++
}

func (o *unroutableObserver) count(class string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.classes[class]
}

func recreatedLogicalMessages(t *testing.T, afterRight, noMessagePublication bool) {
	ctx := context.Background()
	f := newFixture(t, "")
	f.Cfg.PublicationCheck = 200 * time.Millisecond
	prefix := "evt_" + f.Stream[2:8]
	f.Cfg.Router.Messages = append(f.Cfg.Router.Messages, router.MessageConfig{
		Prefix:  prefix,
		Subject: f.Cfg.Router.Tables[0].Subject,
	})
	f.Setup(ctx)
	exec := sqlExec(t, ctx, f.DB.Pool)
	if noMessagePublication {
		exec(`DROP PUBLICATION "` + replication.MessagePublication(f.Cfg.Replication) + `"`)
	}
	obs := &unroutableObserver{classes: map[string]int{}}
	rl, _ := f.Start(ctx, relay.WithObserver(obs))
	pub := `"` + f.Cfg.Replication.Publication + `"`
	emit := func(id string, v int) {
		t.Helper()
		env := `{"event_id":"` + id + `","aggregate_type":"order","aggregate_id":"m.1","aggregate_version":` + relaytest.Itoa(v) +
			`,"event_type":"OrderPlaced","payload":{},"occurred_at":"2026-11-29T09:35:21.5Z"}`
		if _, err := f.DB.Pool.Exec(ctx, "SELECT pg_logical_emit_message(true, $1, $2::text)", prefix, env); err != nil {
			t.Fatal(err)
		}
	}
	emit("m1", 1)
	f.WaitCount(ctx, f.Stream, 1, 30*time.Second)
	exec(`DROP PUBLICATION ` + pub)
	if !testenv.WaitFor(10*time.Second, func() bool { return rl.PublicationProblem() != nil }) {
		t.Fatal("the missing publication was not noticed")
	}
	emit("m2", 2)
	exec(`CREATE PUBLICATION ` + pub + ` FOR TABLE outbox WITH (publish = 'insert')`)
	if !testenv.WaitFor(30*time.Second, func() bool { return rl.PublicationProblem() == nil }) {
		t.Fatalf("publication still reported wrong: %v", rl.PublicationProblem())
	}
	// m3 once the slot confirmed past everything written until the
	// publication was found right (after_right: at once): only the stream
	// can deliver it.
	var now replication.LSN
	if err := f.DB.Pool.QueryRow(ctx, "SELECT pg_current_wal_lsn()").Scan(&now); err != nil {
		t.Fatal(err)
	}
	if !afterRight && !testenv.WaitFor(30*time.Second, func() bool { return f.slot(ctx).ConfirmedFlushLSN >= now }) {
		t.Fatalf("slot not confirmed to %s", now)
	}
	emit("m3", 3)
	if noMessagePublication {
		if !testenv.WaitFor(30*time.Second, func() bool {
			ids := map[string]bool{}
			for _, m := range relaytest.ReadStream(ctx, t, f.JS, f.Stream) {
				ids[m.Event.ID] = true
			}
			return ids["m3"]
		}) {
			t.Fatal("m3 not relayed: the relay did not get past a stretch whose logical messages it cannot read")
		}
		if n := obs.count(relay.ClassStretchUnread); n == 0 {
			t.Fatalf("the unread stretch was not counted (%s)", relay.ClassStretchUnread)
		}
		if !testenv.WaitFor(10*time.Second, func() bool { return relaytest.StreamCount(ctx, f.JS, f.DLQ) >= 1 }) {
			t.Fatal("the unread stretch has no dead-letter record")
		}
		return
	}
	if !testenv.WaitFor(30*time.Second, func() bool {
		return relaytest.StreamCount(ctx, f.JS, f.Stream)+relaytest.StreamCount(ctx, f.JS, f.DLQ) >= 3
	}) {
		var ids []string
		for _, m := range relaytest.ReadStream(ctx, t, f.JS, f.Stream) {
			ids = append(ids, m.Event.ID)
		}
		t.Fatalf("a logical message is neither relayed nor dead-lettered: stream holds %v of m1, m2 (emitted while the publication did not exist), m3 (after); dead-letter stream %d",
			ids, relaytest.StreamCount(ctx, f.JS, f.DLQ))
	}
}

// Adversarial review of issue 25 (second round): the relay's role may
// read the gap table but not delete from it (the table created by a relay
// that ran as the owner, which grants SELECT to PUBLIC only, or a grant
// without DELETE). Recording the gap only logs when refused; clearing it
// (nothing recorded: a DELETE of no row) was refused too, so the fill
// never completed: the relay never streamed again nor became ready, and
// backfilled the outbox from the table over and over (which hid the
// stall from a count of events), logging why at debug level only.
func TestRelayPublicationGapRoleCannotClear(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.Cfg.PublicationCheck = 200 * time.Millisecond
	f.Setup(ctx)
	exec := sqlExec(t, ctx, f.DB.Pool)
	role := "r_" + strings.ToLower(f.Stream[2:10])
	exec("CREATE ROLE " + role + " LOGIN REPLICATION")
	exec("GRANT SELECT ON public.outbox TO " + role)
	// As recordGap creates it when it may.
	exec(`CREATE TABLE IF NOT EXISTS public.outbox_relay_gap (slot_name name PRIMARY KEY, since_lsn pg_lsn NOT NULL,
	undecodable boolean NOT NULL DEFAULT false, noticed_at timestamptz NOT NULL)`)
	exec("GRANT SELECT ON public.outbox_relay_gap TO PUBLIC")
	f.Cfg.Replication.URL = strings.Replace(f.Cfg.Replication.URL, "postgres@", role+"@", 1)
	t.Cleanup(func() {
		_, _ = f.DB.Pool.Exec(context.Background(), "DROP OWNED BY "+role)
	})
	var ready atomic.Bool
	rl, _ := f.Start(ctx, relay.WithReadiness(ready.Store))
	pub := `"` + f.Cfg.Replication.Publication + `"`
	w := f.NewWriter(5)
	all := w.Write(ctx, 50, 5)
	f.WaitCount(ctx, f.Stream, 50, 30*time.Second)
	exec(`ALTER PUBLICATION ` + pub + ` DROP TABLE outbox`)
	all = append(all, w.Write(ctx, 50, 5)...)
	if !testenv.WaitFor(10*time.Second, func() bool { return errors.Is(rl.PublicationProblem(), relay.ErrPublicationGap) }) {
		t.Fatalf("no gap noticed: %v", rl.PublicationProblem())
	}
	exec(`ALTER PUBLICATION ` + pub + ` ADD TABLE outbox`)
	all = append(all, w.Write(ctx, 50, 5)...)
	if !testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.JS, f.Stream) >= uint64(len(all)) }) {
		t.Fatalf("%d of %d events relayed 30 s after the table was added back (the relay's role may not delete from the gap table): %v",
			relaytest.StreamCount(ctx, f.JS, f.Stream), len(all), rl.PublicationProblem())
	}
	if !testenv.WaitFor(30*time.Second, ready.Load) {
		t.Fatalf("not ready 30 s after the gap's rows were published (the relay's role may not delete from the gap table): %v", rl.NotReadyReason())
	}
	// Only the slot delivers these: the relay streams again.
	all = append(all, w.Write(ctx, 50, 5)...)
	if !testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.JS, f.Stream) >= uint64(len(all)) }) {
		t.Fatalf("%d of %d events relayed: the relay does not stream again after the gap (the relay's role may not delete from the gap table): %v",
			relaytest.StreamCount(ctx, f.JS, f.Stream), len(all), rl.PublicationProblem())
	}
	if rep := relaytest.Check(all, f.Read(ctx, f.Stream)); !rep.OK() {
		t.Fatalf("stream check: %s", rep)
	}
}

// Adversarial review of issue 25 (second round): two outbox tables in the
// publication, only the second dropped from it while the relay streams
// and both written: the rows of the first keep the slot's stream busy (no
// idle keepalive) while the second's are withheld; none may be missing,
// and the first table's order must hold across the fill.
func TestRelayPublicationGapSecondTable(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"auto", "off"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			f := newFixture(t, "")
			f.Cfg.BatchPublish = mode
			f.Cfg.PublicationCheck = 200 * time.Millisecond
			exec := sqlExec(t, ctx, f.DB.Pool)
			exec("CREATE TABLE public.outbox_two (LIKE public.outbox INCLUDING ALL)")
			f.Cfg.Replication.Tables = append(f.Cfg.Replication.Tables, "public.outbox_two")
			f.Cfg.Router.Tables = append(f.Cfg.Router.Tables, router.TableConfig{Table: "public.outbox_two", Subject: f.Prefix + ".two.{aggregate_type}.{aggregate_id}"})
			f.Setup(ctx)
			f.Start(ctx)
			pub := `"` + f.Cfg.Replication.Publication + `"`
			w := f.NewWriter(5)
			two := 0
			writeTwo := func(n int) {
				t.Helper()
				exec(`INSERT INTO public.outbox_two (event_id, aggregate_id, aggregate_version, event_type, payload)
SELECT gen_random_uuid(), 'two', v, 'E', '{}' FROM generate_series(` + relaytest.Itoa(two+1) + `, ` + relaytest.Itoa(two+n) + `) v`)
				two += n
			}
			all := w.Write(ctx, 50, 5)
			writeTwo(10)
			f.WaitCount(ctx, f.Stream, 60, 30*time.Second)
			exec(`ALTER PUBLICATION ` + pub + ` DROP TABLE public.outbox_two`)
			for i := 0; i < 5; i++ {
				all = append(all, w.Write(ctx, 10, 5)...)
				writeTwo(10)
			}
			exec(`ALTER PUBLICATION ` + pub + ` ADD TABLE public.outbox_two`)
			all = append(all, w.Write(ctx, 50, 5)...)
			writeTwo(10)
			want := uint64(len(all) + two)
			if !testenv.WaitFor(60*time.Second, func() bool { return relaytest.StreamCount(ctx, f.JS, f.Stream) >= want }) {
				t.Fatalf("%d of %d events relayed", relaytest.StreamCount(ctx, f.JS, f.Stream), want)
			}
			var first []relaytest.Received
			versions := map[int64]bool{}
			for _, m := range f.Read(ctx, f.Stream) {
				if m.Event.AggregateID == "two" {
					versions[m.Event.AggregateVersion] = true
					continue
				}
				first = append(first, m)
			}
			if len(versions) != two {
				t.Fatalf("outbox_two: %d distinct versions in the stream, want %d", len(versions), two)
			}
			if rep := relaytest.Check(all, first); !rep.OK() {
				t.Fatalf("stream check of the first table: %s", rep)
			}
		})
	}
}

// Adversarial review of issue 25 (second round): the publication dropped
// while the active relay streams (the gap recorded, not undecodable), the
// active relay stopped, the publication created again; a standby that
// checked the publication before takes over: it must fill the gap and get
// past the stretch the slot cannot decode, then stream.
// "restart": no standby; a relay started afresh once the publication is
// created again, which never saw it right before, reads the recorded gap.
func TestRelayPublicationRecreatedStandbyTakesOver(t *testing.T) {
	t.Parallel()
	boolSubtests(t, "restart", "standby", recreatedTakeOver)
}

func recreatedTakeOver(t *testing.T, standby bool) {
	ctx := context.Background()
	f := newFixture(t, "")
	f.Cfg.PublicationCheck = 200 * time.Millisecond
	f.Setup(ctx)
	rl, stop := f.Start(ctx)
	w := f.NewWriter(5)
	all := w.Write(ctx, 50, 5)
	f.WaitCount(ctx, f.Stream, 50, 30*time.Second)
	if standby {
		obs := &countingObserver{}
		f.Start(ctx, relay.WithObserver(obs))
		if !testenv.WaitFor(30*time.Second, func() bool { return obs.standby.Load() >= 1 }) {
			t.Fatal("the second relay did not stand by")
		}
	}
	pub := `"` + f.Cfg.Replication.Publication + `"`
	exec := sqlExec(t, ctx, f.DB.Pool)
	exec(`DROP PUBLICATION ` + pub)
	all = append(all, w.Write(ctx, 50, 5)...)
	if !testenv.WaitFor(10*time.Second, func() bool { return errors.Is(rl.PublicationProblem(), relay.ErrPublicationGap) }) {
		t.Fatalf("no gap noticed: %v", rl.PublicationProblem())
	}
	_ = stop()
	exec(`CREATE PUBLICATION ` + pub + ` FOR TABLE outbox WITH (publish = 'insert')`)
	all = append(all, w.Write(ctx, 50, 5)...)
	if !standby {
		f.Start(ctx)
	}
	if !testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.JS, f.Stream) >= uint64(len(all)) }) {
		t.Fatalf("%d of %d events relayed after another relay took over", relaytest.StreamCount(ctx, f.JS, f.Stream), len(all))
	}
	// Only the slot delivers these: the standby streams.
	all = append(all, w.Write(ctx, 50, 5)...)
	testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.JS, f.Stream) >= uint64(len(all)) })
	if rep := relaytest.Check(all, f.Read(ctx, f.Stream)); !rep.OK() {
		t.Fatalf("stream check after a standby took over a recreated publication: %s", rep)
	}
}

// Adversarial review of issue 25 (second round): the publication dropped
// and created again, twice, while a concurrent load writes (big
// transactions among them), in both publishing modes: the slot is
// advanced past the stretch it cannot decode while rows commit around the
// position it is advanced to; none may be missing or out of order.
func TestRelayPublicationRecreatedUnderLoad(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"auto", "off"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			f := newFixture(t, "")
			f.Cfg.BatchPublish = mode
			f.Cfg.PublicationCheck = 200 * time.Millisecond
			f.Setup(ctx)
			rl, _ := f.Start(ctx)
			pub := `"` + f.Cfg.Replication.Publication + `"`
			exec := sqlExec(t, ctx, f.DB.Pool)
			first := f.NewWriter(1).Write(ctx, 1, 1)
			f.WaitCount(ctx, f.Stream, 1, 30*time.Second)
			wait := relaytest.WriteAsync(ctx, t, f.DB.Pool, relaytest.Load{Events: 3000, Aggregates: 40, Writers: 4, BigTx: 20, Pause: 60 * time.Millisecond})
			for round := 0; round < 2; round++ {
				exec(`DROP PUBLICATION ` + pub)
				testenv.WaitFor(5*time.Second, func() bool { return rl.PublicationProblem() != nil })
				exec(`CREATE PUBLICATION ` + pub + ` FOR TABLE outbox WITH (publish = 'insert')`)
				testenv.WaitFor(20*time.Second, func() bool { return rl.PublicationProblem() == nil })
			}
			evs := wait()
			relaytest.StoredPayloads(ctx, t, f.DB.Pool, "outbox", evs)
			all := append(first, evs...)
			testenv.WaitFor(90*time.Second, func() bool { return relaytest.StreamCount(ctx, f.JS, f.Stream) >= uint64(len(all)) })
			if rep := relaytest.Check(all, f.Read(ctx, f.Stream)); !rep.OK() {
				t.Fatalf("stream check after the publication was recreated under load: %s", rep)
			}
		})
	}
}

// boolSubtests runs fn(false) as subtest off and fn(true) as on, in
// parallel.
func boolSubtests(t *testing.T, off, on string, fn func(*testing.T, bool)) {
	for _, v := range []bool{false, true} {
		name := off
		if v {
			name = on
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			fn(t, v)
		})
	}
}
