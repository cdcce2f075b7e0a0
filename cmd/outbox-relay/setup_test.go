package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
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

// Issue 27: a setup that fails changes nothing, or says what it left. A
// missing table left a backfill record and the event stream; a
// publication without the table read "publication does not exist"; a
// dead-letter subject held by another stream left the event stream and
// named the wrong key.
func TestFailedSetupLeavesNothing(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		prepare func(f *opsFixture)
		want    []string
		wantNot []string
	}{
		{"missing table", func(f *opsFixture) {
			f.setYAML("  - table: public.outbox\n", "  - table: public.missing\n")
		}, []string{"outbox table does not exist: table public.missing", "setup changed nothing"}, nil},
		{"publication without the table, role not its owner", func(f *opsFixture) {
			role := f.leastPrivilegeRole()
			f.exec("CREATE TABLE other_outbox (id int)", "CREATE PUBLICATION "+f.cfg.Postgres.Publication+" FOR TABLE other_outbox")
			f.setYAML("postgres@", role+"@")
		}, []string{"publication does not publish the outbox as the relay needs", "does not include table public.outbox", "ALTER PUBLICATION", "setup changed nothing"},
			[]string{"publication does not exist"}},
		{"no publication, role may not create it", func(f *opsFixture) {
			f.setYAML("postgres@", f.leastPrivilegeRole()+"@")
		}, []string{"publication \"" + f0 + "\" does not exist and permission denied for database", "sql/publication.sql", "setup changed nothing"}, nil},
		{"dead-letter subjects held by another stream", func(f *opsFixture) {
			if _, err := f.js.CreateStream(context.Background(), jetstream.StreamConfig{Name: f.stream + "_OTHER", Subjects: []string{f.cfg.Router.DeadLetterFilter()}}); err != nil {
				f.t.Fatal(err)
			}
		}, []string{"or change dead_letter_subject", "setup removed the streams it had created (" + f0 + ")"},
			[]string{"nats.stream_subjects"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newOpsFixture(t)
			tc.prepare(f)
			_, err := f.step("setup")
			if err == nil {
				t.Fatal("setup succeeded")
			}
			msg := strings.ReplaceAll(err.Error(), strings.ToLower(f.stream), f0)
			msg = strings.ReplaceAll(msg, f.stream, f0)
			for _, w := range tc.want {
				if !strings.Contains(msg, w) {
					t.Errorf("setup error lacks %q:\n%s", w, err)
				}
			}
			for _, w := range tc.wantNot {
				if strings.Contains(msg, w) {
					t.Errorf("setup error says %q:\n%s", w, err)
				}
			}
			f.assertNothingLeft()
		})
	}
}

// f0 stands for the fixture's stream and slot names in expected messages.
const f0 = "<NAME>"

// leastPrivilegeRole creates a role with REPLICATION and SELECT on the
// outbox that owns nothing, as README step 2 has it.
func (f *opsFixture) leastPrivilegeRole() string {
	role := testenv.UniqueName("relay")
	f.exec("CREATE ROLE "+role+" LOGIN REPLICATION", "GRANT SELECT ON outbox TO "+role)
	f.t.Cleanup(func() {
		_, _ = f.db.Pool.Exec(context.Background(), "DROP OWNED BY "+role)
		_, _ = f.db.Pool.Exec(context.Background(), "DROP ROLE IF EXISTS "+role)
	})
	return role
}

func (f *opsFixture) exec(stmts ...string) {
	f.t.Helper()
	for _, s := range stmts {
		if _, err := f.db.Pool.Exec(context.Background(), s); err != nil {
			f.t.Fatalf("%s: %v", s, err)
		}
	}
}

// assertNothingLeft fails unless the fixture's streams, slot and backfill
// record are absent.
func (f *opsFixture) assertNothingLeft() {
	f.t.Helper()
	ctx := context.Background()
	for _, name := range []string{f.stream, f.stream + "_DLQ"} {
		if _, err := f.js.Stream(ctx, name); !errors.Is(err, jetstream.ErrStreamNotFound) {
			f.t.Errorf("stream %s left behind (lookup: %v)", name, err)
		}
	}
	var slots, records int
	if err := f.db.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", f.cfg.Postgres.Slot).Scan(&slots); err != nil {
		f.t.Fatal(err)
	}
	if slots != 0 {
		f.t.Errorf("slot %s left behind", f.cfg.Postgres.Slot)
	}
	err := f.db.Pool.QueryRow(ctx, "SELECT count(*) FROM "+replication.BackfillTable+" WHERE slot_name = $1", f.cfg.Postgres.Slot).Scan(&records)
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UndefinedTable:
	case err != nil:
		f.t.Fatal(err)
	case records != 0:
		f.t.Errorf("a backfill record of slot %s left behind", f.cfg.Postgres.Slot)
	}
}

// Issue 27: with a wrong password setup created the streams, then printed
// pgconn's text, which ends with the refused TLS attempt, without run's
// hint. It checks PostgreSQL first and leads with the refusal and the fix.
func TestSetupWrongPassword(t *testing.T) {
	t.Parallel()
	f := newOpsFixture(t)
	pg := passwordPostgres(t)
	f.setYAML(f.db.URL, strings.NewReplacer("postgres@", "status_user:wrong-password@", "sslmode=disable", "sslmode=prefer").Replace(pg.URL("postgres")))
	_, err := f.step("setup")
	if err == nil {
		t.Fatal("setup succeeded with a wrong password")
	}
	for _, w := range []string{"password authentication failed", "check the user and password in postgres.url", "setup changed nothing"} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("setup error lacks %q: %v", w, err)
		}
	}
	if strings.Contains(err.Error(), "tls error") {
		t.Errorf("setup error names the TLS attempt, which is not the cause: %v", err)
	}
	for _, name := range []string{f.stream, f.stream + "_DLQ"} {
		if _, err := f.js.Stream(context.Background(), name); !errors.Is(err, jetstream.ErrStreamNotFound) {
			t.Errorf("stream %s created although PostgreSQL refused (lookup: %v)", name, err)
		}
	}
}

// Issue 27: run with auto_setup said "publication does not exist" of a
// publication that exists and lacks the table, and created the streams
// before PostgreSQL refused.
func TestRunAutoSetupNamesTheTableMissingFromThePublication(t *testing.T) {
	t.Parallel()
	f := newOpsFixture(t)
	role := f.leastPrivilegeRole()
	f.exec("CREATE TABLE other_outbox (id int)", "CREATE PUBLICATION "+f.cfg.Postgres.Publication+" FOR TABLE other_outbox")
	f.setYAML("postgres@", role+"@")
	f.cfg.Postgres.AutoSetup, f.cfg.HTTP.Listen = true, ""
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := run(ctx, f.cfg, zaptest.NewLogger(t))
	if err == nil || !strings.Contains(err.Error(), "does not include table public.outbox") || strings.Contains(err.Error(), "publication does not exist") {
		t.Fatalf("run = %v, want the table missing from the publication named", err)
	}
	f.assertNothingLeft()
}

// Issue 26: `setup` against a standby that decodes (PostgreSQL 16+) with
// the default postgres.backfill: true wrote the backfill's record on a
// read-only server and failed. It creates the standby's slot without a
// backfill, says what it did not do, and writes nothing on the primary.
// Runs in the 17 lane (scripts/pg17-root.sh); skipped on 15.
func TestSetupOnStandbyWithBackfill(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	primary, err := testenv.StartPostgres()
	testenv.Must(t, err, "start the primary")
	t.Cleanup(primary.Close)
	if primary.Major()*10000 < replication.VersionStandbyDecoding {
		t.Skipf("PostgreSQL %d cannot decode on a standby", primary.Major())
	}
	db := testenv.NewDatabaseOn(t, primary)
	db.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "outbox.sql"))
	standby, err := primary.StartStandby(testenv.StandbyOptions{})
	testenv.Must(t, err, "start the standby")
	t.Cleanup(standby.Close)
	ns, err := testenv.StartNATS()
	testenv.Must(t, err, "start NATS")
	t.Cleanup(ns.Close)
	name := testenv.UniqueName("sb")
	stream := strings.ToUpper(name)
	// The publication is the primary's (docs/operations.md, "Decoding on a
	// standby"); rows wait in the outbox.
	if _, err := db.Pool.Exec(ctx, "CREATE PUBLICATION "+name+" FOR TABLE outbox"); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if _, err := db.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES (gen_random_uuid(), 'registration', $1, 1, 'E', '{}')`, fmt.Sprint(i)); err != nil {
			t.Fatal(err)
		}
	}
	var lsn string
	testenv.Must(t, db.Pool.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&lsn), "primary LSN") // past the commits, flushed soon (asynchronous commit)
	testenv.Must(t, standby.WaitReplayed(ctx, lsn), "replay")
	file := filepath.Join(t.TempDir(), "relay.yaml")
	yaml := fmt.Sprintf("postgres:\n  url: %s\n  slot: %s\n  publication: %s\nnats:\n  url: %s\n  stream: %s\n  dead_letter_stream: %s_DLQ\ntables:\n  - table: public.outbox\n    subject: \"%s.{aggregate_type}.{aggregate_id}\"\ndead_letter_subject: %s_dlq\n",
		standby.URL(db.Name), name, name, ns.URL, stream, stream, name, name)
	testenv.Must(t, os.WriteFile(file, []byte(yaml), 0o600), "write the configuration")
	cfg, err := config.Load(config.Sources{File: file})
	testenv.Must(t, err, "load the configuration")
	if !cfg.Postgres.Backfill {
		t.Fatal("postgres.backfill is not on by default")
	}
	f := &opsFixture{t: t, cfg: cfg, file: file, stream: stream}
	// Creating the standby's slot waits for the primary's next
	// running-transactions record: send them until setup ends.
	type result struct {
		out string
		err error
	}
	done := make(chan result, 1)
	go func() {
		out, err := f.step("setup")
		done <- result{out, err}
	}()
	var r result
	for waiting := true; waiting; {
		select {
		case r = <-done:
			waiting = false
		case <-time.After(200 * time.Millisecond):
			_ = primary.Exec(ctx, "SELECT pg_log_standby_snapshot()")
		}
	}
	if r.err != nil {
		t.Fatalf("setup on the standby: %v\n%s", r.err, r.out)
	}
	for _, want := range []string{
		"the server is a standby (in recovery, read-only): no backfill, and no " + replication.BackfillTable + " record written",
		"reconcile --repair",
		"postgres: created logical replication slot " + name,
	} {
		if !strings.Contains(r.out, want) {
			t.Errorf("setup's output lacks %q:\n%s", want, r.out)
		}
	}
	st, err := replication.Status(ctx, standby.URL(db.Name), name)
	testenv.Must(t, err, "the standby's slot")
	if !st.Exists {
		t.Errorf("setup on the standby created no slot there")
	}
	var table bool
	testenv.Must(t, db.Pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", replication.BackfillTable).Scan(&table), "look up the backfill table")
	if table {
		t.Errorf("setup on the standby created %s on the primary", replication.BackfillTable)
	}
}
