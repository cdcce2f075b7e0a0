package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

func TestStartupRetryable(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"connection refused", &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}, true},
		{"dns", fmt.Errorf("connect: %w", &net.DNSError{Err: "no such host", Name: "db"}), true},
		{"server starting up", &pgconn.PgError{Code: "57P03"}, true},
		{"too many connections", &pgconn.PgError{Code: "53300"}, true},
		{"wrong password", &pgconn.PgError{Code: "28P01"}, false},
		{"no pg_hba entry", &pgconn.PgError{Code: "28000"}, false},
		{"no such database", &pgconn.PgError{Code: "3D000"}, false},
		{"permission denied", &pgconn.PgError{Code: "42501"}, false},
		{"lost slot", fmt.Errorf("setup: %w", replication.ErrSlotLost), false},
		{"something else", errors.New("x"), false},
	} {
		if got := startupRetryable(c.err); got != c.want {
			t.Errorf("%s: startupRetryable = %v, want %v", c.name, got, c.want)
		}
	}
	if lingerHelps(&pgconn.PgError{Code: "28P01"}) || !lingerHelps(fmt.Errorf("x: %w", replication.ErrSlotLost)) {
		t.Error("lingerHelps: linger for a lost slot only")
	}
}

// forwarder accepts on a loopback port once started and forwards each
// connection to target: a server that comes up after the relay.
type forwarder struct {
	port   int
	target string
}

// postgresLater points the fixture's postgres.url at a forwarder to its
// server that nothing listens on until the test starts it.
func postgresLater(t *testing.T, f *opsFixture) *forwarder {
	t.Helper()
	u, err := url.Parse(f.cfg.Postgres.URL)
	if err != nil {
		t.Fatal(err)
	}
	port, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	fw := &forwarder{port: port, target: u.Host}
	u.Host = fmt.Sprintf("127.0.0.1:%d", port)
	f.cfg.Postgres.URL = u.String()
	return fw
}

func (f *forwarder) start(t *testing.T) {
	ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", f.port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				s, err := net.Dial("tcp", f.target)
				if err != nil {
					return
				}
				defer s.Close()
				go func() { _, _ = io.Copy(s, c); s.Close() }()
				_, _ = io.Copy(c, s)
			}()
		}
	}()
}

// With NATS and PostgreSQL down at start, `run` waits for them, serving
// /healthz 200 and /readyz 503 meanwhile, and streams once they are up (it
// exited after 10 s without NATS, and at once without PostgreSQL, serving
// no /healthz).
func TestRunWaitsForServersAtStart(t *testing.T) {
	t.Parallel()
	f := newOpsFixture(t)
	fw := postgresLater(t, f)
	f.ns.Stop()

	stop := testenv.Background(context.Background(), t, func(ctx context.Context) error {
		return run(ctx, f.cfg, zaptest.NewLogger(t))
	})
	if !testenv.WaitFor(10*time.Second, func() bool { return f.get("/healthz") == http.StatusOK }) {
		t.Fatal("/healthz not served while NATS is down")
	}
	if got := f.get("/readyz"); got != http.StatusServiceUnavailable {
		t.Fatalf("/readyz = %d while NATS is down, want 503", got)
	}
	if _, ok := f.scrape().value("outbox_relay_ready"); !ok {
		t.Error("outbox_relay_ready not exported while waiting")
	}
	if err := f.ns.Start(); err != nil {
		t.Fatal(err)
	}
	// NATS is up; PostgreSQL is still unreachable: still not ready.
	if !testenv.WaitFor(10*time.Second, func() bool { return f.get("/healthz") == http.StatusOK }) {
		t.Fatal("/healthz not served while PostgreSQL is down")
	}
	if got := f.get("/readyz"); got != http.StatusServiceUnavailable {
		t.Fatalf("/readyz = %d while PostgreSQL is down, want 503", got)
	}
	fw.start(t)
	if !testenv.WaitFor(60*time.Second, func() bool { return f.get("/readyz") == http.StatusOK }) {
		t.Fatal("the relay is not ready within 60s of both servers coming up")
	}
	ctx := context.Background()
	f.insert(ctx, 5, "Happened")
	f.waitMetrics(30*time.Second, cc("outbox_relay_events_published_total", atLeast, 5))
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
}

// A refusal that waiting does not cure (here a database that does not
// exist; a wrong password is the same SQLSTATE class of "the server said
// no") ends `run` at once, without the linger meant for slot alerts.
func TestRunRefusalExitsAtOnce(t *testing.T) {
	t.Parallel()
	f := newOpsFixture(t)
	u, err := url.Parse(f.cfg.Postgres.URL)
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/no_such_database"
	f.cfg.Postgres.URL = u.String()
	f.cfg.HTTP.LingerOnError = time.Minute
	start := time.Now()
	err = run(context.Background(), f.cfg, zaptest.NewLogger(t))
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "3D000" {
		t.Fatalf("run = %v, want SQLSTATE 3D000", err)
	}
	if took := time.Since(start); took > 20*time.Second {
		t.Errorf("run took %s to give up on a missing database (linger 1m must not apply)", took)
	}
}

// nats.max_age reaches the event stream the relay creates, not the
// dead-letter stream.
func TestCreatedStreamsMaxAge(t *testing.T) {
	t.Parallel()
	f := newOpsFixture(t)
	f.cfg.NATS.MaxAge = 3 * time.Hour
	ctx := context.Background()
	events, dlq := f.cfg.Streams()
	for _, c := range []struct {
		spec provision.StreamSpec
		want time.Duration
	}{{events, 3 * time.Hour}, {dlq, 0}} {
		rep, err := provision.EnsureStream(ctx, f.js, c.spec, true)
		if err != nil {
			t.Fatal(err)
		}
		if got := rep.Info.Config.MaxAge; got != c.want {
			t.Errorf("stream %s: max_age %s, want %s", c.spec.Name, got, c.want)
		}
	}
}

// Stopping `run` logs no failure (a poll cut off by the shutdown said
// "poll replication slot failed ... operation was canceled"), and a start
// warns once per stream about non-durable acks (it warned four times, twice
// under the backfill logger when nothing was backfilled).
func TestCleanExitLogsNoFailure(t *testing.T) {
	t.Parallel()
	f := newOpsFixture(t)
	core, logs := observer.New(zap.InfoLevel)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx, f.cfg, zap.New(core)) }()
	if !testenv.WaitFor(30*time.Second, func() bool { return f.get("/readyz") == http.StatusOK }) {
		t.Fatal("the relay is not ready within 30s")
	}
	f.insert(ctx, 3, "Happened")
	f.waitMetrics(30*time.Second, cc("outbox_relay_events_published_total", atLeast, 3))
	durability := map[string]int{}
	for _, e := range logs.All() {
		if e.Level >= zap.WarnLevel && strings.Contains(e.Message, "acks are not durable") {
			durability[fmt.Sprint(e.ContextMap()["stream"])]++
		} else if e.Level >= zap.WarnLevel {
			t.Errorf("warning at start: %s %v", e.Message, e.ContextMap())
		}
	}
	if len(durability) != 2 || durability[f.stream] != 1 || durability[f.stream+"_DLQ"] != 1 {
		t.Errorf("durability warnings per stream: %v, want one for each of the two streams", durability)
	}
	before := logs.Len()
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run: %v", err)
	}
	for _, e := range logs.All()[before:] {
		if e.Level >= zap.WarnLevel {
			t.Errorf("%s at exit: %s %v", e.Level, e.Message, e.ContextMap())
		}
	}
}

// The slot gauges are polled again when streaming begins: with an hour's
// poll interval, and PostgreSQL unreachable for the first poll, they still
// show the active slot within seconds of /readyz (they kept the state from
// before the start for a whole interval).
func TestGaugesPolledWhenStreamingBegins(t *testing.T) {
	t.Parallel()
	f := newOpsFixture(t)
	f.cfg.Metrics.PollInterval = time.Hour
	fw := postgresLater(t, f)
	testenv.Background(context.Background(), t, func(ctx context.Context) error {
		return run(ctx, f.cfg, zaptest.NewLogger(t))
	})
	if !testenv.WaitFor(10*time.Second, func() bool { return f.get("/healthz") == http.StatusOK }) {
		t.Fatal("/healthz not served")
	}
	f.waitMetrics(30*time.Second, cc("outbox_relay_slot_poll_errors_total", atLeast, 1))
	fw.start(t)
	if !testenv.WaitFor(60*time.Second, func() bool { return f.get("/readyz") == http.StatusOK }) {
		t.Fatal("the relay is not ready within 60s")
	}
	f.waitMetrics(10*time.Second, cc("outbox_relay_slot_active", eq, 1), cc("outbox_relay_slot_exists", eq, 1))
}

// A standby answers /readyz with 503 and /readyz?standby=ok with 200; the
// streaming instance answers 200 to both; when it stops, the standby takes
// over and answers /readyz with 200.
func TestReadyzStandby(t *testing.T) {
	t.Parallel()
	f := newOpsFixture(t)
	stopActive := f.start()
	port, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	standbyCfg := f.cfg
	standbyCfg.HTTP.Listen = fmt.Sprintf("127.0.0.1:%d", port)
	standby := &opsFixture{t: t, url: fmt.Sprintf("http://127.0.0.1:%d", port)}
	testenv.Background(context.Background(), t, func(ctx context.Context) error {
		return run(ctx, standbyCfg, zaptest.NewLogger(t))
	})
	if !testenv.WaitFor(30*time.Second, func() bool { return standby.get("/readyz?standby=ok") == http.StatusOK }) {
		t.Fatal("the standby is not ready as a standby within 30s")
	}
	if got := standby.get("/readyz"); got != http.StatusServiceUnavailable {
		t.Errorf("standby /readyz = %d, want 503", got)
	}
	if got := f.get("/readyz?standby=ok"); got != http.StatusOK {
		t.Errorf("active /readyz?standby=ok = %d, want 200", got)
	}
	// Issue 27: status said only "ready false" of a healthy standby.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if rl := collectStatus(ctx, standbyCfg).Relay; rl == nil || !rl.Standby || relayState(rl) != "standby, healthy, waiting for the slot (another instance streams from it)" {
		t.Errorf("status of the standby: %+v", rl)
	}
	if rl := collectStatus(ctx, f.cfg).Relay; rl == nil || rl.Standby || relayState(rl) != "streaming" {
		t.Errorf("status of the active instance: %+v", rl)
	}
	if err := stopActive(); err != nil {
		t.Fatal(err)
	}
	if !testenv.WaitFor(30*time.Second, func() bool { return standby.get("/readyz") == http.StatusOK }) {
		t.Fatal("the standby did not take over within 30s")
	}
}

// A stop while `run` still waits for a server is a clean exit: no error
// logged, nil returned (it logged "relay stopped: context canceled").
func TestStopWhileWaitingForServers(t *testing.T) {
	t.Parallel()
	f := newOpsFixture(t)
	f.ns.Stop()
	core, logs := observer.New(zap.InfoLevel)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx, f.cfg, zap.New(core)) }()
	if !testenv.WaitFor(10*time.Second, func() bool { return f.get("/healthz") == http.StatusOK }) {
		t.Fatal("/healthz not served while NATS is down")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run = %v, want nil", err)
	}
	for _, e := range logs.FilterLevelExact(zap.ErrorLevel).All() {
		t.Errorf("error logged: %s %v", e.Message, e.ContextMap())
	}
}

// Issue 27: with NATS down at start, the first log line came after 10 s
// with only url and waited: nats.go clears LastError after each attempt.
// It now comes within natsWaitFirstLog and carries the attempt's error.
func TestWaitNATSLogsTheCause(t *testing.T) {
	t.Parallel()
	port, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.WarnLevel)
	attempts := &natsAttempts{}
	nc, err := dialNATS(config.NATS{URL: fmt.Sprintf("nats://127.0.0.1:%d", port)}, zap.NewNop(), "test", attempts)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), natsWaitFirstLog+3*time.Second)
	defer cancel()
	start := time.Now()
	if err := waitNATS(ctx, nc, attempts, nc.Opts.Url, 0, zap.New(core)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("waitNATS = %v, want the deadline", err)
	}
	entries := logs.FilterMessage("nats unreachable at start; waiting").All()
	if len(entries) == 0 {
		t.Fatalf("no wait logged within %s", natsWaitFirstLog+3*time.Second)
	}
	first := entries[0]
	if at := first.Time.Sub(start); at > natsWaitFirstLog+time.Second {
		t.Errorf("first wait logged after %s", at)
	}
	if cause, ok := first.ContextMap()["error"].(string); !ok || !strings.Contains(cause, "connection refused") {
		t.Errorf("the wait's log line carries no cause: %v", first.ContextMap())
	}
}
