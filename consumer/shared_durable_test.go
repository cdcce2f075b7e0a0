package consumer

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestSharedDurableTwoInstances: the docs allow several processes to share
// one plain durable ("they split an aggregate's messages between them; only
// VersionCheck keeps its order then"). Each instance has its own NATS
// connection and metrics. 5,000 events over 500 aggregates are already in
// the stream; both must apply every event exactly once, finish in bounded
// time, dead-letter nothing, and with VersionCheck apply every aggregate in
// version order. Neither may keep resetting the durable because it sees
// the other's deliveries as gaps: after the few resets that show the
// durable is shared, an instance hands deliveries on as they come. Each
// reset redelivers everything unacknowledged to both, so resets without
// end cost the pair most of its throughput (two instances ~600 ev/s
// against ~4,000 for one, 20,000 events, before the feed knew).
func TestSharedDurableTwoInstances(t *testing.T) {
	for _, vc := range []bool{false, true} {
		t.Run("VersionCheck="+strconv.FormatBool(vc), func(t *testing.T) { sharedDurable(t, vc) })
	}
}

func sharedDurable(t *testing.T, versionCheck bool) {
	f := newFixture(t)
	aggregates, versions := 500, 10
	if s := os.Getenv("ATTACK_VERSIONS"); s != "" {
		versions, _ = strconv.Atoi(s)
	}
	instances := 2
	if s := os.Getenv("ATTACK_INSTANCES"); s != "" {
		instances, _ = strconv.Atoi(s)
	}
	total := int64(aggregates * versions)
	publishVersionsAsync(t, f, aggregates, versions)
	cfg := f.baseConfig("shared")
	cfg.Workers = 8
	cfg.VersionCheck = versionCheck
	cfg.GapWait = 10 * time.Second
	r := newRecorder(cfg.Name)
	start := time.Now()
	regs := startSharedInstances(t, f, cfg, r, instances)
	ok := testenv.WaitFor(3*time.Minute, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM consumed_message WHERE consumer = 'shared'`)+
			queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter`) >= total
	})
	elapsed := time.Since(start)
	applied := queryInt(t, f.pool, `SELECT count(*) FROM applied`)
	distinct := queryInt(t, f.pool, `SELECT count(DISTINCT event_id) FROM applied`)
	dead := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter`)
	disorder := queryInt(t, f.pool, `SELECT count(*) FROM (
		SELECT version, row_number() OVER (PARTITION BY aggregate_id ORDER BY n) AS pos FROM applied) o WHERE version <> pos`)
	calls := 0
	r.mu.Lock()
	for _, n := range r.calls {
		calls += n
	}
	r.mu.Unlock()
	var resets []map[string]float64
	for _, reg := range regs {
		resets = append(resets, resumesByReason(t, reg))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var redelivered int
	if cons, err := f.js.Consumer(ctx, f.stream, cfg.Name); err == nil {
		if info, err := cons.Info(ctx); err == nil {
			redelivered = info.NumRedelivered
		}
	}
	t.Logf("%d instances, VersionCheck=%v: done=%v in %s (%.0f ev/s); applied %d (distinct %d), handler calls %d, dead-lettered %d, out of version order %d, resets per instance %v, redelivered pending %d",
		instances, versionCheck, ok, elapsed.Round(time.Millisecond), float64(applied)/elapsed.Seconds(), applied, distinct, calls, dead, disorder, resets, redelivered)
	if !ok {
		t.Fatalf("not finished within 3 minutes: %d of %d", queryInt(t, f.pool, `SELECT count(*) FROM consumed_message WHERE consumer = 'shared'`), total)
	}
	if applied != total || distinct != total || dead != 0 {
		t.Errorf("applied %d (distinct %d), dead-lettered %d; want %d, %d, 0", applied, distinct, dead, total, total)
	}
	if versionCheck && disorder != 0 {
		t.Errorf("VersionCheck on: %d applications out of version order", disorder)
	}
	// Without VersionCheck, each instance's own resets after its start: the
	// straysToShare gaps that show it the durable is shared, and none per
	// gap after that. (With it, resets on gaps go on: they deliver the
	// pending messages in stream order again, which settles the version
	// gaps the split makes sooner than deferring them does.)
	for i, r := range resets {
		if versionCheck {
			break
		}
		if own := r[resumeGap] + r[resumeEnded] + r[resumeRecheck]; own > maxSharedResets {
			t.Errorf("instance %d reset the shared durable %.0f times (%v); want at most %d: the instances keep resetting each other",
				i, own, r, maxSharedResets)
		}
	}
}

// publishVersionsAsync publishes versions 1 to versions of each aggregate,
// one version of all of them at a time.
func publishVersionsAsync(t *testing.T, f *fixture, aggregates, versions int) {
	t.Helper()
	for v := 1; v <= versions; v++ {
		for a := range aggregates {
			e := event{ID: uuidN(v*100000 + a), AggID: fmt.Sprintf("a%d", a), Version: int64(v)}
			if _, err := f.js.PublishMsgAsync(e.msg(f.stream)); err != nil {
				t.Fatal(err)
			}
		}
		select {
		case <-f.js.PublishAsyncComplete():
		case <-time.After(30 * time.Second):
			t.Fatal("publishing timed out")
		}
	}
}

// startSharedInstances runs instances consumers of cfg on one durable, each
// on its own connection and registry, until the test ends.
func startSharedInstances(t *testing.T, f *fixture, cfg Config, r *recorder, instances int) []*prometheus.Registry {
	t.Helper()
	env := testenv.Get(t)
	var regs []*prometheus.Registry
	for i := 0; i < instances; i++ {
		nc, err := nats.Connect(env.NATS.URL, nats.MaxReconnects(-1))
		testenv.Must(t, err, "connect")
		t.Cleanup(nc.Close)
		js, err := jetstream.New(nc)
		testenv.Must(t, err, "jetstream")
		reg := prometheus.NewRegistry()
		regs = append(regs, reg)
		c, err := New(f.pool, js, cfg, r, WithLogger(zaptest.NewLogger(t).Named(fmt.Sprint("i", i))), WithRegisterer(reg))
		testenv.Must(t, err, "new consumer")
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- c.Run(ctx) }()
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
		})
	}
	return regs
}

// maxSharedResets bounds an instance's resets on a shared durable: the
// straysToShare resets that find the durable shared, and as many for gaps
// that the start's reconnect-free pulls may still explain.
const maxSharedResets = 2 * straysToShare

// resumesByReason reads outbox_consumer_resumes_total from reg, by reason.
func resumesByReason(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	testenv.Must(t, err, "gather metrics")
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "outbox_consumer_resumes_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" {
					out[l.GetValue()] += m.GetCounter().GetValue()
				}
			}
		}
	}
	return out
}
