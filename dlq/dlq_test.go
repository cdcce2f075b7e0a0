package dlq

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/consumer"
	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

type fixture struct {
	t       *testing.T
	db      *testenv.Database
	pool    *pgxpool.Pool
	natsURL string
	js      jetstream.JetStream
	stream  string
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	env := testenv.Get(t)
	db := env.NewDatabase(t)
	db.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "consumer.sql"))
	pcfg, err := pgxpool.ParseConfig(db.URL)
	testenv.Must(t, err, "pool config")
	pcfg.MaxConns = 10
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	testenv.Must(t, err, "pool")
	t.Cleanup(pool.Close)
	nc, err := nats.Connect(env.NATS.URL)
	testenv.Must(t, err, "nats")
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	testenv.Must(t, err, "jetstream")
	name := testenv.UniqueName("EV")
	_, err = js.CreateStream(context.Background(), jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}, Storage: jetstream.MemoryStorage})
	testenv.Must(t, err, "stream")
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), name) })
	return &fixture{t: t, db: db, pool: pool, natsURL: env.NATS.URL, js: js, stream: name}
}

func (f *fixture) publish(id, agg string, version int64) {
	f.t.Helper()
	m := nats.NewMsg(f.stream + ".account." + agg)
	m.Header.Set(contract.MsgID, id)
	m.Header.Set(contract.EventID, id)
	m.Header.Set(contract.EventType, "PointsEarned")
	m.Header.Set(contract.AggregateType, "account")
	m.Header.Set(contract.AggregateID, agg)
	m.Header.Set(contract.AggregateVersion, strconv.FormatInt(version, 10))
	m.Data = fmt.Appendf(nil, `{"account": %q, "version": %d}`, agg, version)
	if _, err := f.js.PublishMsg(context.Background(), m); err != nil {
		f.t.Fatal(err)
	}
}

// run starts a consumer until the test ends.
func (f *fixture) run(cfg consumer.Config, h consumer.Handler) {
	f.t.Helper()
	cfg.Stream = f.stream
	cfg.AckWait = 5 * time.Second
	cfg.RetryBase, cfg.RetryMax = 20*time.Millisecond, 100*time.Millisecond
	cfg.ReplayPollInterval = 50 * time.Millisecond
	c, err := consumer.New(f.pool, f.js, cfg, h, consumer.WithLogger(zaptest.NewLogger(f.t)))
	testenv.Must(f.t, err, "new consumer")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	f.t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			f.t.Errorf("Run: %v", err)
		}
	})
}

// cli runs `dlq args...` in process and returns its standard output and
// error output.
func (f *fixture) cli(deps Deps, args ...string) (string, string, error) {
	f.t.Helper()
	if deps.ConsumerDatabaseURL == "" {
		deps.ConsumerDatabaseURL = f.db.URL
	}
	if deps.ConnectNATS == nil {
		deps.ConnectNATS = func(context.Context) (*nats.Conn, error) { return nats.Connect(f.natsURL) }
	}
	cmd := NewCommand(deps)
	var out, errOut bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetArgs(args)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := cmd.ExecuteContext(ctx)
	return out.String(), errOut.String(), err
}

func queryInt(t *testing.T, db *pgxpool.Pool, sql string, args ...any) int64 {
	t.Helper()
	var n int64
	testenv.Must(t, db.QueryRow(context.Background(), sql, args...).Scan(&n), "%s", sql)
	return n
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	if !testenv.WaitFor(20*time.Second, cond) {
		t.Fatalf("timed out waiting for %s", what)
	}
}

// Acceptance 6: `dlq replay` after the cause is fixed applies the event once,
// only for that consumer, in aggregate order; `dlq discard --reason` removes
// a record; both appear in `dlq audit`.
func TestReplayAndDiscardAreAuditedAndReachOnlyTheFailingConsumer(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := context.Background()
	_, err := f.pool.Exec(ctx, `CREATE TABLE account (id text PRIMARY KEY, points int NOT NULL);
		CREATE TABLE credit (event_id text, account text, version bigint, n bigserial);
		CREATE TABLE audit_log (event_id text);`)
	testenv.Must(t, err, "create tables")

	// "rewards" needs the account to exist: a permanent error until an
	// operator opens it.
	rewards := consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		tag, err := tx.Exec(ctx, `UPDATE account SET points = points + 10 WHERE id = $1`, m.AggregateID)
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			return consumer.Permanent(fmt.Errorf("no account %s", m.AggregateID))
		}
		_, err = tx.Exec(ctx, `INSERT INTO credit (event_id, account, version) VALUES ($1, $2, $3)`, m.ID, m.AggregateID, m.AggregateVersion)
		return err
	})
	// "audit-log" subscribes to the same stream and never fails.
	auditLog := consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO audit_log (event_id) VALUES ($1)`, m.ID)
		return err
	})
	f.run(consumer.Config{Name: "rewards", Owner: "team-rewards", VersionCheck: true}, rewards)
	f.run(consumer.Config{Name: "audit-log", Owner: "team-audit"}, auditLog)

	// a1 has three versions; all are dead-lettered: version 1 for the
	// missing account, 2 and 3 because version 1 is dead-lettered.
	f.publish("e-a1-1", "a1", 1)
	f.publish("e-a1-2", "a1", 2)
	f.publish("e-a1-3", "a1", 3)
	f.publish("e-a2-1", "a2", 1)
	waitFor(t, "four dead letters", func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'rewards'`) == 4
	})
	waitFor(t, "the other consumer to apply everything", func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM audit_log`) == 4
	})
	deps := Deps{User: "alice", Owners: map[string]string{"audit-log": "someone-else"}}

	out, _, err := f.cli(deps, "list", "--consumer", "rewards")
	testenv.Must(t, err, "list")
	if !strings.Contains(out, "team-rewards") || !strings.Contains(out, "4 dead letter(s)") ||
		!strings.Contains(out, "no account a1") || strings.Count(out, " gap ") != 2 {
		t.Fatalf("list output:\n%s", out)
	}
	ids := map[string]int64{}
	rows, err := f.pool.Query(ctx, `SELECT event_id, id FROM consumer_dead_letter`)
	testenv.Must(t, err, "ids")
	for rows.Next() {
		var ev string
		var id int64
		testenv.Must(t, rows.Scan(&ev, &id), "scan")
		ids[ev] = id
	}
	out, _, err = f.cli(deps, "show", strconv.FormatInt(ids["e-a1-1"], 10))
	testenv.Must(t, err, "show")
	for _, want := range []string{"consumer:", "rewards", "owner:", "team-rewards", "failure class:", "permanent",
		"Outbox-Event-Id: e-a1-1", `"account": "a1"`, "stream:", f.stream + " sequence 1", "first failed:"} {
		if !strings.Contains(out, want) {
			t.Fatalf("show output lacks %q:\n%s", want, out)
		}
	}

	// Fix the cause, then replay the consumer's permanent failures and gaps.
	_, err = f.pool.Exec(ctx, `INSERT INTO account VALUES ('a1', 0)`)
	testenv.Must(t, err, "open account")
	_, progress, err := f.cli(deps, "replay", "--consumer", "rewards", "--all", "--reason", "account a1 opened", "--poll", "50ms")
	// a2 still has no account: it fails again, and the command says so.
	if !errors.Is(err, ErrReplayIncomplete) || !strings.Contains(progress, "4/4 done (3 applied, 0 duplicate, 0 rejected, 1 failed again") {
		t.Fatalf("replay: err %v, progress:\n%s", err, progress)
	}
	if got := versions(t, f, "a1"); fmt.Sprint(got) != "[1 2 3]" {
		t.Fatalf("a1 credited versions %v, want [1 2 3] in order", got)
	}
	if p := queryInt(t, f.pool, `SELECT points FROM account WHERE id = 'a1'`); p != 30 {
		t.Fatalf("a1 has %d points, want 30", p)
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM audit_log`); n != 4 {
		t.Fatalf("the other consumer saw %d events, want 4: a replay must reach the failing consumer only", n)
	}
	var status, reason string
	testenv.Must(t, f.pool.QueryRow(ctx, `SELECT status, reason FROM consumer_dead_letter WHERE id = $1`, ids["e-a2-1"]).Scan(&status, &reason), "a2 record")
	if status != StatusOpen || !strings.Contains(reason, "replay failed") || !strings.Contains(reason, "no account a2") {
		t.Fatalf("a2 record %s: %s", status, reason)
	}

	// Replaying a replayed record is refused; replaying it again cannot
	// apply it twice anyway (the event id is kept).
	_, _, err = f.cli(deps, "replay", strconv.FormatInt(ids["e-a1-1"], 10))
	if !errors.Is(err, ErrNotOpen) {
		t.Fatalf("second replay: err %v, want ErrNotOpen", err)
	}

	// Discard needs a reason.
	_, _, err = f.cli(deps, "discard", strconv.FormatInt(ids["e-a2-1"], 10))
	if !errors.Is(err, ErrReasonRequired) {
		t.Fatalf("discard without reason: err %v", err)
	}
	out, _, err = f.cli(deps, "discard", strconv.FormatInt(ids["e-a2-1"], 10), "--reason", "a2 is a test account", "--actor", "bob")
	testenv.Must(t, err, "discard")
	if !strings.Contains(out, "discarded 1 dead letter(s)") {
		t.Fatalf("discard output: %s", out)
	}
	out, _, err = f.cli(deps, "list")
	testenv.Must(t, err, "list")
	if !strings.Contains(out, "0 dead letter(s)") {
		t.Fatalf("list after replay and discard:\n%s", out)
	}

	out, _, err = f.cli(deps, "audit")
	testenv.Must(t, err, "audit")
	if !strings.Contains(out, "account a1 opened") || !strings.Contains(out, "a2 is a test account") || !strings.Contains(out, "5 audit entries") {
		t.Fatalf("audit output:\n%s", out)
	}
	out, _, err = f.cli(deps, "audit", "-o", "json")
	testenv.Must(t, err, "audit")
	var entries []AuditEntry
	testenv.Must(t, json.Unmarshal([]byte(out), &entries), "decode audit")
	var got []string
	for _, e := range entries {
		got = append(got, fmt.Sprintf("%s %s %s %d %s", e.Actor, e.Action, e.Queue, e.Record, e.Reason))
	}
	want := []string{
		fmt.Sprintf("alice replay rewards %d account a1 opened", ids["e-a1-1"]),
		fmt.Sprintf("alice replay rewards %d account a1 opened", ids["e-a1-2"]),
		fmt.Sprintf("alice replay rewards %d account a1 opened", ids["e-a1-3"]),
		fmt.Sprintf("alice replay rewards %d account a1 opened", ids["e-a2-1"]),
		fmt.Sprintf("bob discard rewards %d a2 is a test account", ids["e-a2-1"]),
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("audit entries:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

func versions(t *testing.T, f *fixture, account string) []int64 {
	t.Helper()
	rows, err := f.pool.Query(context.Background(), `SELECT version FROM credit WHERE account = $1 ORDER BY n`, account)
	testenv.Must(t, err, "credits")
	vs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	testenv.Must(t, err, "credits")
	return vs
}

func TestRelayDeadLetters(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := context.Background()
	dlqStream, auditStream := testenv.UniqueName("DLQ"), testenv.UniqueName("AUDIT")
	_, err := f.js.CreateStream(ctx, jetstream.StreamConfig{Name: dlqStream, Subjects: []string{dlqStream + ".>"}, Storage: jetstream.MemoryStorage})
	testenv.Must(t, err, "dlq stream")
	t.Cleanup(func() {
		_ = f.js.DeleteStream(context.Background(), dlqStream)
		_ = f.js.DeleteStream(context.Background(), auditStream)
	})
	for i, class := range []string{"missing_field", "too_large", "missing_field"} {
		m := nats.NewMsg(dlqStream + ".public_outbox")
		m.Header.Set(contract.MsgID, fmt.Sprintf("dlq-%d", i))
		m.Header.Set(contract.Table, "public.outbox")
		m.Header.Set(contract.DLQReason, fmt.Sprintf("row %d: column aggregate_id is null", i))
		m.Header.Set(contract.DLQReasonClass, class)
		m.Header.Set(contract.DLQLSN, fmt.Sprintf("0/16B37%02d", i))
		m.Header.Set(contract.CommitLSN, "0/16B3800")
		m.Header.Set(contract.CommitTime, "2025-01-02T03:04:05Z")
		m.Data = fmt.Appendf(nil, `{"table":"public.outbox","lsn":"0/16B37%02d","reason_class":%q,"row":{"event_id":"e%d","aggregate_id":null}}`, i, class, i)
		_, err := f.js.PublishMsg(ctx, m)
		testenv.Must(t, err, "publish dlq record")
	}
	deps := Deps{User: "carol", RelayStream: dlqStream, AuditStream: auditStream, AuditSubject: auditStream + ".entries",
		Owners: map[string]string{RelayOwnerKey: "platform-team"}}

	out, _, err := f.cli(deps, "--relay", "list", "--class", "missing_field")
	testenv.Must(t, err, "list")
	if !strings.Contains(out, "owner platform-team") || !strings.Contains(out, "2 dead letter(s)") || strings.Contains(out, "too_large") {
		t.Fatalf("relay list:\n%s", out)
	}
	out, _, err = f.cli(deps, "--relay", "show", "2")
	testenv.Must(t, err, "show")
	for _, want := range []string{"too_large", "0/16B3701", "Outbox-DLQ-Reason: row 1", `"aggregate_id": null`, "platform-team"} {
		if !strings.Contains(out, want) {
			t.Fatalf("relay show lacks %q:\n%s", want, out)
		}
	}
	if _, _, err := f.cli(deps, "--relay", "replay", "1"); !errors.Is(err, ErrNotSupported) {
		t.Fatalf("relay replay: err %v, want ErrNotSupported", err)
	}
	if _, _, err := f.cli(deps, "--relay", "discard", "1"); !errors.Is(err, ErrReasonRequired) {
		t.Fatalf("relay discard without reason: err %v", err)
	}
	_, _, err = f.cli(deps, "--relay", "discard", "1", "3", "--reason", "rows fixed and re-inserted")
	testenv.Must(t, err, "discard")
	out, _, err = f.cli(deps, "--relay", "list")
	testenv.Must(t, err, "list")
	if !strings.Contains(out, "1 dead letter(s)") || !strings.Contains(out, "too_large") {
		t.Fatalf("relay list after discard:\n%s", out)
	}
	out, _, err = f.cli(deps, "--relay", "audit")
	testenv.Must(t, err, "audit")
	if strings.Count(out, "carol") != 2 || strings.Count(out, "rows fixed and re-inserted") != 2 || !strings.Contains(out, "relay:"+dlqStream) {
		t.Fatalf("relay audit:\n%s", out)
	}
	if _, _, err := f.cli(deps, "--relay", "show", "1"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("show discarded: err %v, want ErrNotFound", err)
	}
}

func TestUsageErrors(t *testing.T) {
	cmd := func(args ...string) error {
		c := NewCommand(Deps{User: "u"})
		c.SetOut(&bytes.Buffer{})
		c.SetErr(&bytes.Buffer{})
		c.SetArgs(args)
		return c.ExecuteContext(context.Background())
	}
	for _, args := range [][]string{
		{"list"},                      // no --consumer-db
		{"replay"},                    // nothing selected
		{"replay", "--consumer", "c"}, // a consumer without --all or a filter
		{"replay", "x"},               // not an id
		{"discard", "1"},              // no reason
		{"discard", "--reason", "r"},  // nothing selected
		{"--relay", "show", "0"},      // not a sequence
		{"--actor", "", "discard", "1", "--reason", "r"},
	} {
		err := cmd(args...)
		if err == nil || !IsUsageError(err) {
			t.Errorf("%v: err %v, want a usage error", args, err)
		}
	}
	// Issue 27: without $USER, replay failed on the database, or said only
	// "an actor is required"; both actions name the flag at once.
	for _, args := range [][]string{
		{"--actor", "", "--consumer-db", "postgres://nobody@127.0.0.1:1/none", "replay", "1"},
		{"--actor", "", "discard", "1", "--reason", "r"},
	} {
		if err := cmd(args...); !errors.Is(err, ErrActorRequired) || !strings.Contains(err.Error(), "pass --actor NAME") {
			t.Errorf("%v: err %v, want the --actor flag named", args, err)
		}
	}
}
