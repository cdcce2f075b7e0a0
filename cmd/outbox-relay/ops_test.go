package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
)

// opsFixture runs the real `run` in-process against a private NATS server
// that the test can stop, with the metrics listener on a free port.
type opsFixture struct {
	t      *testing.T
	ns     *testenv.NATS
	db     *testenv.Database
	cfg    config.Config
	js     jetstream.JetStream
	stream string
	url    string
	// file is the configuration file cfg was loaded from.
	file string
}

func newOpsFixture(t *testing.T) *opsFixture {
	t.Helper()
	env := testenv.Get(t)
	ns, err := testenv.StartNATS()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ns.Close)
	db := env.NewDatabase(t)
	db.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "outbox.sql"))
	// A nullable event_type lets a test write a row the relay dead-letters.
	if _, err := db.Pool.Exec(context.Background(), "ALTER TABLE outbox ALTER COLUMN event_type DROP NOT NULL"); err != nil {
		t.Fatal(err)
	}
	port, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	name := testenv.UniqueName("m")
	stream := strings.ToUpper(name)
	file := filepath.Join(t.TempDir(), "relay.yaml")
	yaml := fmt.Sprintf(`postgres:
  url: %s
  slot: %s
  publication: %s
  status_interval: 100ms
  receive_timeout: 1s
nats:
  url: %s
  stream: %s
  dead_letter_stream: %s_DLQ
  ack_timeout: 1s
tables:
  - table: public.outbox
    subject: "%s.{aggregate_type}.{aggregate_id}"
dead_letter_subject: %s_dlq
http:
  listen: 127.0.0.1:%d
metrics:
  poll_interval: 200ms
reconcile:
  interval: 10s
  window: 1h
shutdown_timeout: 2s
`, db.URL, name, name, ns.URL, stream, stream, name, name, port)
	if err := os.WriteFile(file, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Load(config.Sources{File: file})
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(ns.URL, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return &opsFixture{t: t, ns: ns, db: db, cfg: cfg, js: js, stream: stream, url: fmt.Sprintf("http://127.0.0.1:%d", port), file: file}
}

// start runs `run` until the test ends; stop cancels it and returns its
// result.
func (f *opsFixture) start() (stop func() error) {
	stop = testenv.Background(context.Background(), f.t, func(ctx context.Context) error {
		return run(ctx, f.cfg, zaptest.NewLogger(f.t))
	})
	if !testenv.WaitFor(30*time.Second, func() bool { return f.get("/readyz") == http.StatusOK }) {
		f.t.Fatal("the relay is not ready within 30s")
	}
	return stop
}

func (f *opsFixture) get(path string) int {
	resp, err := http.Get(f.url + path)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// scrape is one /metrics reading.
type scrape map[string]*dto.MetricFamily

func (f *opsFixture) scrape() scrape {
	f.t.Helper()
	resp, err := http.Get(f.url + "/metrics")
	if err != nil {
		f.t.Fatal(err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		f.t.Fatal(err)
	}
	return fams
}

// value returns the value of the series of name whose labels include
// labels ("k=v" pairs), summed; ok is false when there is none.
func (s scrape) value(name string, labels ...string) (float64, bool) {
	fam := s[name]
	if fam == nil {
		return 0, false
	}
	sum, found := 0.0, false
next:
	for _, m := range fam.GetMetric() {
		for _, l := range labels {
			k, v, _ := strings.Cut(l, "=")
			match := false
			for _, lp := range m.GetLabel() {
				if lp.GetName() == k && lp.GetValue() == v {
					match = true
				}
			}
			if !match {
				continue next
			}
		}
		found = true
		switch fam.GetType() {
		case dto.MetricType_COUNTER:
			sum += m.GetCounter().GetValue()
		case dto.MetricType_GAUGE:
			sum += m.GetGauge().GetValue()
		case dto.MetricType_HISTOGRAM:
			sum += float64(m.GetHistogram().GetSampleCount())
		default:
			sum += m.GetUntyped().GetValue()
		}
	}
	return sum, found
}

func (f *opsFixture) insert(ctx context.Context, n int, eventType any) {
	f.t.Helper()
	agg := uuid.NewString()[:8]
	for i := 1; i <= n; i++ {
		if _, err := f.db.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ($1, 'registration', $2, $3, $4, '{}')`,
			uuid.NewString(), agg, i, eventType); err != nil {
			f.t.Fatal(err)
		}
	}
}

// check asserts a condition on a scrape, with the scrape's value in the
// message.
type check struct {
	name   string
	labels []string
	ok     func(float64) bool
	want   string
}

func (f *opsFixture) waitMetrics(timeout time.Duration, checks ...check) scrape {
	f.t.Helper()
	var s scrape
	var failed []string
	if testenv.WaitFor(timeout, func() bool {
		s = f.scrape()
		failed = failed[:0]
		for _, c := range checks {
			v, found := s.value(c.name, c.labels...)
			if !found || !c.ok(v) {
				failed = append(failed, fmt.Sprintf("%s%v = %v (found %v), want %s", c.name, c.labels, v, found, c.want))
			}
		}
		return len(failed) == 0
	}) {
		return s
	}
	f.t.Fatalf("metrics after %s:\n  %s", timeout, strings.Join(failed, "\n  "))
	return nil
}

func eq(want float64) (func(float64) bool, string) {
	return func(v float64) bool { return v == want }, fmt.Sprint(want)
}
func atLeast(want float64) (func(float64) bool, string) {
	return func(v float64) bool { return v >= want }, fmt.Sprint(">= ", want)
}
func above(want float64) (func(float64) bool, string) {
	return func(v float64) bool { return v > want }, fmt.Sprint("> ", want)
}

func c(name string, cond func(float64) bool, want string, labels ...string) check {
	return check{name: name, labels: labels, ok: cond, want: want}
}

func cc(name string, f func(float64) (func(float64) bool, string), v float64, labels ...string) check {
	cond, want := f(v)
	return c(name, cond, want, labels...)
}

// Acceptance 1: after a load, /metrics has every metric with plausible
// values; the oldest-unacked age grows while the broker is down and returns
// to zero after; `status --json` shows the same figures.
func TestMetricsAfterLoadAndBrokerOutage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newOpsFixture(t)
	stop := f.start()
	if code := f.get("/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz: %d", code)
	}
	f.insert(ctx, 300, "RegistrationConfirmed")
	f.insert(ctx, 1, nil) // dead-lettered: NULL event type
	dlq := f.stream + "_DLQ"
	f.waitMetrics(30*time.Second,
		cc("outbox_relay_events_published_total", atLeast, 300),
		cc("outbox_relay_publish_latency_seconds", atLeast, 300),
		cc("outbox_relay_publish_duplicates_total", eq, 0),
		cc("outbox_relay_dead_lettered_total", eq, 1, "reason=null_field"),
		cc("outbox_relay_in_flight_messages", eq, 0),
		cc("outbox_relay_oldest_unacked_age_seconds", eq, 0),
		cc("outbox_relay_confirmed_lsn", above, 0),
		cc("outbox_relay_ready", eq, 1),
		cc("outbox_relay_replication_restarts_total", eq, 0),
		cc("outbox_relay_slot_exists", eq, 1),
		cc("outbox_relay_slot_active", eq, 1),
		cc("outbox_relay_slot_wal_status", eq, 1, "status=reserved"),
		cc("outbox_relay_slot_wal_status", eq, 0, "status=lost"),
		cc("outbox_relay_slot_retained_wal_bytes", above, 0),
		cc("outbox_relay_slot_lag_bytes", atLeast, 0),
		cc("outbox_relay_slot_confirmed_flush_lsn", above, 0),
		cc("outbox_relay_slot_last_poll_timestamp_seconds", above, float64(time.Now().Add(-time.Minute).Unix())),
		cc("outbox_relay_slot_poll_errors_total", eq, 0),
		cc("outbox_relay_stream_messages", eq, 300, "stream="+f.stream),
		cc("outbox_relay_dead_letters", eq, 1, "stream="+dlq),
		cc("outbox_relay_dead_letter_oldest_age_seconds", above, 0, "stream="+dlq),
		// The reconcile loop's first run, with the relay caught up.
		cc("outbox_relay_reconcile_rows", eq, 301, "table=public.outbox", "aggregate_type=registration"),
		cc("outbox_relay_reconcile_missing_events", eq, 0, "table=public.outbox"),
		cc("outbox_relay_reconcile_dead_lettered_events", eq, 1, "table=public.outbox"),
		cc("outbox_relay_reconcile_unexpected_events", eq, 0, "table=public.outbox"),
		cc("outbox_relay_reconcile_pending_events", eq, 0, "table=public.outbox"),
		cc("outbox_relay_reconcile_duplicate_events", eq, 0, "table=public.outbox"),
		cc("outbox_relay_reconcile_duration_seconds", above, 0),
		cc("outbox_relay_reconcile_runs_total", atLeast, 1, "result=ok"),
		cc("outbox_relay_reconcile_last_success_timestamp_seconds", above, 0),
		cc("process_resident_memory_bytes", above, 0),
		cc("go_goroutines", above, 0),
	)

	// status --json shows the same figures.
	st := collectStatus(ctx, f.cfg)
	if st.Relay == nil || !st.Relay.Ready || st.Relay.EventsPublished < 300 || st.Relay.DeadLettered != 1 || st.DeadLetters != 1 ||
		st.DeadLetterOldestAge <= 0 || st.StreamMessages != 300 || !st.SlotActive || st.WALStatus != "reserved" {
		b, _ := json.MarshalIndent(st, "", "  ")
		t.Fatalf("status: %s", b)
	}
	var out bytes.Buffer
	printStatus(&out, st)
	if !strings.Contains(out.String(), "in flight") {
		t.Errorf("status output:\n%s", out.String())
	}

	// The broker goes away; events keep coming.
	f.ns.Stop()
	f.insert(ctx, 20, "RegistrationConfirmed")
	s1 := f.waitMetrics(30*time.Second,
		cc("outbox_relay_oldest_unacked_age_seconds", above, 1),
		cc("outbox_relay_in_flight_messages", above, 0),
		cc("outbox_relay_stream_poll_errors_total", above, 0),
		cc("outbox_relay_publish_retries_total", above, 0),
	)
	age1, _ := s1.value("outbox_relay_oldest_unacked_age_seconds")
	s2 := f.waitMetrics(10*time.Second, cc("outbox_relay_oldest_unacked_age_seconds", above, age1))
	age2, _ := s2.value("outbox_relay_oldest_unacked_age_seconds")
	t.Logf("oldest unacked age while the broker is down: %.1fs, then %.1fs", age1, age2)

	// It returns: everything is published and the age is zero again.
	if err := f.ns.Start(); err != nil {
		t.Fatal(err)
	}
	f.waitMetrics(60*time.Second,
		cc("outbox_relay_oldest_unacked_age_seconds", eq, 0),
		cc("outbox_relay_in_flight_messages", eq, 0),
		cc("outbox_relay_events_published_total", atLeast, 320),
		cc("outbox_relay_stream_messages", eq, 320, "stream="+f.stream),
		cc("outbox_relay_ready", eq, 1),
	)
	if n := relaytest.StreamCount(ctx, f.js, f.stream); n != 320 {
		t.Fatalf("stream holds %d events, want 320", n)
	}
	if err := stop(); err != nil {
		t.Fatalf("run returned %v", err)
	}
}

// The reconcile and cleanup commands: table and JSON output, exit status,
// --repair and --metrics-file.
func TestReconcileAndCleanupCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newOpsFixture(t)
	// Deleted ids leave the stream's duplicate window soon.
	f.cfg.NATS.DuplicateWindow = time.Second
	f.cfg.Reconcile.Interval = 0
	f.start()
	f.insert(ctx, 30, "RegistrationConfirmed")
	if !testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.js, f.stream) == 30 }) {
		t.Fatal("events not relayed")
	}
	flags := reconcileFlags{since: "1h", list: 20, confirmWait: 10 * time.Second, clockSkew: time.Minute, maxRows: 1000}

	var out bytes.Buffer
	if err := runReconcile(ctx, &out, f.cfg, flags); err != nil {
		t.Fatalf("clean reconcile: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "public.outbox") || !strings.Contains(out.String(), "every row read is in the stream") {
		t.Errorf("output:\n%s", out.String())
	}

	s, err := f.js.Stream(ctx, f.stream)
	if err != nil {
		t.Fatal(err)
	}
	for seq := uint64(5); seq <= 7; seq++ {
		if err := s.DeleteMsg(ctx, seq); err != nil {
			t.Fatal(err)
		}
	}
	out.Reset()
	jf := flags
	jf.asJSON = true
	err = runReconcile(ctx, &out, f.cfg, jf)
	if code, ok := err.(exitCode); !ok || code != 1 {
		t.Fatalf("reconcile with missing events returned %v", err)
	}
	var res reconcileOutput
	if err := json.Unmarshal(out.Bytes(), &res); err != nil {
		t.Fatalf("JSON: %v\n%s", err, out.String())
	}
	if res.Report.Total.Missing != 3 || len(res.Report.Missing) != 3 || res.Report.Missing[0].AggregateVersion != "5" {
		t.Fatalf("JSON report: %+v", res.Report)
	}

	// Repair republishes only events proven missing: one the slot has not
	// yet confirmed past counts as pending, and the run exits 1. It is run
	// again then; each run writes its own metrics file, and the runs
	// together must have republished exactly the three events.
	rf := flags
	rf.repair = true
	dir := t.TempDir()
	var promFiles []string
	if !testenv.WaitFor(20*time.Second, func() bool {
		out.Reset()
		rf.metricsFile = filepath.Join(dir, fmt.Sprintf("reconcile-%d.prom", len(promFiles)))
		promFiles = append(promFiles, rf.metricsFile)
		return runReconcile(ctx, &out, f.cfg, rf) == nil
	}) {
		t.Fatalf("repair did not restore the events:\n%s", out.String())
	}
	if !strings.Contains(out.String(), "After the repair:") {
		t.Errorf("repair output:\n%s", out.String())
	}
	const publishedLine = `outbox_relay_reconcile_repaired_events_total{result="published"} `
	republished := 0
	var prom []byte
	for _, path := range promFiles {
		if prom, err = os.ReadFile(path); err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(prom), "\n") {
			if n, ok := strings.CutPrefix(line, publishedLine); ok {
				v, err := strconv.Atoi(n)
				if err != nil {
					t.Fatalf("%s: %q", path, line)
				}
				republished += v
			}
		}
	}
	if republished != 3 {
		t.Errorf("repair runs republished %d events, want 3 (%d runs)", republished, len(promFiles))
	}
	for _, want := range []string{
		`outbox_relay_reconcile_missing_events{aggregate_type="registration",table="public.outbox"} 0`,
		`outbox_relay_reconcile_rows{aggregate_type="registration",table="public.outbox"} 30`,
	} {
		if !strings.Contains(string(prom), want) { // the last run's file
			t.Errorf("metrics file lacks %s:\n%s", want, prom)
		}
	}

	// Every row is in the stream again, but stored just now: cleanup keeps
	// them until the stream has synced them (issue 17, case 4), exits 1
	// and says why. --older-than 0 is refused.
	out.Reset()
	if err := runCleanup(ctx, &out, f.cfg, cleanupFlags{olderThan: 0, storedMargin: 10 * time.Minute, mode: "stream", batch: 7}); !errors.Is(err, config.ErrInvalid) {
		t.Fatalf("cleanup --older-than 0: %v", err)
	}
	err = runCleanup(ctx, &out, f.cfg, cleanupFlags{olderThan: time.Nanosecond, storedMargin: 10 * time.Minute, mode: "stream", batch: 7})
	if code, ok := err.(exitCode); !ok || code != 1 {
		t.Fatalf("cleanup: %v\n%s", err, out.String())
	}
	for _, want := range []string{"30 rows older than the cutoff were kept", "30 of them have an event stored after", "warning: stream " + f.stream + ": 1 replica(s)"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("cleanup output lacks %q:\n%s", want, out.String())
		}
	}
}

func TestParseWhen(t *testing.T) {
	now := time.Date(2026, 11, 29, 10, 0, 0, 0, time.UTC)
	for _, c := range []struct {
		in   string
		want time.Time
		bad  bool
	}{
		{in: "24h", want: now.Add(-24 * time.Hour)},
		{in: "90m", want: now.Add(-90 * time.Minute)},
		{in: "2026-11-28T09:30:00Z", want: time.Date(2026, 11, 28, 9, 30, 0, 0, time.UTC)},
		{in: "2026-11-28T09:30:00+02:00", want: time.Date(2026, 11, 28, 7, 30, 0, 0, time.UTC)},
		{in: "2026-11-28", want: time.Date(2026, 11, 28, 0, 0, 0, 0, time.UTC)},
		{in: "-1h", bad: true},
		{in: "yesterday", bad: true},
		{in: "", bad: true},
	} {
		got, err := parseWhen("since", c.in, now)
		switch {
		case c.bad && !errors.Is(err, config.ErrInvalid):
			t.Errorf("%q: err %v, want config.ErrInvalid", c.in, err)
		case !c.bad && (err != nil || !got.Equal(c.want)):
			t.Errorf("%q: %v, %v; want %v", c.in, got, err, c.want)
		}
	}
}

// cli runs the outbox-relay command line with the fixture's configuration
// file and returns its standard output.
func (f *opsFixture) cli(args ...string) (string, error) {
	f.t.Helper()
	cmd := newRootCmd()
	var out, errOut bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetArgs(append([]string{"-c", f.file}, args...))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := cmd.ExecuteContext(ctx)
	if errOut.Len() > 0 {
		f.t.Logf("outbox-relay %s: stderr:\n%s", strings.Join(args, " "), errOut.String())
	}
	return out.String(), err
}

// Issue 17, case 2: `dlq --relay` acted on OUTBOX_DLQ whatever
// nats.dead_letter_stream said: it listed, and discarded, another
// service's dead letter. It takes the stream from the configuration, and
// --relay-stream still overrides it.
func TestDLQRelayUsesConfiguredStream(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newOpsFixture(t)
	mine := f.cfg.NATS.DeadLetterStream
	for _, sc := range []jetstream.StreamConfig{
		{Name: "OUTBOX_DLQ", Subjects: []string{"other_dlq.>"}},
		{Name: mine, Subjects: []string{f.cfg.Router.DeadLetterFilter()}},
	} {
		if _, err := f.js.CreateStream(ctx, sc); err != nil {
			t.Fatal(err)
		}
	}
	record := func(subject, id string) {
		m := nats.NewMsg(subject)
		m.Header.Set("Nats-Msg-Id", id)
		m.Header.Set("Outbox-Table", "public.outbox")
		m.Header.Set("Outbox-DLQ-Reason-Class", "missing_field")
		m.Data = []byte(`{"table":"public.outbox","row":{}}`)
		if _, err := f.js.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	record("other_dlq.public_outbox", "theirs")
	record(f.cfg.Router.DeadLetterSubject+".public_outbox", "ours")

	out, err := f.cli("dlq", "--relay", "list", "-o", "json")
	if err != nil {
		t.Fatalf("list: %v\n%s", err, out)
	}
	if !strings.Contains(out, `"ours"`) || strings.Contains(out, `"theirs"`) {
		t.Fatalf("dlq --relay list shows another stream's records:\n%s", out)
	}
	if out, err := f.cli("dlq", "--relay", "discard", "1", "--actor", "test", "--reason", "fixed"); err != nil || !strings.Contains(out, mine) {
		t.Fatalf("discard: %v\n%s", err, out)
	}
	for stream, want := range map[string]uint64{"OUTBOX_DLQ": 1, mine: 0} {
		if n := relaytest.StreamCount(ctx, f.js, stream); n != want {
			t.Errorf("%s holds %d records after the discard, want %d", stream, n, want)
		}
	}
	out, err = f.cli("dlq", "--relay", "--relay-stream", "OUTBOX_DLQ", "list", "-o", "json")
	if err != nil || !strings.Contains(out, `"theirs"`) {
		t.Fatalf("--relay-stream OUTBOX_DLQ list: %v\n%s", err, out)
	}
}

// relayThenTeardown relays n events with a 1s duplicate window, stops the
// relay and tears the slot down.
func relayThenTeardown(t *testing.T, n int) *opsFixture {
	t.Helper()
	ctx := context.Background()
	f := newOpsFixture(t)
	f.cfg.NATS.DuplicateWindow = time.Second
	f.cfg.Reconcile.Interval = 0
	stop := f.start() // auto_setup with backfill: creates the slot and the streams
	f.insert(ctx, n, "RegistrationConfirmed")
	if !testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.js, f.stream) == uint64(n) }) {
		t.Fatal("events not relayed")
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if out, err := f.cli("teardown", "--yes"); err != nil {
		t.Fatalf("teardown: %v\n%s", err, out)
	}
	return f
}

// backfillAfterWindow waits out the stream's 1s duplicate window (it
// would hide second copies) and runs the backfill that setup runs.
func (f *opsFixture) backfillAfterWindow() relay.BackfillReport {
	f.t.Helper()
	time.Sleep(1500 * time.Millisecond)
	nc, err := nats.Connect(f.cfg.NATS.URL)
	if err != nil {
		f.t.Fatal(err)
	}
	defer nc.Close()
	rep, err := backfill(context.Background(), f.cfg, nc, zaptest.NewLogger(f.t), io.Discard)
	if err != nil {
		f.t.Fatal(err)
	}
	return rep
}

// Issue 17, case 3: a slot created again (setup after teardown, auto_setup
// after a lost slot) backfilled every row of the table, since the relay
// never marks rows published: past the duplicate window each event was
// stored twice. The backfill now publishes only the rows whose event the
// stream lacks: here the five written while there was no slot.
func TestSetupAfterTeardownBackfillsOnlyWhatTheStreamLacks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := relayThenTeardown(t, 50)
	f.insert(ctx, 5, "RegistrationConfirmed") // no slot: only a backfill can relay these
	rep := f.backfillAfterWindow()
	if !rep.SlotCreated || rep.Rows != 5 || rep.AlreadyStreamed != 50 {
		t.Errorf("backfill after teardown: %+v, want 5 rows published and 50 already in the stream", rep)
	}
	ids := map[string]int{}
	for _, m := range relaytest.ReadStream(ctx, t, f.js, f.stream) {
		ids[m.Event.ID]++
	}
	for id, n := range ids {
		if n != 1 {
			t.Errorf("event %s stored %d times", id, n)
		}
	}
	if len(ids) != 55 || relaytest.StreamCount(ctx, f.js, f.stream) != 55 {
		t.Errorf("stream holds %d messages of %d events, want 55", relaytest.StreamCount(ctx, f.js, f.stream), len(ids))
	}
}

// Issue 17, cases 3 and 5 together: a backfill after teardown does not
// republish rows whose events the stream's limits removed (consumers may
// have applied and forgotten them); it reports them, as reconcile does.
func TestBackfillSkipsRowsOlderThanTheStreamsHead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := relayThenTeardown(t, 30)
	s, err := f.js.Stream(ctx, f.stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sc := info.Config
	sc.MaxMsgs = 10 // the first 20 events go
	if _, err := f.js.UpdateStream(ctx, sc); err != nil {
		t.Fatal(err)
	}
	// Rows written while there was no slot, dated past the stream's head
	// plus the clock-skew margin.
	for i := 0; i < 3; i++ {
		if _, err := f.db.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, occurred_at)
VALUES ($1, 'registration', 'later', $2, 'E', '{}', now() + interval '2 minutes')`, uuid.NewString(), i+1); err != nil {
			t.Fatal(err)
		}
	}
	rep := f.backfillAfterWindow()
	if rep.Rows != 3 || rep.AlreadyStreamed != 10 || rep.Expired != 20 {
		t.Errorf("backfill: %+v, want 3 published, 10 already in the stream, 20 expired", rep)
	}
	if n := relaytest.StreamCount(ctx, f.js, f.stream); n != 10 {
		t.Errorf("stream holds %d (max_msgs 10)", n)
	}
	if info, err = s.Info(ctx); err != nil || info.State.LastSeq != 33 {
		t.Errorf("stream last sequence %d, want 33: 3 stored: %v", info.State.LastSeq, err)
	}
}

// Issue 17, case 8: teardown dropped whatever slot had the configured
// name, although setup refuses a slot of another plugin or database. It
// now refuses it too, naming the owner, and leaves the slot alone.
func TestTeardownRefusesAnotherOwnersSlot(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newOpsFixture(t)
	other := testenv.Get(t).NewDatabase(t)
	slot := f.cfg.Postgres.Slot
	for _, c := range []struct {
		name, create, want string
		db                 *testenv.Database
	}{
		{"plugin", "SELECT pg_create_logical_replication_slot($1, 'test_decoding')", `plugin "test_decoding"`, f.db},
		{"database", "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", `in database "` + other.Name + `"`, other},
		{"physical", "SELECT pg_create_physical_replication_slot($1)", "physical slot", f.db},
	} {
		if _, err := c.db.Pool.Exec(ctx, c.create, slot); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		out, err := f.cli("teardown", "--yes")
		if !errors.Is(err, replication.ErrSlotMismatch) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: teardown: %v (want ErrSlotMismatch naming %s)\n%s", c.name, err, c.want, out)
		}
		var exists bool
		if err := f.db.Pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)", slot).Scan(&exists); err != nil || !exists {
			t.Fatalf("%s: the slot was dropped (%v)", c.name, err)
		}
		if _, err := f.db.Pool.Exec(ctx, "SELECT pg_drop_replication_slot($1)", slot); err != nil {
			t.Fatal(err)
		}
	}
}

// Issue 17, case 9: backfill and repair read rows as text and route them
// like pgoutput's output, whose timestamps the router parses in ISO form.
// With the database's DateStyle 'SQL, DMY' backfill dead-lettered every row
// and repair failed. Every connection the tools open now sets DateStyle
// ISO and TimeZone UTC.
func TestBackfillAndRepairIgnoreTheDatabasesDateStyle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newOpsFixture(t)
	f.cfg.NATS.DuplicateWindow = time.Second
	f.cfg.Reconcile.Interval = 0
	if _, err := f.db.Pool.Exec(ctx, fmt.Sprintf(`ALTER DATABASE %q SET DateStyle = 'SQL, DMY'; ALTER DATABASE %q SET TimeZone = 'Asia/Kolkata'`, f.db.Name, f.db.Name)); err != nil {
		t.Fatal(err)
	}
	f.insert(ctx, 5, "RegistrationConfirmed") // before the slot: the backfill publishes them
	f.start()
	if !testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.js, f.stream) == 5 }) {
		t.Fatalf("backfill stored %d events and %d dead letters, want 5 events", relaytest.StreamCount(ctx, f.js, f.stream), relaytest.StreamCount(ctx, f.js, f.cfg.NATS.DeadLetterStream))
	}
	if n := relaytest.StreamCount(ctx, f.js, f.cfg.NATS.DeadLetterStream); n != 0 {
		t.Fatalf("backfill dead-lettered %d rows", n)
	}
	s, err := f.js.Stream(ctx, f.stream)
	if err != nil {
		t.Fatal(err)
	}
	for seq := uint64(2); seq <= 3; seq++ {
		if err := s.DeleteMsg(ctx, seq); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(1100 * time.Millisecond) // past the 1s duplicate window
	var out bytes.Buffer
	flags := reconcileFlags{since: "1h", list: 20, confirmWait: 10 * time.Second, clockSkew: time.Minute, maxRows: 1000, repair: true, asJSON: true}
	if err := runReconcile(ctx, &out, f.cfg, flags); err != nil {
		t.Fatalf("repair: %v\n%s", err, out.String())
	}
	var res reconcileOutput
	if err := json.Unmarshal(out.Bytes(), &res); err != nil {
		t.Fatal(err)
	}
	if res.Repair == nil || res.Repair.Published != 2 || len(res.Repair.Failed) != 0 || res.After.Total.Missing != 0 {
		t.Fatalf("repair: %+v, after %+v", res.Repair, res.After)
	}
}

// Issue 17, likely case: --include-pending republished what a running relay
// was still publishing; a relay lagging past the duplicate window then
// stored them twice. It is refused while the slot is active.
func TestIncludePendingRefusedWhileTheSlotIsActive(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newOpsFixture(t)
	f.cfg.Reconcile.Interval = 0
	stop := f.start()
	flags := reconcileFlags{since: "1h", list: 20, confirmWait: -1, clockSkew: time.Minute, maxRows: 1000, repair: true, includePending: true}
	var out bytes.Buffer
	if err := runReconcile(ctx, &out, f.cfg, flags); !errors.Is(err, replication.ErrSlotInUse) || !strings.Contains(err.Error(), "stop it first") {
		t.Fatalf("--include-pending with a running relay: %v", err)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	// Stopped: the slot is released soon after.
	if !testenv.WaitFor(20*time.Second, func() bool {
		out.Reset()
		return runReconcile(ctx, &out, f.cfg, flags) == nil
	}) {
		t.Fatalf("--include-pending with the relay stopped:\n%s", out.String())
	}
}
