package consumer

import (
	"context"
	"fmt"
	"sync/atomic"
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

// TestSeqRingForgetsTheLowestFirst: the ring of lately settled stream
// sequences holds a window of them that slides up as higher ones come,
// forgetting the lowest first, ignores one below its window, and keeps what
// fits when it is resized.
func TestSeqRingForgetsTheLowestFirst(t *testing.T) {
	var r seqRing
	r.add(5) // unsized: holds nothing
	if r.has(5) {
		t.Fatal("an unsized ring holds 5")
	}
	r.resize(2) // two words: a window of 128 sequences
	check := func(step string, want map[uint64]bool) {
		t.Helper()
		for seq, w := range want {
			if got := r.has(seq); got != w {
				t.Errorf("%s: has(%d) = %v, want %v", step, seq, got, w)
			}
		}
	}
	for _, seq := range []uint64{70, 5, 127, 70} {
		r.add(seq)
	}
	check("within the window", map[uint64]bool{5: true, 70: true, 127: true, 6: false, 128: false})
	r.add(130) // the window moves to 64..191: 5 goes
	check("slid by one word", map[uint64]bool{5: false, 70: true, 127: true, 130: true})
	r.add(10) // below the window: not held
	check("below the window", map[uint64]bool{10: false, 70: true})
	r.add(300) // 256..383: everything before goes
	check("slid past everything", map[uint64]bool{70: false, 127: false, 130: false, 300: true})
	r.resize(4)
	r.add(200) // the wider window 192..447 holds it beside 300
	check("resized", map[uint64]bool{300: true, 200: true, 199: false})
	if len(r.bits) != 4 {
		t.Errorf("resized to %d words, want 4", len(r.bits))
	}
}

// TestFeedCostPerDelivery: the feed parses a delivery's JetStream
// metadata (the reply subject) once, and carries it to the gap check, the
// repeat look-ups and the item; the old feed parsed it three times per
// delivery (1,053 parses for 351 deliveries).
func TestFeedCostPerDelivery(t *testing.T) {
	f := newFixture(t)
	const aggregates, versions = 30, 10
	for v := 1; v <= versions; v++ {
		for a := range aggregates {
			f.publish(event{ID: uuidN(v*1000 + a), AggID: fmt.Sprintf("agg-%d", a), Version: int64(v)})
		}
	}
	cfg := f.baseConfig("cost")
	c, err := New(f.pool, f.js, cfg, newRecorder(cfg.Name), WithLogger(zaptest.NewLogger(t)), WithRegisterer(f.reg))
	testenv.Must(t, err, "new consumer")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	strm, err := f.js.Stream(ctx, f.stream)
	testenv.Must(t, err, "look up the stream")
	src := &countingSource{durableSource: &durableSource{c: c, strm: strm}}
	e := &engine{c: c, src: src}
	done := make(chan error, 1)
	go func() { done <- e.run(ctx) }()
	f.waitSettled(cfg.Name, time.Minute)
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run: %v", err)
	}
	parses, deliveries := src.parses.Load(), src.deliveries.Load()
	t.Logf("%d metadata parses for %d deliveries", parses, deliveries)
	if deliveries < aggregates*versions {
		t.Fatalf("%d deliveries of %d events", deliveries, aggregates*versions)
	}
	if parses > deliveries {
		t.Errorf("%d metadata parses for %d deliveries: want one per delivery", parses, deliveries)
	}
}

// countingSource is a plain durable whose deliveries count their
// metadata parses.
type countingSource struct {
	*durableSource
	parses, deliveries atomic.Int64
}

func (s *countingSource) setUp(ctx context.Context) error {
	if err := s.durableSource.setUp(ctx); err != nil {
		return err
	}
	s.cons = countingConsumer{Consumer: s.cons, s: s}
	return nil
}

type countingConsumer struct {
	jetstream.Consumer
	s *countingSource
}

func (c countingConsumer) Messages(opts ...jetstream.PullMessagesOpt) (jetstream.MessagesContext, error) {
	iter, err := c.Consumer.Messages(opts...)
	if err == nil {
		iter = countingIter{MessagesContext: iter, s: c.s}
	}
	return iter, err
}

type countingIter struct {
	jetstream.MessagesContext
	s *countingSource
}

func (it countingIter) Next(opts ...jetstream.NextOpt) (jetstream.Msg, error) {
	msg, err := it.MessagesContext.Next(opts...)
	if err != nil {
		return nil, err
	}
	it.s.deliveries.Add(1)
	return countingMsg{Msg: msg, s: it.s}, nil
}

type countingMsg struct {
	jetstream.Msg
	s *countingSource
}

func (m countingMsg) Metadata() (*jetstream.MsgMetadata, error) {
	m.s.parses.Add(1)
	return m.Msg.Metadata()
}
