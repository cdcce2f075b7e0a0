package faults

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// PostgreSQL is restarted under load, first with a fast shutdown (sessions
// are terminated, a checkpoint is written) and then with an immediate one
// (a crash: the next start replays the WAL). The relay loses its
// replication connection, reconnects with capped backoff and resumes from
// the slot's confirmed position; the writers lose some transactions, and
// what the table holds afterwards is exactly what the stream must hold.
func TestPostgresRestart(t *testing.T) {
	t.Parallel()
	pg, err := testenv.StartPostgres()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	s := newScenario(t, pg, testenv.Get(t).NATS.URL)
	s.sample()
	ctx := context.Background()
	s.startRelay()
	ld := startLoad(t, s.db.Pool, loadSpec{Writers: 2, Aggregates: 100, TxRows: []int{1, 1, 10}, Pause: 2 * time.Millisecond})
	modes := []string{"fast", "immediate"}
	if chaos {
		modes = append(modes, "immediate", "fast", "immediate")
	}
	var worst time.Duration
	for _, mode := range modes {
		n, _ := s.streamState(ctx, s.stream)
		s.waitCount(s.stream, n+200, 60*time.Second)
		if err := pg.Stop(mode); err != nil {
			t.Fatal(err)
		}
		s.logf("postgres stopped (-m %s)", mode)
		time.Sleep(time.Second)
		// In-flight acks have landed by now: what comes next needs the
		// relay to be streaming again.
		_, last := s.streamState(ctx, s.stream)
		if err := pg.Start(); err != nil {
			t.Fatal(err)
		}
		s.logf("postgres started")
		rec := s.waitProgress(last, 90*time.Second)
		s.logf("relay publishing again %s after the restart", rec.Round(time.Millisecond))
		worst = max(worst, rec)
	}
	time.Sleep(time.Second)
	ld.stop()
	s.logf("load: %d committed, %d failed during restarts", ld.committed.Load(), ld.failed.Load())
	o := s.verify(2 * time.Minute)
	s.mustHold("postgres restart (fast, immediate)", o, worst, strings.Join(modes, ", "))
}

// A slot whose WAL was removed while the relay was stopped
// (max_slot_wal_keep_size exceeded) means events were lost: `run` refuses
// with an error that says so and how to recover (serving /metrics with the
// lost slot for a while first, so alerts see it), and `status` shows
// wal_status lost and exits non-zero (for monitoring scripts).
func TestSlotInvalidatedStatus(t *testing.T) {
	t.Parallel()
	pg, err := testenv.StartPostgres(testenv.WithSetting("max_slot_wal_keep_size", "1MB"), testenv.WithSetting("max_wal_size", "32MB"), testenv.WithSetting("min_wal_size", "32MB"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	s := newScenario(t, pg, testenv.Get(t).NATS.URL)
	ctx := context.Background()
	// The relay runs once (streams and creates the streams), then stops.
	r := s.startRelay()
	ld := startLoad(t, s.db.Pool, loadSpec{Writers: 1, Aggregates: 10, Events: 50})
	ld.wait()
	s.waitCount(s.stream, 50, 30*time.Second)
	if err := r.term(10 * time.Second); err != nil {
		t.Fatalf("relay stop: %v", err)
	}
	// Events committed now are in WAL the slot must keep; push WAL past
	// max_slot_wal_keep_size until the server gives up on the slot.
	startLoad(t, s.db.Pool, loadSpec{Writers: 1, Aggregates: 10, Events: 20}).wait()
	s.exec(ctx, "CREATE TABLE filler (v text)")
	if !testenv.WaitFor(60*time.Second, func() bool {
		_, _ = s.db.Pool.Exec(ctx, "INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 5000)")
		_, _ = s.db.Pool.Exec(ctx, "SELECT pg_switch_wal()")
		_, _ = s.db.Pool.Exec(ctx, "CHECKPOINT")
		st, err := s.slot(ctx)
		return err == nil && st.WALStatus == "lost"
	}) {
		t.Fatal("slot never became lost")
	}
	s.logf("slot lost")

	out, code := s.runCmd(30*time.Second, nil, "status", "--config", s.writeConfig())
	if code == 0 || !strings.Contains(out, "lost") {
		t.Fatalf("status exited %d, want non-zero and wal_status lost:\n%s", code, out)
	}
	out, code = s.runCmd(30*time.Second, nil, "status", "--json", "--config", s.writeConfig())
	var rep map[string]any
	if i := strings.Index(out, "{"); i >= 0 {
		_ = json.Unmarshal([]byte(out[i:strings.LastIndex(out, "}")+1]), &rep)
	}
	if code == 0 || rep["wal_status"] != "lost" {
		t.Fatalf("status --json exited %d with wal_status %v, want non-zero and lost:\n%s", code, rep["wal_status"], out)
	}
	out, code = s.runCmd(60*time.Second, nil, "run", "--config", s.writeConfig())
	if code == 0 {
		t.Fatalf("run exited 0 on a lost slot:\n%s", out)
	}
	for _, want := range []string{"events were lost", "teardown", "setup", "max_slot_wal_keep_size"} {
		if !strings.Contains(out, want) {
			t.Errorf("run's error does not mention %q:\n%s", want, out)
		}
	}
	t.Run("metric while NATS is down", func(t *testing.T) {
		// The slot's gauges need PostgreSQL only: they are served while
		// the relay still waits for NATS. Before, they came after NATS
		// answered, and on a loaded machine a slow broker kept them off
		// /metrics past the metric test's wait.
		port, err := testenv.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		natsPort, err := testenv.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		s.set("http.listen", fmt.Sprintf("127.0.0.1:%d", port))
		s.set("nats.url", fmt.Sprintf("nats://127.0.0.1:%d", natsPort))
		defer s.set("nats.url", s.natsURL)
		r := s.startRelay()
		defer func() { _ = r.term(10 * time.Second) }()
		body := ""
		if !testenv.WaitFor(30*time.Second, func() bool {
			resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
			if err != nil {
				return false
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			body = string(b)
			return strings.Contains(body, `outbox_relay_slot_wal_status{status="lost"} 1`)
		}) {
			t.Fatalf("/metrics does not show the lost slot while NATS is down (relay running: %v):\n%s", r.running(), body)
		}
	})
	t.Run("metric", func(t *testing.T) {
		// The slot metrics come from a running relay: it must keep serving
		// /metrics (not ready) on a lost slot for the metric to be seen.
		port, err := testenv.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		s.set("http.listen", fmt.Sprintf("127.0.0.1:%d", port))
		r := s.startRelay()
		var body string
		testenv.WaitFor(10*time.Second, func() bool {
			if !r.running() {
				return true
			}
			resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
			if err != nil {
				return false
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			body = string(b)
			return strings.Contains(body, `outbox_relay_slot_wal_status{status="lost"} 1`)
		})
		if !r.running() && body == "" {
			// Until 78e04f4 `run` exited before serving /metrics.
			t.Fatal("run exited on the lost slot without serving /metrics (http.linger_on_error)")
		}
		if !strings.Contains(body, `outbox_relay_slot_wal_status{status="lost"} 1`) {
			t.Errorf("/metrics does not show the lost slot:\n%s", body)
		}
		_ = r.term(10 * time.Second)
	})
	record(faultRow{Fault: "slot invalidated (wal_status lost)", Note: "run refuses, status exits " + itoa(code)})
}
