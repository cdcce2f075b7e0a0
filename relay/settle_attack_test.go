package relay_test

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/router"
)

// Adversarial review of issue 25 (third round, replication/settle.go): a
// transaction that inserts an outbox row DURING a publication gap and
// stays open (idle in transaction, or busy in a long statement) while the
// relay fills the gap from the table, committing only once the relay
// streams again. The fill's snapshot cannot see its row; pgoutput decodes
// its change with the catalog as of the change, when the publication did
// not publish the table. Its row must still reach the stream, before the
// aggregate's next version.
//
// table_dropped: ALTER PUBLICATION … DROP TABLE, insert, ADD TABLE.
// recreated: DROP PUBLICATION, insert, CREATE PUBLICATION.
// recreated_without_table: DROP PUBLICATION, CREATE PUBLICATION for
// another table, insert, ALTER PUBLICATION … ADD TABLE outbox.
// savepoint: table_dropped with the insert in a released savepoint.
// quiet: nothing else is written between the fix of the publication and
// the writer's commit, so the writer's change is the first the session
// decodes after the publication changed; busy: rows are written and
// relayed in between.
func TestRelayGapWriterCommitsAfterFill(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, before, after string
		savepoint           bool
	}{
		{name: "table_dropped", before: "ALTER PUBLICATION {pub} DROP TABLE outbox", after: "ALTER PUBLICATION {pub} ADD TABLE outbox"},
		{name: "savepoint", before: "ALTER PUBLICATION {pub} DROP TABLE outbox", after: "ALTER PUBLICATION {pub} ADD TABLE outbox", savepoint: true},
		{name: "recreated", before: "DROP PUBLICATION {pub}", after: "CREATE PUBLICATION {pub} FOR TABLE outbox WITH (publish = 'insert')"},
		{name: "recreated_without_table",
			before: "DROP PUBLICATION {pub}; CREATE TABLE gap_other (id int); CREATE PUBLICATION {pub} FOR TABLE gap_other WITH (publish = 'insert')",
			after:  "ALTER PUBLICATION {pub} ADD TABLE outbox"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			boolSubtests(t, "quiet", "busy", func(t *testing.T, busy bool) {
				gapWriterCommitsAfterFill(t, tc.before, tc.after, tc.savepoint, busy)
			})
		})
	}
}

func gapWriterCommitsAfterFill(t *testing.T, before, after string, savepoint, busy bool) {
	ctx := context.Background()
	f := newFixture(t, "")
	s := startStreaming(t, ctx, f)
	rl, pub, exec, w, all := s.rl, s.pub, s.exec, s.w, s.all

	exec(fmtPub(before, pub))
	if !testenv.WaitFor(10*time.Second, func() bool { return rl.PublicationProblem() != nil }) {
		t.Fatal("the publication change was not noticed")
	}
	// The gap's writer: inserts now, commits after the fill.
	tx, err := f.DB.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	agg := "gapw-" + f.Stream[2:8]
	v1 := relaytest.Event{ID: uuid.NewString(), Aggregate: agg, Version: 1, Payload: `{"n": 1}`}
	if savepoint {
		txExec(t, ctx, tx, "SAVEPOINT s1")
	}
	txExec(t, ctx, tx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ($1, 'registration', $2, 1, 'RegistrationConfirmed', $3)`,
		v1.ID, v1.Aggregate, v1.Payload)
	if savepoint {
		txExec(t, ctx, tx, "RELEASE SAVEPOINT s1")
	}
	all = append(all, w.Write(ctx, 50, 5)...)
	exec(fmtPub(after, pub))
	if busy {
		all = append(all, w.Write(ctx, 50, 5)...)
	}
	// The fill waits for the writer, which may hold rows of the gap, and
	// says so; or the relay streams on and relays its row once committed.
	waiting := func() bool { return strings.Contains(rl.NotReadyReason(), "still open") }
	if !testenv.WaitFor(30*time.Second, func() bool {
		return waiting() || rl.PublicationProblem() == nil && relaytest.StreamCount(ctx, f.JS, f.Stream) >= uint64(len(all))
	}) {
		t.Fatalf("%d of %d events relayed 30 s after the publication was right again, and the relay does not say it waits for the writer: %v",
			relaytest.StreamCount(ctx, f.JS, f.Stream), len(all), rl.PublicationProblem())
	}
	if busy && !waiting() {
		// The relay streams again (rows only the slot delivers are relayed).
		all = append(all, w.Write(ctx, 10, 5)...)
		f.WaitCount(ctx, f.Stream, uint64(len(all)), 30*time.Second)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	v2 := relaytest.Event{ID: uuid.NewString(), Aggregate: agg, Version: 2, Payload: `{"n": 2}`}
	exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ('` + v2.ID + `', 'registration', '` + agg + `', 2, 'RegistrationConfirmed', '{"n": 2}')`)
	all = append(all, v1, v2)
	all = append(all, w.Write(ctx, 10, 5)...)
	var now uint64
	if err := f.DB.Pool.QueryRow(ctx, "SELECT (pg_current_wal_lsn() - '0/0')::bigint").Scan(&now); err != nil {
		t.Fatal(err)
	}
	ok := testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.JS, f.Stream) >= uint64(len(all)) })
	got := f.Read(ctx, f.Stream)
	if !ok {
		var seen []int64
		for _, m := range got {
			if m.Event.AggregateID == agg {
				seen = append(seen, m.Event.AggregateVersion)
			}
		}
		// Lost, or only late: is the slot confirmed past it?
		testenv.WaitFor(5*time.Second, func() bool { return uint64(f.slot(ctx).ConfirmedFlushLSN) >= now })
		t.Fatalf("the row inserted during the gap by a transaction that committed after the fill: %d of %d events relayed, versions of %s in the stream %v, slot confirmed %s (WAL was %X after the commit), problem %v",
			len(got), len(all), agg, seen, f.slot(ctx).ConfirmedFlushLSN, now, rl.PublicationProblem())
	}
	if rep := relaytest.Check(all, got); !rep.OK() {
		t.Fatalf("stream check: %s", rep)
	}
	if !testenv.WaitFor(30*time.Second, func() bool { return !errors.Is(rl.PublicationProblem(), relay.ErrPublicationGap) }) {
		t.Fatalf("gap still open: %v", rl.PublicationProblem())
	}
}

func txExec(t *testing.T, ctx context.Context, tx pgx.Tx, sql string, args ...any) {
	t.Helper()
	if _, err := tx.Exec(ctx, sql, args...); err != nil {
		t.Fatal(err)
	}
}

// fmtPub puts the quoted publication name in for {pub}.
func fmtPub(s, pub string) string { return strings.ReplaceAll(s, "{pub}", pub) }

// TestRelayGapActiveWriter: the gap's writer inserts an outbox row during
// the gap and stays active in one long statement (BEGIN; INSERT; a 4 s
// statement; COMMIT sent as one query), committing after the publication
// is right again: the fill must wait for it or the stream relay its row.
// Nothing else is written until it commits.
func TestRelayGapActiveWriter(t *testing.T) {
	t.Parallel()
	boolSubtests(t, "table_dropped", "recreated", func(t *testing.T, recreated bool) {
		before, after := "ALTER PUBLICATION {pub} DROP TABLE outbox", "ALTER PUBLICATION {pub} ADD TABLE outbox"
		if recreated {
			before, after = "DROP PUBLICATION {pub}", "CREATE PUBLICATION {pub} FOR TABLE outbox WITH (publish = 'insert')"
		}
		gapActiveWriter(t, before, after, "outbox", nil)
	})
}

// TestRelayGapActiveWriterOtherSchema: TestRelayGapActiveWriter/recreated
// with the writer in the second outbox table of the config, "Billing".outbox
// (a schema whose name needs quoting).
func TestRelayGapActiveWriterOtherSchema(t *testing.T) {
	t.Parallel()
	gapActiveWriter(t, "DROP PUBLICATION {pub}", `CREATE PUBLICATION {pub} FOR TABLE public.outbox, "Billing".outbox WITH (publish = 'insert')`,
		`"Billing".outbox`, func(f *fixture) {
			exec := sqlExec(t, context.Background(), f.DB.Pool)
			exec(`CREATE SCHEMA "Billing"`)
			exec(`CREATE TABLE "Billing".outbox (LIKE public.outbox INCLUDING ALL)`)
			f.Cfg.Replication.Tables = append(f.Cfg.Replication.Tables, "Billing.outbox")
			f.Cfg.Router.Tables = append(f.Cfg.Router.Tables, router.TableConfig{Table: "Billing.outbox", Subject: f.Prefix + ".billing.{aggregate_type}.{aggregate_id}"})
		})
}

// gapActiveWriter runs the scenario with the writer inserting into table
// (setup, if any, prepares the fixture before the relay starts).
func gapActiveWriter(t *testing.T, before, after, table string, setup func(*fixture)) {
	ctx := context.Background()
	f := newFixture(t, "")
	f.Cfg.PublicationCheck = 200 * time.Millisecond
	if setup != nil {
		setup(f)
	}
	f.Setup(ctx)
	rl, _ := f.Start(ctx)
	pub := `"` + f.Cfg.Replication.Publication + `"`
	exec := sqlExec(t, ctx, f.DB.Pool)
	w := f.NewWriter(5)
	all := w.Write(ctx, 50, 5)
	f.WaitCount(ctx, f.Stream, 50, 30*time.Second)
	exec(fmtPub(before, pub))
	if !testenv.WaitFor(10*time.Second, func() bool { return rl.PublicationProblem() != nil }) {
		t.Fatal("the publication change was not noticed")
	}
	agg := "gapa-" + f.Stream[2:8]
	v1 := relaytest.Event{ID: uuid.NewString(), Aggregate: agg, Version: 1, Payload: `{"n": 1}`}
	conn, err := f.DB.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var pid int
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := conn.Exec(ctx, `BEGIN; INSERT INTO `+table+` (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ('`+v1.ID+`', 'registration', '`+agg+`', 1, 'RegistrationConfirmed', '{"n": 1}'); SELECT pg_sleep(4); COMMIT`)
		done <- err
	}()
	if !testenv.WaitFor(10*time.Second, func() bool {
		var n int
		_ = f.DB.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE pid = $1 AND relation = to_regclass($2) AND mode = 'RowExclusiveLock'", pid, table).Scan(&n)
		return n > 0
	}) {
		t.Fatal("the writer did not insert")
	}
	all = append(all, w.Write(ctx, 50, 5)...)
	exec(fmtPub(after, pub))
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	v2 := relaytest.Event{ID: uuid.NewString(), Aggregate: agg, Version: 2, Payload: `{"n": 2}`}
	exec(`INSERT INTO ` + table + ` (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ('` + v2.ID + `', 'registration', '` + agg + `', 2, 'RegistrationConfirmed', '{"n": 2}')`)
	all = append(all, v1, v2)
	all = append(all, w.Write(ctx, 10, 5)...)
	ok := testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.JS, f.Stream) >= uint64(len(all)) })
	got := f.Read(ctx, f.Stream)
	if !ok {
		var seen []int64
		for _, m := range got {
			if m.Event.AggregateID == agg {
				seen = append(seen, m.Event.AggregateVersion)
			}
		}
		t.Fatalf("the row inserted into "+table+" during the gap by a writer active until it committed: %d of %d events relayed, versions of %s in the stream %v, problem %v",
			len(got), len(all), agg, seen, rl.PublicationProblem())
	}
	if rep := relaytest.Check(all, got); !rep.OK() {
		t.Fatalf("stream check: %s", rep)
	}
}

// TestRelayGapPreparedWriter: the gap's writer inserts an outbox row during
// the gap and PREPAREs its transaction; it is COMMIT PREPARED a few
// seconds after the publication is right again (a private cluster with
// max_prepared_transactions). The fill must wait for it or the stream
// relay its row, before the aggregate's next version.
func TestRelayGapPreparedWriter(t *testing.T) {
	t.Parallel()
	pg, err := testenv.StartPostgres(testenv.WithSetting("max_prepared_transactions", "10"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	boolSubtests(t, "table_dropped", "recreated", func(t *testing.T, recreated bool) {
		before, after := "ALTER PUBLICATION {pub} DROP TABLE outbox", "ALTER PUBLICATION {pub} ADD TABLE outbox"
		if recreated {
			before, after = "DROP PUBLICATION {pub}", "CREATE PUBLICATION {pub} FOR TABLE outbox WITH (publish = 'insert')"
		}
		gapPreparedWriter(t, pg, before, after)
	})
}

func gapPreparedWriter(t *testing.T, pg *testenv.Postgres, before, after string) {
	ctx := context.Background()
	f := newFixture(t, "")
	f.DB = testenv.NewDatabaseOn(t, pg)
	f.DB.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "outbox.sql"))
	f.Cfg.Replication.URL = f.DB.URL
	s := startStreaming(t, ctx, f)
	rl, pub, exec, w, all := s.rl, s.pub, s.exec, s.w, s.all
	exec(fmtPub(before, pub))
	if !testenv.WaitFor(10*time.Second, func() bool { return rl.PublicationProblem() != nil }) {
		t.Fatal("the publication change was not noticed")
	}
	agg := "gapp-" + f.Stream[2:8]
	gid := "g_" + f.Stream[2:10]
	v1 := relaytest.Event{ID: uuid.NewString(), Aggregate: agg, Version: 1, Payload: `{"n": 1}`}
	exec(`BEGIN; INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ('` + v1.ID + `', 'registration', '` + agg + `', 1, 'RegistrationConfirmed', '{"n": 1}'); PREPARE TRANSACTION '` + gid + `'`)
	defer func() { _, _ = f.DB.Pool.Exec(context.Background(), "ROLLBACK PREPARED '"+gid+"'") }()
	all = append(all, w.Write(ctx, 50, 5)...)
	exec(fmtPub(after, pub))
	// Commit once the fill is done, or after 6 s of a fill that waits
	// (for the prepared transaction, as it should).
	testenv.WaitFor(6*time.Second, func() bool { return rl.PublicationProblem() == nil })
	exec("COMMIT PREPARED '" + gid + "'")
	v2 := relaytest.Event{ID: uuid.NewString(), Aggregate: agg, Version: 2, Payload: `{"n": 2}`}
	exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ('` + v2.ID + `', 'registration', '` + agg + `', 2, 'RegistrationConfirmed', '{"n": 2}')`)
	all = append(all, v1, v2)
	all = append(all, w.Write(ctx, 10, 5)...)
	ok := testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.JS, f.Stream) >= uint64(len(all)) })
	got := f.Read(ctx, f.Stream)
	if !ok {
		var seen []int64
		for _, m := range got {
			if m.Event.AggregateID == agg {
				seen = append(seen, m.Event.AggregateVersion)
			}
		}
		t.Fatalf("the row of a transaction prepared during the gap and committed after: %d of %d events relayed, versions of %s in the stream %v, problem %v",
			len(got), len(all), agg, seen, rl.PublicationProblem())
	}
	if rep := relaytest.Check(all, got); !rep.OK() {
		t.Fatalf("stream check: %s", rep)
	}
}
