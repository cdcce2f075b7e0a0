package faults

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// statusJSON runs `outbox-relay status --json` and decodes it.
func (s *scenario) statusJSON() (map[string]any, int) {
	s.t.Helper()
	out, code := s.runCmd(60*time.Second, nil, "status", "--json", "--config", s.writeConfig())
	var rep map[string]any
	i, j := strings.Index(out, "{"), strings.LastIndex(out, "}")
	if i < 0 || j < i || json.Unmarshal([]byte(out[i:j+1]), &rep) != nil {
		s.t.Fatalf("status --json printed no JSON (exit %d):\n%s", code, out)
	}
	return rep, code
}

// metricValue returns the value of an unlabelled metric in a Prometheus
// text exposition, or "" when absent.
func metricValue(body, name string) string {
	for _, line := range strings.Split(body, "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == name {
			return f[1]
		}
	}
	return ""
}

// A JetStream ack is only as durable as the stream. On a single-replica
// stream the relay warns in its log, `status` reports durable_acks: false
// with the reason, the metric outbox_relay_stream_durable is 0, and a
// duplicate window shorter than nats.max_expected_outage is warned about;
// with nats.require_durable_stream the relay refuses to run. (The durable
// case, an R3 file stream, is checked in TestNATSClusterLeaderLoss.)
func TestDurableAcksInspection(t *testing.T) {
	t.Parallel()
	env := testenv.Get(t)
	s := newScenario(t, env.PG, env.NATS.URL)
	s.set("nats.require_durable_stream", true)
	s.set("nats.max_expected_outage", "5m")
	ctx := context.Background()
	for _, c := range []jetstream.StreamConfig{
		{Name: s.stream, Subjects: []string{s.name + ".>"}, Storage: jetstream.FileStorage, Duplicates: 30 * time.Second},
		{Name: s.dlq, Subjects: []string{s.name + "_dlq.>"}, Storage: jetstream.FileStorage, Duplicates: 30 * time.Second},
	} {
		if _, err := s.js.CreateStream(ctx, c); err != nil {
			t.Fatal(err)
		}
	}
	s.set("nats.create_streams", false)

	out, code := s.runCmd(60*time.Second, nil, "run", "--config", s.writeConfig())
	if code == 0 || !strings.Contains(out, "require_durable_stream") || !strings.Contains(out, "replica") {
		t.Fatalf("run with require_durable_stream on an R1 stream exited %d, want a refusal naming the setting and the replicas:\n%s", code, out)
	}
	s.logf("refused: %s", lastLine(out))

	s.set("nats.require_durable_stream", false)
	port, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	s.set("http.listen", fmt.Sprintf("127.0.0.1:%d", port))
	r := s.startRelay()
	s.waitSlotActive(30 * time.Second)
	warned := func(sub string) bool {
		_, ok := r.waitLog(r.started, 10*time.Second, func(e logEntry) bool {
			return e.Level == "warn" && strings.Contains(e.Msg, s.stream+" ") && strings.Contains(e.Msg, sub)
		})
		return ok
	}
	if !warned("not durable") {
		t.Error("no warning that the stream's acks are not durable")
	}
	if !warned("duplicate window") {
		t.Error("no warning that the duplicate window (30s) is shorter than nats.max_expected_outage (5m)")
	}
	if v := metricValue(scrape(t, fmt.Sprintf("http://127.0.0.1:%d/metrics", port)), "outbox_relay_stream_durable"); v != "0" {
		t.Errorf("outbox_relay_stream_durable = %q, want 0", v)
	}
	rep, _ := s.statusJSON()
	if rep["durable_acks"] != false || rep["durable_reason"] == nil || rep["durable_reason"] == "" {
		t.Errorf("status: durable_acks %v, durable_reason %v; want false with a reason", rep["durable_acks"], rep["durable_reason"])
	}
	record(faultRow{Fault: "non-durable stream (R1) inspection", Note: "warned, status durable_acks false, metric 0, require_durable_stream refuses"})
}

// postgres.failover_slot asks for a PostgreSQL 17 failover slot; an older
// server refuses with an error that names PostgreSQL 17.
func TestFailoverSlotNeedsPostgres17(t *testing.T) {
	t.Parallel()
	env := testenv.Get(t)
	s := newScenario(t, env.PG, env.NATS.URL)
	s.set("postgres.failover_slot", true)
	ctx := context.Background()
	slot := testenv.UniqueName("failover")
	s.set("postgres.slot", slot)
	var version int
	if err := s.db.Pool.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		t.Fatal(err)
	}
	out, code := s.runCmd(60*time.Second, nil, "setup", "--config", s.writeConfig())
	if version >= 170000 {
		var failover bool
		if err := s.db.Pool.QueryRow(ctx, "SELECT failover FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&failover); err != nil || code != 0 || !failover {
			t.Fatalf("setup with failover_slot on PostgreSQL %d: exit %d, failover %v (%v):\n%s", version, code, failover, err, out)
		}
		return
	}
	if code == 0 || !strings.Contains(out, "PostgreSQL 17") {
		t.Fatalf("setup with failover_slot on PostgreSQL %d exited %d, want an error naming PostgreSQL 17:\n%s", version, code, out)
	}
	var n int
	_ = s.db.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&n)
	if n != 0 {
		t.Errorf("a slot was created although failover slots are unsupported")
	}
	s.logf("PostgreSQL %d: %s", version, lastLine(out))
}
