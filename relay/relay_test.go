package relay_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/opstest"
	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

// fixture is opstest's, with the helpers these tests are written with.
type fixture struct{ *opstest.Fixture }

func newFixture(t *testing.T, natsURL string) *fixture {
	t.Helper()
	return &fixture{opstest.New(t, natsURL, 0)}
}

// start runs the relay until the test ends; the returned stop waits for it.
func (f *fixture) start(ctx context.Context) (stop func() error) {
	f.T.Helper()
	_, stop = f.Start(ctx)
	return stop
}

// relayTable creates table public.<name> with columns and relays it instead
// of the seed's outbox.
func (f *fixture) relayTable(ctx context.Context, name, columns string) {
	f.T.Helper()
	if _, err := f.DB.Pool.Exec(ctx, "CREATE TABLE "+name+" ("+columns+")"); err != nil {
		f.T.Fatal(err)
	}
	f.Cfg.Replication.Tables = []string{"public." + name}
	f.Cfg.Router.Tables[0].Table = "public." + name
}

func (f *fixture) slot(ctx context.Context) replication.SlotStatus {
	f.T.Helper()
	st, err := replication.Status(ctx, f.DB.URL, f.Cfg.Replication.Slot)
	if err != nil {
		f.T.Fatal(err)
	}
	return st
}

// waitConfirmed waits up to timeout until the slot's confirmed position
// has passed the end of the WAL written so far, this test's rows among it,
// and until also (nil: nothing more) holds. Not LagBytes == 0: that asks
// it of the WAL the package's other tests write in the shared cluster up
// to the moment of the check, which under CPU load the relay is seldom
// idle long enough to have confirmed.
func (f *fixture) waitConfirmed(ctx context.Context, timeout time.Duration, also func() bool) {
	f.T.Helper()
	var s string
	if err := f.DB.Pool.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&s); err != nil {
		f.T.Fatal(err)
	}
	end, err := replication.ParseLSN(s)
	if err != nil {
		f.T.Fatal(err)
	}
	if !testenv.WaitFor(timeout, func() bool {
		return f.slot(ctx).ConfirmedFlushLSN >= end && (also == nil || also())
	}) {
		f.T.Fatalf("after %s the slot confirmed %s, want at least the WAL's end %s when the wait began (the test's own condition held: %v)",
			timeout, f.slot(ctx).ConfirmedFlushLSN, end, also == nil || also())
	}
}

// Acceptance 1: concurrent writers, mixed transaction sizes; exact count,
// order per aggregate, exact headers and payload bytes.
func TestRelayConcurrentWriters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.Setup(ctx)
	f.start(ctx)
	evs := relaytest.Write(ctx, t, f.DB.Pool, relaytest.Load{Events: 10000, Aggregates: 200, Writers: 4, BigTx: 50})
	relaytest.StoredPayloads(ctx, t, f.DB.Pool, "outbox", evs)
	f.WaitCount(ctx, f.Stream, uint64(len(evs)), 60*time.Second)
	got := relaytest.ReadStream(ctx, t, f.JS, f.Stream)
	rep := relaytest.Check(evs, got)
	if !rep.OK() || rep.Received != 10000 {
		t.Fatalf("stream check: %s", rep)
	}
	// The header contract, on one message.
	m := got[0]
	for _, h := range []string{contract.MsgID, contract.EventID, contract.EventType, contract.AggregateType, contract.AggregateID,
		contract.AggregateVersion, contract.OccurredAt, contract.CommitLSN, contract.CommitTime, contract.Table, contract.ContentType} {
		if len(m.Headers[h]) != 1 || m.Headers[h][0] == "" {
			t.Errorf("header %s = %q", h, m.Headers[h])
		}
	}
	if m.Headers[contract.MsgID][0] != m.Event.ID || m.Headers[contract.Table][0] != "public.outbox" || m.Headers[contract.ContentType][0] != "application/json" {
		t.Errorf("headers %v", m.Headers)
	}
	// The slot confirms past everything once acked.
	if !testenv.WaitFor(10*time.Second, func() bool { return f.slot(ctx).LagBytes < 1<<20 }) {
		t.Fatalf("slot lag stays at %d bytes", f.slot(ctx).LagBytes)
	}
}

// Acceptance 2: rollbacks, other tables, updates and deletes publish
// nothing; insert-then-delete in one transaction publishes the event.
func TestRelayOnlyCommittedInserts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	if _, err := f.DB.Pool.Exec(ctx, "CREATE TABLE other (id int primary key, v text)"); err != nil {
		t.Fatal(err)
	}
	f.Setup(ctx)
	f.start(ctx)
	exec := sqlExec(t, ctx, f.DB.Pool)
	ins := func(id, agg string, v int) string {
		return "INSERT INTO outbox (event_id, aggregate_id, aggregate_version, event_type, payload) VALUES ('" + id + "', '" + agg + "', " + relaytest.Itoa(v) + ", 'T', '{}')"
	}
	exec("BEGIN; " + ins("00000000-0000-0000-0000-000000000001", "a", 1) + "; ROLLBACK")
	exec("INSERT INTO other VALUES (1, 'x')")
	exec(ins("00000000-0000-0000-0000-000000000002", "a", 1))
	exec("UPDATE outbox SET publish_state = 'PUBLISHED'")
	exec("DELETE FROM outbox")
	exec("BEGIN; " + ins("00000000-0000-0000-0000-000000000003", "b", 1) + "; DELETE FROM outbox WHERE aggregate_id = 'b'; COMMIT")
	exec("UPDATE other SET v = 'y'")
	// A sentinel last: once it is in, everything before it was handled.
	exec(ins("00000000-0000-0000-0000-000000000004", "c", 1))
	f.WaitCount(ctx, f.Stream, 3, 30*time.Second)
	got := relaytest.ReadStream(ctx, t, f.JS, f.Stream)
	var ids []string
	for _, m := range got {
		ids = append(ids, m.Event.ID)
	}
	want := []string{"00000000-0000-0000-0000-000000000002", "00000000-0000-0000-0000-000000000003", "00000000-0000-0000-0000-000000000004"}
	if strings.Join(ids, ",") != strings.Join(want, ",") {
		t.Fatalf("stream holds %v, want %v", ids, want)
	}
}

// Acceptance 3: with the broker down, the confirmed LSN stays before the
// first unpublished commit; when it returns everything arrives and the
// slot moves past it.
func TestRelayBrokerOutage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ns, err := testenv.StartNATS()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ns.Close)
	f := newFixture(t, ns.URL)
	f.Setup(ctx)
	f.start(ctx)
	first := relaytest.Write(ctx, t, f.DB.Pool, relaytest.Load{Events: 100, Aggregates: 10})
	f.WaitCount(ctx, f.Stream, 100, 30*time.Second)
	if !testenv.WaitFor(10*time.Second, func() bool { return f.slot(ctx).LagBytes < 64<<10 }) {
		t.Fatal("slot did not confirm the first batch")
	}
	before := f.slot(ctx).ConfirmedFlushLSN

	ns.Stop()
	second := relaytest.Write(ctx, t, f.DB.Pool, relaytest.Load{Events: 500, Aggregates: 10, Writers: 2, BigTx: 20})
	// Give the relay time to try. Other tests write WAL in other databases
	// meanwhile, which an idle relay may confirm; what it must never
	// confirm is the commit of an event the broker has not stored. Those
	// commits are known once the events arrive, so the positions are
	// sampled now and judged then.
	var outageMax replication.LSN
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		outageMax = max(outageMax, f.slot(ctx).ConfirmedFlushLSN)
		time.Sleep(100 * time.Millisecond)
	}
	if outageMax < before {
		t.Fatalf("confirmed LSN went backwards: %s < %s", outageMax, before)
	}
	if err := ns.Start(); err != nil {
		t.Fatal(err)
	}
	all := append(first, second...)
	relaytest.StoredPayloads(ctx, t, f.DB.Pool, "outbox", all)
	f.WaitCount(ctx, f.Stream, uint64(len(all)), 60*time.Second)
	got := relaytest.ReadStream(ctx, t, f.JS, f.Stream)
	rep := relaytest.Check(all, got)
	if !rep.OK() {
		t.Fatalf("after outage: %s", rep)
	}
	// The first commit of the outage's events: its commit record starts at
	// the Outbox-Commit-Lsn header, and the slot may confirm up to there,
	// not past it, while the broker is down.
	outage := map[string]bool{}
	for _, e := range second {
		outage[e.ID] = true
	}
	var firstCommit replication.LSN
	for _, m := range got {
		if !outage[m.Event.ID] {
			continue
		}
		vals := m.Headers[contract.CommitLSN]
		if len(vals) == 0 {
			t.Fatalf("event %s has no %s header", m.Event.ID, contract.CommitLSN)
		}
		c, err := replication.ParseLSN(vals[0])
		if err != nil {
			t.Fatal(err)
		}
		if firstCommit == 0 || c < firstCommit {
			firstCommit = c
		}
	}
	if outageMax > firstCommit {
		t.Fatalf("confirmed_flush_lsn reached %s during the outage, past the commit at %s of an event not yet stored", outageMax, firstCommit)
	}
	if !testenv.WaitFor(15*time.Second, func() bool { return f.slot(ctx).ConfirmedFlushLSN > firstCommit }) {
		t.Fatal("confirmed LSN did not move past the outage's events")
	}
}

// Acceptance 7: a row with a NULL required field is dead-lettered with its
// reason, row and LSN; the events after it are relayed.
func TestRelayDeadLettersUnroutableRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.relayTable(ctx, "loose_outbox", `event_id uuid, aggregate_id text, aggregate_version bigint, event_type text, payload jsonb`)
	f.Setup(ctx)
	f.start(ctx)
	_, err := f.DB.Pool.Exec(ctx, `INSERT INTO loose_outbox VALUES
		('00000000-0000-0000-0000-00000000000a', 'agg', 1, 'T', '{"a":1}'),
		('00000000-0000-0000-0000-00000000000b', 'agg', 2, NULL, '{"a":2}'),
		('00000000-0000-0000-0000-00000000000c', 'agg', 3, 'T', '{"a":3}')`)
	if err != nil {
		t.Fatal(err)
	}
	f.WaitCount(ctx, f.Stream, 2, 30*time.Second)
	f.WaitCount(ctx, f.DLQ, 1, 30*time.Second)
	got := relaytest.ReadStream(ctx, t, f.JS, f.Stream)
	if len(got) != 2 || got[0].Event.AggregateVersion != 1 || got[1].Event.AggregateVersion != 3 {
		t.Fatalf("stream: %+v", got)
	}
	dl := relaytest.ReadStream(ctx, t, f.JS, f.DLQ)
	if len(dl) != 1 {
		t.Fatalf("dead letters: %d", len(dl))
	}
	h := dl[0].Headers
	if h[contract.DLQReasonClass][0] != "null_field" || !strings.Contains(h[contract.DLQReason][0], "event_type") || h[contract.DLQLSN][0] == "" || h[contract.Table][0] != "public.loose_outbox" {
		t.Fatalf("dead-letter headers: %v", h)
	}
	if !strings.Contains(string(dl[0].Data), `"00000000-0000-0000-0000-00000000000b"`) || !strings.Contains(string(dl[0].Data), `"event_type":null`) {
		t.Fatalf("dead-letter body lacks the row: %s", dl[0].Data)
	}
}

// Acceptance 8: ALTER TABLE ADD COLUMN while streaming breaks nothing.
func TestRelayAlterTableMidStream(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.Setup(ctx)
	f.start(ctx)
	first := relaytest.Write(ctx, t, f.DB.Pool, relaytest.Load{Events: 200, Aggregates: 20})
	if _, err := f.DB.Pool.Exec(ctx, "ALTER TABLE outbox ADD COLUMN tenant text DEFAULT 'acme'"); err != nil {
		t.Fatal(err)
	}
	second := relaytest.Write(ctx, t, f.DB.Pool, relaytest.Load{Events: 200, Aggregates: 20})
	all := append(first, second...)
	relaytest.StoredPayloads(ctx, t, f.DB.Pool, "outbox", all)
	f.WaitCount(ctx, f.Stream, 400, 30*time.Second)
	if rep := relaytest.Check(all, relaytest.ReadStream(ctx, t, f.JS, f.Stream)); !rep.OK() {
		t.Fatalf("after ALTER TABLE: %s", rep)
	}
	if n := relaytest.StreamCount(ctx, f.JS, f.DLQ); n != 0 {
		t.Fatalf("%d rows dead-lettered", n)
	}
}

// Acceptance 6: an idle outbox does not make the slot retain WAL while
// other tables are busy.
func TestRelayIdleOutboxReleasesWAL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	if _, err := f.DB.Pool.Exec(ctx, "CREATE TABLE busy (id bigserial primary key, filler text)"); err != nil {
		t.Fatal(err)
	}
	f.Setup(ctx)
	f.start(ctx)
	relaytest.Write(ctx, t, f.DB.Pool, relaytest.Load{Events: 10, Aggregates: 2})
	f.WaitCount(ctx, f.Stream, 10, 30*time.Second)
	// About 200 MB of WAL from another table.
	for i := 0; i < 20; i++ {
		if _, err := f.DB.Pool.Exec(ctx, "INSERT INTO busy (filler) SELECT repeat(md5(g::text), 30) FROM generate_series(1, 10000) g"); err != nil {
			t.Fatal(err)
		}
	}
	var lag int64
	if !testenv.WaitFor(20*time.Second, func() bool {
		lag = f.slot(ctx).LagBytes
		return lag < 32<<20
	}) {
		t.Fatalf("slot still %d bytes behind the current WAL after 20s", lag)
	}
}

// A missing slot stops the relay with an actionable error, not a retry loop.
func TestRelayRefusesMissingSlot(t *testing.T) {
	t.Parallel()
	f := newFixture(t, "")
	rl, err := relay.New(f.Cfg, f.NC, relay.WithLogger(zaptest.NewLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err = rl.Run(ctx)
	if !errors.Is(err, replication.ErrSlotMissing) || !strings.Contains(err.Error(), "outbox-relay setup") {
		t.Fatalf("Run = %v, want ErrSlotMissing with a hint", err)
	}
}

// Issue 4, acceptance 5: table-less events written with
// pg_logical_emit_message flow with the same header contract; a
// non-transactional one is dead-lettered; a rolled-back one never appears.
func TestRelayLogicalMessages(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	prefix := "evt_" + strings.ToLower(f.Stream[2:8])
	f.Cfg.Router.Messages = append(f.Cfg.Router.Messages, router.MessageConfig{
		Prefix:  prefix,
		Subject: f.Cfg.Router.Tables[0].Subject,
	})
	f.Setup(ctx)
	f.start(ctx)
	emit := func(transactional bool, commit bool, content string) {
		t.Helper()
		tx, err := f.DB.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SELECT pg_logical_emit_message($1, $2, $3::text)", transactional, prefix, content); err != nil {
			t.Fatal(err)
		}
		if commit {
			err = tx.Commit(ctx)
		} else {
			err = tx.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	env := func(id string, v int) string {
		return `{"event_id":"` + id + `","aggregate_type":"order","aggregate_id":"o.1","aggregate_version":` + relaytest.Itoa(v) +
			`,"event_type":"OrderPlaced","payload":{"total": 42},"occurred_at":"2026-11-29T09:35:21.5Z"}`
	}
	emit(true, true, env("m1", 1))
	emit(true, false, env("rolled-back", 2))
	emit(false, true, env("non-tx", 3))
	emit(true, true, `{"event_id": "bad"}`)
	// Another application's prefix is not ours: ignored.
	if _, err := f.DB.Pool.Exec(ctx, "SELECT pg_logical_emit_message(true, 'someone-else', 'x')"); err != nil {
		t.Fatal(err)
	}
	emit(true, true, env("m2", 2))
	f.WaitCount(ctx, f.Stream, 2, 30*time.Second)
	f.WaitCount(ctx, f.DLQ, 2, 30*time.Second)
	got := relaytest.ReadStream(ctx, t, f.JS, f.Stream)
	if len(got) != 2 || got[0].Event.ID != "m1" || got[1].Event.ID != "m2" {
		t.Fatalf("events: %+v", got)
	}
	m := got[0]
	if m.Subject != strings.ToLower(f.Stream)+".order.o~2E1" || string(m.Data) != `{"total": 42}` || m.Event.AggregateVersion != 1 ||
		m.Headers[contract.Table][0] != relay.MessageSchema+"."+prefix || m.Headers[contract.OccurredAt][0] != "2026-11-29T09:35:21.5Z" ||
		m.Headers[contract.CommitLSN][0] == "" || m.Headers[contract.MsgID][0] != "m1" {
		t.Fatalf("message event: subject %s data %s headers %v", m.Subject, m.Data, m.Headers)
	}
	dl := relaytest.ReadStream(ctx, t, f.JS, f.DLQ)
	classes := []string{dl[0].Headers[contract.DLQReasonClass][0], dl[1].Headers[contract.DLQReasonClass][0]}
	if strings.Join(classes, ",") != relay.ClassNonTransactional+","+relay.ClassInvalidEnvelope {
		t.Fatalf("dead-letter classes %v", classes)
	}
	if !strings.Contains(string(dl[0].Data), "non-tx") {
		t.Fatalf("non-transactional record lacks the content: %s", dl[0].Data)
	}
}

// Issue 4, acceptance 3: 5,000 PENDING rows before the slot exists plus
// 5,000 inserted while it is created → 10,000 events, none twice, in
// aggregate order. The stream's duplicate window is tiny, so an overlap
// between the snapshot and the slot would show up as duplicates.
func TestBackfillThenStream(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.Cfg.Stream.Duplicates = 100 * time.Millisecond
	f.Cfg.DeadLetterStream.Duplicates = 100 * time.Millisecond
	// With so short a window a retry after an ack timeout would be stored
	// twice too; on a loaded machine a 2s timeout can fire, so make it long
	// enough that only an overlap can produce a duplicate.
	f.Cfg.Publisher.AckTimeout = time.Minute
	before := relaytest.Write(ctx, t, f.DB.Pool, relaytest.Load{Events: 5000, Aggregates: 300, Writers: 2, BigTx: 100})
	// Rows a polling relay already published are not backfilled.
	if _, err := f.DB.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_id, aggregate_version, event_type, payload, publish_state)
		VALUES ('00000000-0000-0000-0000-0000000000ff', 'old', 1, 'T', '{}', 'PUBLISHED')`); err != nil {
		t.Fatal(err)
	}
	writes := relaytest.WriteAsync(ctx, t, f.DB.Pool, relaytest.Load{Events: 5000, Aggregates: 300, Writers: 2, BigTx: 20, Pause: 100 * time.Microsecond})
	time.Sleep(20 * time.Millisecond) // let the writers get going: some rows land before the slot, some after
	nc := f.NC
	var reports int
	rep, err := relay.Backfill(ctx, f.Cfg, nc, zaptest.NewLogger(t), func(string, int, int) { reports++ })
	if err != nil {
		t.Fatal(err)
	}
	if !rep.SlotCreated || rep.Rows < 5000 || reports == 0 {
		t.Fatalf("backfill report %+v, %d progress reports", rep, reports)
	}
	f.start(ctx)
	all := append(before, writes()...)
	relaytest.StoredPayloads(ctx, t, f.DB.Pool, "outbox", all)
	f.WaitCount(ctx, f.Stream, 10000, 60*time.Second)
	got := relaytest.ReadStream(ctx, t, f.JS, f.Stream)
	if r := relaytest.Check(all, got); !r.OK() || r.Received != 10000 {
		t.Fatalf("backfill + stream: %s (backfilled %d rows)", r, rep.Rows)
	}
	// A second backfill finds the slot and does nothing.
	rep2, err := relay.Backfill(ctx, f.Cfg, nc, nil, nil)
	if err != nil || rep2.SlotCreated || rep2.Rows != 0 {
		t.Fatalf("second backfill: %+v, %v", rep2, err)
	}
}

// Events go in fast-ingest batches when the event stream allows them and
// per aggregate when it does not; "on" refuses a stream without them; and a
// stream that stops allowing them mid-stream makes the relay switch to per
// aggregate without losing or reordering anything.
func TestRelayPublishModes(t *testing.T) {
	t.Parallel()
	load := relaytest.Load{Events: 2000, Aggregates: 20, Writers: 2, BigTx: 20}
	run := func(t *testing.T, allow bool, mode string) (*fixture, *relay.Relay) {
		t.Helper()
		ctx := context.Background()
		f := newFixture(t, "")
		f.Cfg.Stream.AllowBatch = allow
		f.Cfg.BatchPublish = mode
		f.Setup(ctx)
		rl, _ := f.Start(ctx)
		return f, rl
	}
	check := func(t *testing.T, f *fixture, evs []relaytest.Event) {
		t.Helper()
		ctx := context.Background()
		relaytest.StoredPayloads(ctx, t, f.DB.Pool, "outbox", evs)
		f.WaitCount(ctx, f.Stream, uint64(len(evs)), 60*time.Second)
		if rep := relaytest.Check(evs, relaytest.ReadStream(ctx, t, f.JS, f.Stream)); !rep.OK() {
			t.Fatalf("stream check: %s", rep)
		}
	}
	for _, c := range []struct {
		name    string
		allow   bool
		mode    string
		batched bool
	}{
		{"allowed", true, "", true},
		{"not allowed", false, "auto", false},
		{"off", true, "off", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			f, rl := run(t, c.allow, c.mode)
			evs := relaytest.Write(context.Background(), t, f.DB.Pool, load)
			check(t, f, evs)
			if rl.Batched() != c.batched {
				t.Fatalf("batched %v, want %v", rl.Batched(), c.batched)
			}
		})
	}
	t.Run("on without batches", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		f := newFixture(t, "")
		f.Cfg.Stream.AllowBatch = false
		f.Cfg.BatchPublish = "on"
		f.Setup(ctx)
		rl, err := relay.New(f.Cfg, f.NC)
		if err != nil {
			t.Fatal(err)
		}
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		if err := rl.Run(rctx); err == nil || !strings.Contains(err.Error(), "allow_batched") {
			t.Fatalf("run: %v, want an error naming allow_batched", err)
		}
	})
	t.Run("disallowed mid-stream", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		f, rl := run(t, true, "")
		first := relaytest.Write(ctx, t, f.DB.Pool, load)
		f.WaitCount(ctx, f.Stream, uint64(len(first)), 60*time.Second)
		if !rl.Batched() {
			t.Fatal("not batched at first")
		}
		s, err := f.JS.Stream(ctx, f.Stream)
		if err != nil {
			t.Fatal(err)
		}
		cfg := s.CachedInfo().Config
		cfg.AllowBatchPublish = false
		if _, err := f.JS.UpdateStream(ctx, cfg); err != nil {
			t.Skipf("the server does not let a stream stop allowing batches: %v", err)
		}
		second := relaytest.Write(ctx, t, f.DB.Pool, load)
		check(t, f, append(first, second...))
		if rl.Batched() {
			t.Fatal("still batched after the stream stopped allowing it")
		}
	})
}

// Issue 12: Run threw its goroutines' errors away. A publisher whose NATS
// connection closed for good stopped, and the relay went on reading the
// WAL with nobody to publish it: Run returned only once a later row found
// the publisher closed. Run now ends with the publisher's error.
func TestRelayRunReturnsPublisherError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.Setup(ctx)
	nc, err := nats.Connect(f.NC.ConnectedUrl())
	if err != nil {
		t.Fatal(err)
	}
	rl, err := relay.New(f.Cfg, nc, relay.WithLogger(zaptest.NewLogger(t).Named("relay")))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { done <- rl.Run(rctx) }()
	if !testenv.WaitFor(30*time.Second, func() bool { return f.slot(ctx).Active }) {
		t.Fatal("the relay did not start streaming")
	}
	nc.Close()
	if _, err := f.DB.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload)
		VALUES ('00000000-0000-0000-0000-0000000000e1', 'order', 'o-1', 1, 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, publisher.ErrClosed) {
			t.Fatalf("Run: %v, want publisher.ErrClosed", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return after its publisher stopped for good")
	}
}

// sqlExec returns a function that runs one statement on pool and fails the
// test, naming the statement, when it fails: the statements the tests use
// to change the publication, the table or the rows under a running relay.
func sqlExec(t *testing.T, ctx context.Context, pool *pgxpool.Pool) func(sql string) {
	return func(sql string) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
}
