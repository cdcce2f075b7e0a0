package reconcile_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/cleanup"
	"github.com/outbox-relay/outbox-relay/internal/opstest"
	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/internal/reconcile"
	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/outbox"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

func config(f *opstest.Fixture, since time.Time) reconcile.Config {
	return reconcile.Config{
		Router: f.Cfg.Router, Stream: f.Stream, DeadLetterStream: f.DLQ, Slot: f.Cfg.Replication.Slot,
		Since: since, ConfirmWait: 15 * time.Second,
	}
}

func run(t *testing.T, f *opstest.Fixture, cfg reconcile.Config) *reconcile.Report {
	t.Helper()
	rep, err := reconcile.Run(context.Background(), f.DB.Pool, f.JS, cfg, reconcile.WithLogger(zaptest.NewLogger(t)))
	if err != nil {
		t.Fatalf("reconcile: %v", err)
	}
	return rep
}

func repair(t *testing.T, f *opstest.Fixture, evs []reconcile.Event) *reconcile.RepairReport {
	t.Helper()
	rr, err := reconcile.Repair(context.Background(), f.DB.Pool, f.JS, reconcile.RepairConfig{Router: f.Cfg.Router, Stream: f.Stream}, evs)
	if err != nil {
		t.Fatalf("repair: %v", err)
	}
	return rr
}

func ids(evs []reconcile.Event) []string {
	out := make([]string, len(evs))
	for i, e := range evs {
		out[i] = e.EventID
	}
	sort.Strings(out)
	return out
}

func sortedKeys(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// Acceptance 2, first half: events deleted from the stream by hand are
// reported missing, and --repair restores them in aggregate order with the
// router's subject and headers.
func TestReconcileFindsDeletedEventsAndRepairs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// A short duplicate window, so the deleted ids can be stored again soon.
	f := opstest.New(t, "", time.Second)
	f.Setup(ctx)
	f.Start(ctx)
	since := time.Now().Add(-time.Minute)
	w := f.NewWriter(20)
	evs := w.Write(ctx, 400, 10)
	f.WaitCount(ctx, f.Stream, 400, 30*time.Second)

	rep := run(t, f, config(f, since))
	if !rep.Confirmed || rep.Total.Rows != 400 || rep.Total.InStream != 400 || rep.Differences() != 0 || rep.Total.Duplicates != 0 {
		t.Fatalf("clean stream: %+v", rep.Total)
	}
	if len(rep.Groups) != 1 || rep.Groups[0].Table != "public.outbox" || rep.Groups[0].AggregateType != "registration" {
		t.Fatalf("groups %+v", rep.Groups)
	}

	// Versions 3, 4 and 5 of one aggregate and a few others.
	agg := evs[0].Aggregate
	deleted := map[string]bool{}
	for _, e := range evs {
		if e.Aggregate == agg && e.Version >= 3 && e.Version <= 5 {
			deleted[e.ID] = true
		}
	}
	for i := 100; len(deleted) < 10; i += 37 {
		deleted[evs[i].ID] = true
	}
	before := f.Read(ctx, f.Stream)
	subjectOf := map[string]string{}
	for _, m := range before {
		subjectOf[m.Event.ID] = m.Subject
	}
	if n := f.DeleteFromStream(ctx, deleted); n != 10 {
		t.Fatalf("deleted %d messages", n)
	}

	rep = run(t, f, config(f, since))
	if rep.Total.Missing != 10 || rep.Total.InStream != 390 || rep.Total.Pending != 0 || rep.Total.Unexpected != 0 {
		t.Fatalf("after deleting 10: %+v", rep.Total)
	}
	if got, want := ids(rep.Missing), sortedKeys(deleted); !equal(got, want) {
		t.Fatalf("missing %v, want %v", got, want)
	}

	// The stream drops ids still in its duplicate window: repair until
	// every event is stored again.
	published := 0
	if !testenv.WaitFor(20*time.Second, func() bool {
		rr := repair(t, f, rep.Missing)
		if len(rr.Failed) > 0 {
			t.Fatalf("repair failures: %+v", rr.Failed)
		}
		published += rr.Published
		rep = run(t, f, config(f, since))
		return rep.Total.Missing == 0
	}) {
		t.Fatalf("still missing after repairs: %+v", rep.Total)
	}
	if published != 10 || rep.Total.InStream != 400 || rep.Total.Duplicates != 0 || rep.Differences() != 0 {
		t.Fatalf("after repair: published %d, %+v", published, rep.Total)
	}

	// Repaired events: same subject and payload, no commit headers, a
	// repair mark, and the aggregate's versions in order.
	stored := map[string]relaytest.Event{}
	for _, e := range evs {
		stored[e.ID] = e
	}
	seqOf := map[int64]uint64{}
	for _, m := range f.Read(ctx, f.Stream) {
		if !deleted[m.Event.ID] {
			continue
		}
		e := stored[m.Event.ID]
		if m.Subject != subjectOf[m.Event.ID] || string(m.Data) != e.Payload || m.Event.AggregateVersion != e.Version {
			t.Errorf("repaired %s: subject %q data %s version %d, want %q %s %d", e.ID, m.Subject, m.Data, m.Event.AggregateVersion, subjectOf[e.ID], e.Payload, e.Version)
		}
		h := nats.Header(m.Headers)
		if h.Get(contract.CommitLSN) != "" || h.Get(contract.CommitTime) != "" || h.Get(reconcile.RepairedAtHeader) == "" ||
			h.Get(contract.MsgID) != e.ID || h.Get(contract.OccurredAt) == "" {
			t.Errorf("repaired %s headers %v", e.ID, m.Headers)
		}
		if e.Aggregate == agg {
			seqOf[e.Version] = m.Seq
		}
	}
	if !(seqOf[3] < seqOf[4] && seqOf[4] < seqOf[5]) {
		t.Errorf("repaired versions 3, 4, 5 at sequences %d, %d, %d: out of order", seqOf[3], seqOf[4], seqOf[5])
	}
}

// Acceptance 2, second half: the slot is dropped and recreated (what a lost
// slot's runbook does); the events committed without a slot are found and,
// republished before the relay restarts, leave nothing missing, no
// duplicate and every aggregate in order.
func TestReconcileAfterSlotRecreated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := opstest.New(t, "", 0)
	f.Setup(ctx)
	_, stop := f.Start(ctx)
	since := time.Now().Add(-time.Minute)
	w := f.NewWriter(10)
	all := w.Write(ctx, 200, 5)
	f.WaitCount(ctx, f.Stream, 200, 30*time.Second)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if !testenv.WaitFor(10*time.Second, func() bool {
		_, err := replication.DropSlot(ctx, f.Cfg.Replication)
		if err != nil && !errors.Is(err, replication.ErrSlotInUse) {
			t.Fatal(err)
		}
		return err == nil
	}) {
		t.Fatal("slot stays in use after the relay stopped")
	}
	lost := w.Write(ctx, 150, 5) // no slot: never decoded
	all = append(all, lost...)
	f.Setup(ctx)
	all = append(all, w.Write(ctx, 50, 5)...) // in the new slot, not yet relayed

	// No relay runs: the new slot cannot confirm, so these are pending.
	cfg := config(f, since)
	cfg.ConfirmWait = -1
	rep := run(t, f, cfg)
	if rep.Confirmed || rep.Total.Pending != 200 || rep.Total.Missing != 0 || rep.Total.InStream != 200 {
		t.Fatalf("before repair: confirmed %v, %+v", rep.Confirmed, rep.Total)
	}
	rr := repair(t, f, rep.Pending)
	if rr.Published != 200 || len(rr.Failed) != 0 {
		t.Fatalf("repair: %+v", rr)
	}

	// The relay re-sends the 50 rows the new slot holds: the stream's
	// duplicate window drops them.
	f.Start(ctx)
	all = append(all, w.Write(ctx, 50, 5)...)
	f.WaitCount(ctx, f.Stream, 450, 30*time.Second)
	rep = run(t, f, config(f, since))
	if !rep.Confirmed || rep.Total.Rows != 450 || rep.Total.InStream != 450 || rep.Differences() != 0 || rep.Total.Duplicates != 0 {
		t.Fatalf("after repair: %+v", rep.Total)
	}
	if chk := relaytest.Check(all, f.Read(ctx, f.Stream)); !chk.OK() || chk.Received != 450 {
		t.Fatalf("stream: %s", chk)
	}
}

// Dead-lettered rows are accounted for, not missing; an event without a
// row is unexpected; a row that cannot be routed is not republished, and
// the later events of its aggregate wait behind it.
//
// Issue 26: on a partitioned stream the stored subject was matched against
// the router's filters, so "unexpected" was never reported there. Both
// layouts now.
func TestReconcileDeadLettersUnexpectedAndUnroutable(t *testing.T) {
	t.Parallel()
	for _, l := range layouts {
		t.Run(l.name, func(t *testing.T) {
			t.Parallel()
			f := opstest.New(t, "", time.Second)
			l.apply(f)
			testDeadLettersUnexpectedAndUnroutable(t, f)
		})
	}
}

func testDeadLettersUnexpectedAndUnroutable(t *testing.T, f *opstest.Fixture) {
	ctx := context.Background()
	if _, err := f.DB.Pool.Exec(ctx, "ALTER TABLE outbox ALTER COLUMN event_type DROP NOT NULL"); err != nil {
		t.Fatal(err)
	}
	f.Setup(ctx)
	f.Start(ctx)
	since := time.Now().Add(-time.Minute)
	ins := func(id, agg string, v int, typ any) {
		t.Helper()
		if _, err := f.DB.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ($1, 'order', $2, $3, $4, '{}')`, id, agg, v, typ); err != nil {
			t.Fatal(err)
		}
	}
	bad, after := uuid.NewString(), uuid.NewString()
	for v := 1; v <= 3; v++ {
		ins(uuid.NewString(), "a", v, "Created")
	}
	ins(bad, "b", 1, nil) // NULL event type: dead-lettered
	ins(after, "b", 2, "Updated")
	f.WaitCount(ctx, f.Stream, 4, 30*time.Second)
	f.WaitCount(ctx, f.DLQ, 1, 30*time.Second)

	// An event nobody wrote to this database.
	stray := nats.NewMsg(f.Prefix + ".order.zzz")
	stray.Header.Set(contract.MsgID, uuid.NewString())
	stray.Header.Set(contract.EventID, stray.Header.Get(contract.MsgID))
	stray.Header.Set(contract.Table, "public.outbox")
	stray.Header.Set(contract.AggregateType, "order")
	stray.Header.Set(contract.OccurredAt, time.Now().UTC().Format(time.RFC3339Nano))
	if _, err := f.JS.PublishMsg(ctx, stray); err != nil {
		t.Fatal(err)
	}

	rep := run(t, f, config(f, since))
	if rep.Total.Rows != 5 || rep.Total.InStream != 4 || rep.Total.DeadLettered != 1 || rep.Total.Missing != 0 || rep.Total.Unexpected != 1 {
		t.Fatalf("report %+v", rep.Total)
	}
	if rep.DeadLettered[0].EventID != bad || rep.Unexpected[0].EventID != stray.Header.Get(contract.EventID) || rep.DeadLetterMessages != 1 {
		t.Fatalf("dead-lettered %+v, unexpected %+v", rep.DeadLettered, rep.Unexpected)
	}

	// Discard the dead letter and lose the later event: both are missing;
	// the unroutable row cannot be republished and holds the other back.
	dlq, err := f.JS.Stream(ctx, f.DLQ)
	if err != nil {
		t.Fatal(err)
	}
	if err := dlq.Purge(ctx); err != nil {
		t.Fatal(err)
	}
	f.DeleteFromStream(ctx, map[string]bool{after: true})
	rep = run(t, f, config(f, since))
	if got := ids(rep.Missing); !equal(got, ids([]reconcile.Event{{EventID: bad}, {EventID: after}})) {
		t.Fatalf("missing %v", got)
	}
	rr := repair(t, f, rep.Missing)
	if rr.Published != 0 || len(rr.Failed) != 2 || rr.Failed[0].Event.EventID != bad || rr.Failed[1].Event.EventID != after {
		t.Fatalf("repair %+v", rr)
	}
}

// Rows the relay has not confirmed are pending, not missing.
func TestReconcilePendingUntilConfirmed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := opstest.New(t, "", 0)
	f.Setup(ctx)
	f.CreateStreams(ctx)
	since := time.Now().Add(-time.Minute)
	f.NewWriter(3).Write(ctx, 10, 2)
	cfg := config(f, since)
	cfg.ConfirmWait = 200 * time.Millisecond
	rep := run(t, f, cfg)
	if rep.Confirmed || rep.Total.Pending != 10 || rep.Total.Missing != 0 || rep.ConfirmedLSN == "" {
		t.Fatalf("without a relay: confirmed %v, %+v", rep.Confirmed, rep.Total)
	}
	f.Start(ctx)
	rep = run(t, f, config(f, since))
	if !rep.Confirmed || rep.Total.InStream != 10 || rep.Differences() != 0 {
		t.Fatalf("with the relay: %+v", rep.Total)
	}
}

// The loop reports each run to its observer, only while active.
func TestLoop(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	f := opstest.New(t, "", 0)
	f.Setup(ctx)
	f.Start(ctx)
	f.NewWriter(2).Write(ctx, 4, 1)
	f.WaitCount(ctx, f.Stream, 4, 30*time.Second)
	obs := make(chan *reconcile.Report, 10)
	var active bool
	activeCh := make(chan bool, 1)
	activeCh <- false
	loop, err := reconcile.NewLoop(f.DB.Pool, f.JS, reconcile.LoopConfig{
		Config:   config(f, time.Time{}),
		Interval: 100 * time.Millisecond,
		Window:   time.Hour,
		Active: func() bool {
			select {
			case active = <-activeCh:
			default:
			}
			return active
		},
	}, observerFunc(func(rep *reconcile.Report, err error) {
		if err != nil {
			t.Errorf("loop run: %v", err)
			return
		}
		obs <- rep
	}))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- loop.Run(ctx) }()
	select {
	case <-obs:
		t.Fatal("the loop ran while inactive")
	case <-time.After(400 * time.Millisecond):
	}
	activeCh <- true
	select {
	case rep := <-obs:
		if rep.Total.Rows != 4 || rep.Total.InStream != 4 {
			t.Fatalf("loop report %+v", rep.Total)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("no report from the loop")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("loop returned %v", err)
	}
}

type observerFunc func(*reconcile.Report, error)

func (f observerFunc) Reconciled(r *reconcile.Report, err error) { f(r, err) }

// Bad input gets an error that names what to fix.
func TestReconcileErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := opstest.New(t, "", 0)
	f.Setup(ctx)
	since := time.Now().Add(-time.Hour)
	try := func(cfg reconcile.Config) error {
		_, err := reconcile.Run(ctx, f.DB.Pool, f.JS, cfg)
		return err
	}
	cfg := config(f, since)
	cfg.Since = time.Time{}
	if err := try(cfg); !errors.Is(err, reconcile.ErrInvalidConfig) {
		t.Errorf("no since: %v", err)
	}
	cfg = config(f, since)
	cfg.Router.Tables = append(cfg.Router.Tables[:0:0], cfg.Router.Tables...)
	cfg.Router.Tables[0].Table = "public.nope"
	if err := try(cfg); !errors.Is(err, reconcile.ErrTableMissing) {
		t.Errorf("missing table: %v", err)
	}
	if _, err := f.DB.Pool.Exec(ctx, "CREATE TABLE notime (event_id uuid, aggregate_id text, aggregate_version bigint, event_type text, payload jsonb)"); err != nil {
		t.Fatal(err)
	}
	cfg.Router.Tables[0].Table = "public.notime"
	if err := try(cfg); !errors.Is(err, reconcile.ErrNoTimeColumn) {
		t.Errorf("no time column: %v", err)
	}
	f.NewWriter(2).Write(ctx, 5, 5)
	cfg = config(f, since)
	cfg.MaxRows = 3
	if err := try(cfg); !errors.Is(err, reconcile.ErrTooManyRows) {
		t.Errorf("too many rows: %v", err)
	}
}

func TestSortEvents(t *testing.T) {
	evs := []reconcile.Event{
		{Table: "public.b", AggregateID: "x", AggregateVersion: "1"},
		{Table: "public.a", AggregateType: "t", AggregateID: "y", AggregateVersion: "10"},
		{Table: "public.a", AggregateType: "t", AggregateID: "y", AggregateVersion: "9"},
		{Table: "public.a", AggregateType: "t", AggregateID: "x", AggregateVersion: "-1"},
		{Table: "public.a", AggregateType: "s", AggregateID: "z", AggregateVersion: "2"},
	}
	reconcile.SortEvents(evs)
	var got []string
	for _, e := range evs {
		got = append(got, e.Table+"/"+e.AggregateType+"/"+e.AggregateID+"/"+e.AggregateVersion)
	}
	want := []string{"public.a/s/z/2", "public.a/t/x/-1", "public.a/t/y/9", "public.a/t/y/10", "public.b//x/1"}
	if !equal(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// setMaxMsgs changes the event stream's max_msgs limit (-1: none).
func setMaxMsgs(t *testing.T, f *opstest.Fixture, n int64) {
	t.Helper()
	ctx := context.Background()
	s, err := f.JS.Stream(ctx, f.Stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cfg := info.Config
	cfg.MaxMsgs = n
	if _, err := f.JS.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
}

// Issue 17, case 5: events the stream's limits removed (max_age,
// max_msgs) were reported missing and --repair republished them, although
// consumers may have applied them and pruned their dedup rows since. Rows
// older than the stream's first stored message are now expired: reported,
// never repaired; a row lost after it is still missing.
func TestReconcileReportsEventsExpiredByStreamLimits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := opstest.New(t, "", time.Second)
	f.Setup(ctx)
	f.Start(ctx)
	since := time.Now().Add(-time.Minute)
	w := f.NewWriter(5)
	old := w.Write(ctx, 30, 5)
	f.WaitCount(ctx, f.Stream, 30, 30*time.Second)
	setMaxMsgs(t, f, 10) // the first 20 events go
	s, err := f.JS.Stream(ctx, f.Stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil || info.State.FirstSeq != 21 {
		t.Fatalf("stream after max_msgs 10: %+v, %v", info.State, err)
	}
	// Rows dated a clock-skew margin after the first stored message.
	const skew = time.Second
	if !testenv.WaitFor(10*time.Second, func() bool { return time.Now().After(info.State.FirstTime.Add(skew + 100*time.Millisecond)) }) {
		t.Fatal("clock does not move")
	}
	// A limit stays (issue 26: only the stream's limits explain a removal
	// from its head), high enough to remove nothing more.
	setMaxMsgs(t, f, 1000)
	young := w.Write(ctx, 5, 5)
	f.WaitCount(ctx, f.Stream, 15, 30*time.Second)
	lost := map[string]bool{young[2].ID: true}
	if n := f.DeleteFromStream(ctx, lost); n != 1 {
		t.Fatalf("deleted %d", n)
	}

	cfg := config(f, since)
	cfg.ClockSkew = skew
	rep := run(t, f, cfg)
	tot := rep.Total
	if tot.Rows != 35 || tot.InStream != 14 || tot.Expired != 20 || tot.Missing != 1 || tot.Pending != 0 {
		t.Fatalf("report %+v, want 14 in stream, 20 expired, 1 missing", tot)
	}
	if got, want := ids(rep.Missing), sortedKeys(lost); len(got) != 1 || got[0] != want[0] {
		t.Errorf("missing %v, want %v", got, want)
	}
	expired := map[string]bool{}
	for _, e := range old[:20] {
		expired[e.ID] = true
	}
	if got, want := ids(rep.Expired), sortedKeys(expired); len(got) != len(want) || got[0] != want[0] {
		t.Errorf("expired %v, want %v", got, want)
	}
	if rep.ExpiredBefore == nil || rep.Differences() != 1 {
		t.Errorf("expired before %v, differences %d", rep.ExpiredBefore, rep.Differences())
	}
	// Repair republishes the lost event only.
	time.Sleep(1100 * time.Millisecond) // past the 1s duplicate window
	if rr := repair(t, f, rep.Missing); rr.Published != 1 {
		t.Fatalf("repair: %+v", rr)
	}
	if n := relaytest.StreamCount(ctx, f.JS, f.Stream); n != 15 {
		t.Errorf("stream holds %d events after the repair, want 15", n)
	}
}

// Issue 26: deleting the stream's first message by hand (the runbook
// "Events deleted from the stream", seq 1 and 5) turned missing rows into
// "expired": any first sequence above 1 was blamed on the limits, so
// reconcile exited 0 and repair published nothing. A stream without limits
// removes nothing by itself: both rows are missing and repaired, in both
// layouts.
func TestReconcileHandDeletedHeadIsMissingNotExpired(t *testing.T) {
	t.Parallel()
	for _, l := range layouts {
		t.Run(l.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			f := opstest.New(t, "", time.Second)
			l.apply(f)
			f.Setup(ctx)
			f.Start(ctx)
			since := time.Now().Add(-time.Minute)
			f.NewWriter(5).Write(ctx, 10, 5)
			f.WaitCount(ctx, f.Stream, 10, 30*time.Second)
			s, err := f.JS.Stream(ctx, f.Stream)
			if err != nil {
				t.Fatal(err)
			}
			for _, seq := range []uint64{1, 5} {
				if err := s.DeleteMsg(ctx, seq); err != nil {
					t.Fatal(err)
				}
			}
			rep := run(t, f, config(f, since))
			if tot := rep.Total; tot.Missing != 2 || tot.Expired != 0 || tot.InStream != 8 || rep.ExpiredBefore != nil {
				t.Fatalf("after deleting seq 1 and 5: %+v, expired before %v; want 2 missing, none expired", tot, rep.ExpiredBefore)
			}
			time.Sleep(1100 * time.Millisecond) // past the 1s duplicate window
			if rr := repair(t, f, rep.Missing); rr.Published != 2 {
				t.Fatalf("repair: %+v", rr)
			}
			if rep = run(t, f, config(f, since)); rep.Differences() != 0 || rep.Total.InStream != 10 {
				t.Fatalf("after repair: %+v", rep.Total)
			}
		})
	}
}

// Issue 17, case 6: a row dated ahead of its commit (a writer's clock, a
// business time) has its event stored before the window's scan starts:
// reconcile reported it missing and --repair stored a second copy. Run now
// looks rows not found up by subject, and Repair does so before it
// publishes.
//
// Issue 26: on a partitioned stream the look-up filtered on the published
// subject while the stream stores the partitioned one, so it never
// matched: every repair stored another copy. Both layouts now: found by
// subject, and a repair run twice stores nothing either time.
func TestReconcileFutureDatedRowIsNotMissing(t *testing.T) {
	t.Parallel()
	for _, l := range layouts {
		t.Run(l.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			f := opstest.New(t, "", time.Second) // a short duplicate window
			l.apply(f)
			f.Setup(ctx)
			f.Start(ctx)
			w := f.NewWriter(3)
			w.Age = -3 * time.Minute // dated now+3m
			evs := w.Write(ctx, 3, 3)
			f.WaitCount(ctx, f.Stream, 3, 30*time.Second)
			time.Sleep(1100 * time.Millisecond) // past the duplicate window

			now := time.Now()
			cfg := config(f, now.Add(150*time.Second))
			cfg.Until = now.Add(4 * time.Minute)
			rep := run(t, f, cfg)
			if rep.Total.Rows != 3 || rep.Total.InStream != 3 || rep.Total.Missing != 0 || rep.FoundBySubject != 3 {
				t.Fatalf("future-dated rows: %+v (found by subject %d), want 3 in stream", rep.Total, rep.FoundBySubject)
			}
			// Repair, handed the rows anyway (e.g. from an older report),
			// stores no second copy, however often it runs.
			var todo []reconcile.Event
			for _, e := range evs {
				todo = append(todo, reconcile.Event{Table: "public.outbox", AggregateType: "registration", AggregateID: e.Aggregate, AggregateVersion: "1", EventID: e.ID})
			}
			for i := 1; i <= 2; i++ {
				if rr := repair(t, f, todo); rr.Published != 0 || rr.AlreadyInStream != 3 {
					t.Fatalf("repair #%d of events in the stream: %+v", i, rr)
				}
			}
			if n := relaytest.StreamCount(ctx, f.JS, f.Stream); n != 3 {
				t.Fatalf("stream holds %d messages, want 3", n)
			}
		})
	}
}

// layouts are the event stream's subject layouts every stream-reading
// test runs in: events stored as published, and partitioned for consumer
// groups (nats.partitions).
var layouts = []struct {
	name  string
	apply func(*opstest.Fixture)
}{
	{"plain", func(*opstest.Fixture) {}},
	{"partitioned", func(f *opstest.Fixture) { f.Partition(8) }},
}

// Issue 17, case 7: with messages: configured, reconcile, cleanup and the
// relay's reconcile loop failed with "outbox table does not exist:
// pg_logical_message.outbox". Messages are not tables (issue 26: their own
// router.Config.Messages): the report names the prefixes it cannot check,
// and their events are not unexpected.
func TestReconcileAndCleanupWithMessagePrefixes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := opstest.New(t, "", 0)
	f.Cfg.Router.Messages = append(f.Cfg.Router.Messages, router.MessageConfig{Prefix: "outbox", Subject: f.Prefix + ".msg.{aggregate_id}"})
	if err := f.Cfg.Router.Validate(); err != nil {
		t.Fatal(err)
	}
	f.Setup(ctx)
	f.Start(ctx)
	since := time.Now().Add(-time.Minute)
	f.NewWriter(2).Write(ctx, 5, 5)
	tx, err := f.DB.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := outbox.EmitMessage(ctx, tx, "outbox", outbox.Event{AggregateID: "m1", AggregateVersion: 1, Type: "E", Payload: json.RawMessage(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	f.WaitCount(ctx, f.Stream, 6, 30*time.Second)

	rep := run(t, f, config(f, since))
	if rep.Total.Rows != 5 || rep.Total.InStream != 5 || rep.Differences() != 0 || len(rep.Tableless) != 1 || rep.Tableless[0] != "outbox" {
		t.Fatalf("report %+v, tableless %q", rep.Total, rep.Tableless)
	}
	crep, err := cleanup.Run(ctx, f.DB.Pool, f.JS, cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, OlderThan: time.Nanosecond, StoredMargin: time.Nanosecond}, cleanup.WithMinStoredMargin(0))
	if err != nil || len(crep.Tables) != 1 || crep.Tables[0].Deleted != 5 {
		t.Fatalf("cleanup: %+v, %v", crep, err)
	}
}

// Issue 17, case 10: in a table without NOT NULL on the event id, one row
// with a NULL id aborted the whole reconcile ("cannot scan NULL into
// *string"). Such rows are reported (the relay dead-letters them) and the
// other rows are reconciled.
func TestReconcileReportsRowsWithoutEventID(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := opstest.New(t, "", 0)
	if _, err := f.DB.Pool.Exec(ctx, "ALTER TABLE outbox ALTER COLUMN event_id DROP NOT NULL"); err != nil {
		t.Fatal(err)
	}
	f.Setup(ctx)
	f.Start(ctx)
	since := time.Now().Add(-time.Minute)
	f.NewWriter(2).Write(ctx, 4, 2)
	if _, err := f.DB.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES (NULL, 'registration', 'no-id', 1, 'E', '{}')`); err != nil {
		t.Fatal(err)
	}
	f.WaitCount(ctx, f.Stream, 4, 30*time.Second)
	f.WaitCount(ctx, f.DLQ, 1, 30*time.Second)
	rep := run(t, f, config(f, since))
	if rep.Total.Rows != 4 || rep.Total.InStream != 4 || rep.Total.NoEventID != 1 || len(rep.NoEventID) != 1 || rep.NoEventID[0].AggregateID != "no-id" || rep.Differences() != 0 {
		t.Fatalf("report %+v, rows without id %+v", rep.Total, rep.NoEventID)
	}
}

// Issue 17, likely cases: the scans filtered by today's subject templates
// and skipped events without Outbox-Table. After a template change the
// older events looked missing (and repair duplicated them). The streams
// are now read whole and keyed on Outbox-Table.
//
// Issue 26: an event without Outbox-Table matched a row of any table with
// its id, so another producer's message with a colliding Nats-Msg-Id let
// cleanup delete a row never relayed. Such a message now proves nothing:
// its rows stay pending (no slot here) and cleanup keeps them.
func TestReconcileAndCleanupAfterTemplateChangeAndWithoutTableHeader(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := opstest.New(t, "", 0)
	f.CreateStreams(ctx)
	since := time.Now().Add(-time.Minute)
	w := f.NewWriter(3)
	w.Age = 2 * time.Hour
	since = since.Add(-3 * time.Hour)
	templated := w.Write(ctx, 5, 5)
	// Stored under the old template, with the relay's headers (a repair
	// publishes exactly what the relay would).
	var evs []reconcile.Event
	for _, e := range templated {
		evs = append(evs, reconcile.Event{Table: "public.outbox", AggregateType: "registration", AggregateID: e.Aggregate, AggregateVersion: strconv.FormatInt(e.Version, 10), EventID: e.ID})
	}
	if rr := repair(t, f, evs); rr.Published != 5 {
		t.Fatalf("publish: %+v", rr)
	}
	// A polling relay's events: the id as Nats-Msg-Id, no Outbox-* headers.
	polled := w.Write(ctx, 4, 4)
	for _, e := range polled {
		m := nats.NewMsg(f.Prefix + ".legacy." + e.Aggregate)
		m.Header.Set(contract.MsgID, e.ID)
		m.Data = []byte(e.Payload)
		if _, err := f.JS.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	// Today's template differs from the one the events were stored under.
	f.Cfg.Router.Tables[0].Subject = f.Prefix + ".v2.{aggregate_id}"
	if err := f.Cfg.Router.Validate(); err != nil {
		t.Fatal(err)
	}
	cfg := config(f, since)
	cfg.Slot = "" // no relay: what is not found is pending
	rep := run(t, f, cfg)
	if rep.Total.Rows != 9 || rep.Total.InStream != 5 || rep.Total.Pending != 4 || rep.Total.Unexpected != 0 {
		t.Fatalf("report %+v, want the 5 templated rows in the stream, the 4 polled ones pending", rep.Total)
	}
	crep, err := cleanup.Run(ctx, f.DB.Pool, f.JS, cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, OlderThan: time.Hour, StoredMargin: time.Nanosecond}, cleanup.WithMinStoredMargin(0))
	if err != nil || crep.Tables[0].Deleted != 5 || crep.Tables[0].Remaining != 4 {
		t.Fatalf("cleanup: %+v, %v; want the 5 templated rows deleted, the 4 polled ones kept", crep, err)
	}
}

// Issue 17, likely cases: two rows with one event id (a partitioned
// table's unique constraints hold per partition only; here the constraint
// is dropped) gave a false "ok": keyed by id, one row replaced the other
// and the one stored event vouched for both. Rows with a NULL occurred_at
// are never selected. Both are now reported.
func TestReconcileReportsSharedIDsAndRowsWithoutTime(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := opstest.New(t, "", 0)
	if _, err := f.DB.Pool.Exec(ctx, "ALTER TABLE outbox DROP CONSTRAINT outbox_event_id_key, ALTER COLUMN occurred_at DROP NOT NULL"); err != nil {
		t.Fatal(err)
	}
	f.Setup(ctx)
	f.Start(ctx)
	since := time.Now().Add(-time.Minute)
	evs := f.NewWriter(2).Write(ctx, 3, 3)
	for _, q := range []string{
		`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ($1, 'registration', 'twin', 1, 'E', '{}')`,
		`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, occurred_at) VALUES (gen_random_uuid(), 'registration', 'timeless', 1, 'E', '{}', NULL) RETURNING $1::text`,
	} {
		if _, err := f.DB.Pool.Exec(ctx, q, evs[0].ID); err != nil {
			t.Fatal(err)
		}
	}
	f.WaitCount(ctx, f.Stream, 3, 30*time.Second) // the twin is a duplicate
	rep := run(t, f, config(f, since))
	if rep.Total.Rows != 3 || rep.Total.InStream != 3 || rep.Total.SharedID != 1 || len(rep.SharedID) != 1 || rep.Differences() != 1 {
		t.Fatalf("report %+v, shared %+v", rep.Total, rep.SharedID)
	}
	if rep.NoOccurredAt["public.outbox"] != 1 {
		t.Errorf("rows without occurred_at: %v", rep.NoOccurredAt)
	}
	crep, err := cleanup.Run(ctx, f.DB.Pool, f.JS, cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, OlderThan: time.Hour})
	if err != nil || crep.Tables[0].NoOccurredAt != 1 {
		t.Fatalf("cleanup: %+v, %v", crep, err)
	}
}

// Issue 26: a stream edited to keep one message per subject (discard old)
// deletes an aggregate's earlier events, which reconcile then reported
// missing (and repair stored again) and cleanup could not prove. Both
// tools now refuse such a stream, naming the fix.
func TestToolsRefuseStreamsThatDeleteEvents(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := opstest.New(t, "", 0)
	f.CreateStreams(ctx)
	s, err := f.JS.Stream(ctx, f.Stream)
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	cfg.MaxMsgsPerSubject = 1
	if _, err := f.JS.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	rcfg := config(f, time.Now().Add(-time.Hour))
	rcfg.Slot = ""
	if _, err := reconcile.Run(ctx, f.DB.Pool, f.JS, rcfg); !errors.Is(err, provision.ErrDeletesEvents) {
		t.Errorf("reconcile: %v, want ErrDeletesEvents", err)
	}
	if _, err := reconcile.Repair(ctx, f.DB.Pool, f.JS, reconcile.RepairConfig{Router: f.Cfg.Router, Stream: f.Stream}, nil); !errors.Is(err, provision.ErrDeletesEvents) {
		t.Errorf("repair: %v, want ErrDeletesEvents", err)
	}
	if _, err := cleanup.Run(ctx, f.DB.Pool, f.JS, cleanup.Config{Router: f.Cfg.Router, Stream: f.Stream, OlderThan: time.Hour, StoredMargin: time.Nanosecond}, cleanup.WithMinStoredMargin(0)); !errors.Is(err, provision.ErrDeletesEvents) {
		t.Errorf("cleanup: %v, want ErrDeletesEvents", err)
	}
}

// Issue 26: reconcile read its snapshot's WAL position with
// pg_current_wal_insert_lsn(), which fails during recovery, so it could
// not run against a standby that decodes (PostgreSQL 16+, docs/
// operations.md). It reads pg_last_wal_replay_lsn() there. Runs in the 15
// and 17 lanes (make test-pg17).
func TestReconcileOnStandby(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	primary, err := testenv.StartPostgres()
	testenv.Must(t, err, "start the primary")
	t.Cleanup(primary.Close)
	db := testenv.NewDatabaseOn(t, primary)
	db.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "outbox.sql"))
	standby, err := primary.StartStandby(testenv.StandbyOptions{})
	testenv.Must(t, err, "start the standby")
	t.Cleanup(standby.Close)
	f := opstest.New(t, "", 0) // the streams and the router's mapping
	f.CreateStreams(ctx)
	since := time.Now().Add(-time.Minute)
	var evs []reconcile.Event
	for i := range 5 {
		e := reconcile.Event{Table: "public.outbox", AggregateType: "registration", AggregateID: fmt.Sprintf("a%d", i), AggregateVersion: "1", EventID: uuid.NewString()}
		if _, err := db.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ($1, $2, $3, 1, 'E', '{}')`, e.EventID, e.AggregateType, e.AggregateID); err != nil {
			t.Fatal(err)
		}
		evs = append(evs, e)
	}
	// The events, stored as the relay would.
	if rr, err := reconcile.Repair(ctx, db.Pool, f.JS, reconcile.RepairConfig{Router: f.Cfg.Router, Stream: f.Stream}, evs); err != nil || rr.Published != 5 {
		t.Fatalf("publish: %+v, %v", rr, err)
	}
	var lsn string
	testenv.Must(t, db.Pool.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&lsn), "primary LSN") // past the commits, flushed soon (asynchronous commit)
	testenv.Must(t, standby.WaitReplayed(ctx, lsn), "replay")
	sp, err := pgxpool.New(ctx, standby.URL(db.Name))
	testenv.Must(t, err, "connect to the standby")
	t.Cleanup(sp.Close)
	rep, err := reconcile.Run(ctx, sp, f.JS, reconcile.Config{Router: f.Cfg.Router, Stream: f.Stream, DeadLetterStream: f.DLQ, Since: since}, reconcile.WithLogger(zaptest.NewLogger(t)))
	if err != nil {
		t.Fatalf("reconcile on the standby: %v", err)
	}
	if rep.Total.Rows != 5 || rep.Total.InStream != 5 || !rep.Confirmed || rep.Differences() != 0 || rep.SnapshotLSN == "" {
		t.Fatalf("report on the standby: %+v (snapshot %s)", rep.Total, rep.SnapshotLSN)
	}
}
