package faults

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The NATS server is shut down and restarted on the same store directory
// while events keep being committed: the relay retries (never confirming
// what was not acked), reconnects, and re-sends; nothing is lost, reordered
// or stored twice. The long outage (> 30 s) outlasts the client's and the
// relay's short timers; it runs under OUTBOX_CHAOS=1.
func TestNATSRestart(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		outage time.Duration
		long   bool
	}{
		{"short", 3 * time.Second, false},
		{"long", 35 * time.Second, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.long && !chaos {
				t.Skip("long outage: OUTBOX_CHAOS=1 (make chaos)")
			}
			t.Parallel()
			ns, err := testenv.StartNATS()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(ns.Close)
			s := newScenario(t, testenv.Get(t).PG, ns.URL)
			s.sample()
			ctx := context.Background()
			s.startRelay()
			ld := startLoad(t, s.db.Pool, loadSpec{Writers: 2, Aggregates: 100, TxRows: []int{1, 1, 10}, Pause: 2 * time.Millisecond})
			s.waitCount(s.stream, 300, 30*time.Second)
			_, last := s.streamState(ctx, s.stream)
			ns.Stop()
			s.logf("nats stopped")
			time.Sleep(tc.outage)
			if err := ns.Start(); err != nil {
				t.Fatal(err)
			}
			s.logf("nats started")
			// A margin over the last sequence seen: a few publishes may have
			// been stored between that look and the shutdown.
			recovery := s.waitProgress(last+50, 90*time.Second)
			time.Sleep(time.Second) // steady state again, under load
			ld.stop()
			o := s.verify(2 * time.Minute)
			s.mustHold(fmt.Sprintf("nats restart, %s outage", tc.outage), o, recovery, "same store dir")
		})
	}
}

// A three-node cluster with an R3 stream loses the stream's leader in the
// middle of the load. Publishes in flight fail or time out while a new
// leader is elected; the relay retries them without reordering and follows
// the new leader: in fast-ingest batches (a failed batch stores nothing
// after its failure; the rest is re-sent in order) and per aggregate (one
// unacknowledged message per aggregate).
func TestNATSClusterLeaderLoss(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"auto", "off"} {
		t.Run("batch_publish="+mode, func(t *testing.T) {
			t.Parallel()
			natsClusterLeaderLoss(t, mode)
		})
	}
}

func natsClusterLeaderLoss(t *testing.T, batchPublish string) {
	cl, err := testenv.StartCluster(3)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	s := newScenario(t, testenv.Get(t).PG, cl.URL())
	s.set("nats.replicas", 3)
	s.set("nats.batch_publish", batchPublish)
	// An R3 file stream is what nats.require_durable_stream asks for.
	s.set("nats.require_durable_stream", true)
	port, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	s.set("http.listen", fmt.Sprintf("127.0.0.1:%d", port))
	s.sample()
	ctx := context.Background()
	s.startRelay()
	s.waitSlotActive(30 * time.Second)
	if got := s.streamInfo(ctx, s.stream).Config.AllowBatchPublish; got != (batchPublish != "off") {
		t.Fatalf("created stream allow_batched %v with nats.batch_publish %s", got, batchPublish)
	}
	ld := startLoad(t, s.db.Pool, loadSpec{Writers: 3, Aggregates: 150, TxRows: []int{1, 1, 10}, Pause: 2 * time.Millisecond})
	kills := 1
	if chaos {
		kills = 3
	}
	var worst time.Duration
	for k := 0; k < kills; k++ {
		n, _ := s.streamState(ctx, s.stream)
		s.waitCount(s.stream, n+300, 60*time.Second)
		leader, err := cl.StreamLeader(ctx, s.js, s.stream)
		if err != nil {
			t.Fatal(err)
		}
		_, last := s.streamState(ctx, s.stream)
		cl.Nodes[leader].Stop()
		s.logf("killed stream leader %s", cl.Names[leader])
		// A margin over the last sequence seen: a few publishes may have
		// been stored between that look and the kill.
		rec := s.waitProgress(last+50, 60*time.Second)
		worst = max(worst, rec)
		if nl, err := cl.StreamLeader(ctx, s.js, s.stream); err == nil {
			s.logf("new leader %s after %s", cl.Names[nl], rec.Round(time.Millisecond))
		}
		if err := cl.Nodes[leader].Start(); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(time.Second)
	ld.stop()
	if v := metricValue(scrape(t, fmt.Sprintf("http://127.0.0.1:%d/metrics", port)), "outbox_relay_stream_durable"); v != "1" {
		t.Errorf("outbox_relay_stream_durable = %q on an R3 file stream, want 1", v)
	}
	if rep, _ := s.statusJSON(); rep["durable_acks"] != true {
		t.Errorf("status: durable_acks %v on an R3 file stream, want true", rep["durable_acks"])
	}
	o := s.verify(2 * time.Minute)
	s.mustHold("nats R3 stream leader killed, batch_publish "+batchPublish, o, worst, fmt.Sprintf("%d leader kill(s), 3 nodes", kills))
}
