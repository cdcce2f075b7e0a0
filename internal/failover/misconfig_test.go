package failover

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// TestFailoverMisconfigured runs the relay on PostgreSQL 17 with a failover
// slot, a standby whose sync_replication_slots is off and a primary
// without synchronized_standby_slots: a failover then would lose the slot
// (and could keep phantom events in the stream). The relay says so in its
// log, outbox_relay_failover_at_risk and `status`, each naming the setting;
// once both settings are fixed, it says the failover is safe again.
func TestFailoverMisconfigured(t *testing.T) {
	needMajor(t, 17, "a failover slot")
	t.Parallel()
	c := newCluster(t, clusterOptions{failoverSlot: true, standby: testenv.StandbyOptions{NoSlotSync: true, NoSynchronizedSlots: true}})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	port, err := testenv.FreePort()
	testenv.Must(t, err, "free port")
	cfg := c.writeConfig(map[string]any{"http.listen": fmt.Sprintf("127.0.0.1:%d", port), "metrics.poll_interval": "300ms"})
	out, code := c.run(time.Minute, nil, "setup", "--config", cfg)
	if code != 0 {
		t.Fatalf("setup exited %d:\n%s", code, out)
	}
	p := c.start("run", "--config", cfg)
	atRisk := func() float64 {
		m, err := metrics.Scrape(ctx, http.DefaultClient, fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
		if err != nil {
			return -1
		}
		if v, ok := m["outbox_relay_failover_at_risk"]; ok {
			return v
		}
		return -1
	}
	if !testenv.WaitFor(30*time.Second, func() bool { return atRisk() == 1 }) {
		t.Fatalf("outbox_relay_failover_at_risk = %v, want 1", atRisk())
	}
	p.waitLog(t, "a failover now would lose the replication slot", 10*time.Second)
	for _, setting := range []string{"synchronized_standby_slots", "sync_replication_slots"} {
		if !strings.Contains(p.output(), setting) {
			t.Errorf("the relay's warning does not name %s:\n%s", setting, p.output())
		}
	}
	status := func() (replication.FailoverReport, string, int) {
		out, code := c.run(30*time.Second, nil, "status", "--json", "--config", cfg)
		var rep struct {
			Failover *replication.FailoverReport `json:"failover"`
			Problems []string                    `json:"problems"`
		}
		if err := json.Unmarshal([]byte(out), &rep); err != nil || rep.Failover == nil {
			t.Fatalf("status --json: %v:\n%s", err, out)
		}
		return *rep.Failover, strings.Join(rep.Problems, "\n"), code
	}
	rep, problems, code := status()
	if code != 1 || !rep.AtRisk() || !strings.Contains(problems, "a failover now would lose the slot") ||
		!strings.Contains(problems, "synchronized_standby_slots") || !strings.Contains(problems, "sync_replication_slots is off") {
		t.Fatalf("status exited %d with problems:\n%s", code, problems)
	}
	t.Logf("status while misconfigured:\n%s", problems)

	// The fix, as the problems name it.
	testenv.Must(t, c.primary.SetSynchronizedStandbySlots(ctx, c.standby.PhysicalSlot), "set synchronized_standby_slots")
	testenv.Must(t, c.standby.Exec(ctx, "ALTER SYSTEM SET sync_replication_slots = on"), "set sync_replication_slots")
	testenv.Must(t, c.standby.Exec(ctx, "SELECT pg_reload_conf()"), "reload the standby")
	poked := time.Time{}
	if !testenv.WaitFor(time.Minute, func() bool {
		if time.Since(poked) > 500*time.Millisecond {
			// See waitFailoverReady: the primary's slot must move for the
			// standby to persist its copy.
			poked = time.Now()
			_ = c.primary.Exec(ctx, "SELECT pg_log_standby_snapshot()")
		}
		return atRisk() == 0
	}) {
		rep, problems, _ := status()
		t.Fatalf("outbox_relay_failover_at_risk stays %v after the fix: %+v\n%s\n%s", atRisk(), rep, problems, c.standby.Log())
	}
	p.waitLog(t, "failover readiness restored", 10*time.Second)
	rep, problems, code = status()
	if code != 0 || rep.AtRisk() || len(rep.Checked) != 1 || !rep.Checked[0].Ready {
		t.Fatalf("status after the fix exited %d: %+v\n%s", code, rep, problems)
	}
}
