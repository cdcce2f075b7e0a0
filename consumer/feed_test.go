package consumer

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestPullEndsWithDeliveriesInTransit: the consumer's NATS connection
// stalls while messages are being delivered, the client gives the
// connection up (pings unanswered) and reconnects, and the deliveries that
// were in transit are lost with it. JetStream redelivers them only after
// AckWait, after the next pull's newer deliveries; without VersionCheck
// nothing in the database guards the order. The consumer must notice the
// gap in the consumer sequence and resume from the ack floor in stream
// order: every event applied once, and each aggregate's in version order.
func TestPullEndsWithDeliveriesInTransit(t *testing.T) {
	f := newFixture(t)
	env := testenv.Get(t)
	proxy, err := testenv.StartProxy(env.NATS.URL[len("nats://"):])
	testenv.Must(t, err, "proxy")
	t.Cleanup(proxy.Close)
	nc, err := nats.Connect(fmt.Sprintf("nats://127.0.0.1:%d", proxy.Port()), nats.MaxReconnects(-1),
		nats.ReconnectWait(100*time.Millisecond), nats.PingInterval(250*time.Millisecond), nats.MaxPingsOutstanding(2))
	testenv.Must(t, err, "connect through the proxy")
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	testenv.Must(t, err, "jetstream")

	cfg := f.baseConfig("transit")
	cfg.MaxAckPending = 200
	c, err := New(f.pool, js, cfg, newRecorder(cfg.Name), WithLogger(zaptest.NewLogger(t)), WithRegisterer(f.reg))
	testenv.Must(t, err, "new consumer")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()

	const aggregates, versions = 20, 60
	published := make(chan struct{})
	go func() {
		defer close(published)
		for v := 1; v <= versions; v++ {
			for a := range aggregates {
				f.publish(event{ID: uuidN(v*1000 + a), AggID: fmt.Sprintf("agg-%d", a), Version: int64(v)})
			}
			time.Sleep(40 * time.Millisecond)
		}
	}()
	// Stall mid-load, long enough for the client to drop the connection
	// with deliveries in it, then let it reconnect.
	f.waitFor("a first part applied", time.Minute, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM applied`) >= aggregates*versions/5
	})
	proxy.Stall(testenv.Both)
	time.Sleep(1500 * time.Millisecond)
	proxy.Cut()
	proxy.Heal()
	<-published
	f.waitFor("every event applied", 2*time.Minute, func() bool {
		return queryInt(t, f.pool, `SELECT count(DISTINCT event_id) FROM applied`) >= aggregates*versions
	})
	f.waitSettled(cfg.Name, time.Minute)
	twice := queryInt(t, f.pool, `SELECT count(*) FROM (SELECT event_id FROM applied GROUP BY event_id HAVING count(*) > 1) d`)
	disorder := queryInt(t, f.pool, `SELECT count(*) FROM (
		SELECT version, row_number() OVER (PARTITION BY aggregate_id ORDER BY n) AS pos FROM applied) o WHERE version <> pos`)
	t.Logf("%d events: applied twice %d, out of version order %d", aggregates*versions, twice, disorder)
	if twice != 0 || disorder != 0 {
		t.Errorf("the pull that ended lost its order: %d applied twice, %d out of version order", twice, disorder)
	}
}

// TestDoneSetForgetsTheOldestFirst: the set of lately settled stream
// sequences stays within its limit and forgets in the order it learnt.
func TestDoneSetForgetsTheOldestFirst(t *testing.T) {
	var d doneSet
	for _, seq := range []uint64{5, 3, 9, 3, 7} {
		d.add(seq, 3)
	}
	for _, tc := range []struct {
		seq  uint64
		want bool
	}{{5, false}, {3, true}, {9, true}, {7, true}, {4, false}} {
		if got := d.has(tc.seq); got != tc.want {
			t.Errorf("has(%d) = %v, want %v", tc.seq, got, tc.want)
		}
	}
	if len(d.order) != 3 || len(d.seqs) != 3 {
		t.Errorf("holds %d in order, %d in the set; want 3 and 3", len(d.order), len(d.seqs))
	}
}
