package publisher_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/publisher"
)

// connectNATS starts a NATS server of the test's own and connects to it.
func connectNATS(t *testing.T, opts ...testenv.NATSOption) *nats.Conn {
	t.Helper()
	return dialNATS(t, startNATS(t, opts...).URL)
}

// startNATS starts a NATS server of the test's own.
func startNATS(t *testing.T, opts ...testenv.NATSOption) *testenv.NATS {
	t.Helper()
	if testing.Short() {
		t.Skip("needs a NATS server")
	}
	t.Parallel()
	srv, err := testenv.StartNATS(opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	return srv
}

// dialNATS connects to url until the test ends.
func dialNATS(t *testing.T, url string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// runPublisher runs p until the test ends and returns the context to
// publish with.
func runPublisher(t *testing.T, p *publisher.Publisher) context.Context {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done; _ = p.Close() })
	return ctx
}

// TestAckTimeoutRetry answers a publish only on its second attempt and then
// answers the first, late: the message settles once, after the retry, and
// the late answer is ignored. On a loaded machine the test may answer the
// second attempt after its timeout too; that late answer settles the
// message as well (TestLateAckSettles), after a third attempt.
func TestAckTimeoutRetry(t *testing.T) {
	nc := connectNATS(t)
	// A plain subscriber stands in for the stream: it keeps the broker
	// from answering "no responders" and decides which attempt gets an ack.
	attempts := make(chan *nats.Msg, 10)
	if _, err := nc.Subscribe("acktest.>", func(m *nats.Msg) {
		select {
		case attempts <- m:
		default: // a third attempt or later: the test answers the second
		}
	}); err != nil {
		t.Fatal(err)
	}
	p, err := publisher.New(nc, publisher.Config{AckTimeout: 100 * time.Millisecond, RetryMin: 10 * time.Millisecond, RetryMax: 20 * time.Millisecond},
		publisher.WithStreamLookup(func(context.Context, string) error { return nil }))
	if err != nil {
		t.Fatal(err)
	}
	ctx := runPublisher(t, p)

	var settled atomic.Int32
	// The ack is read inside Done: the publisher reuses it afterwards.
	type outcome struct {
		attempts int
		seq      uint64
		acked    bool
	}
	results := make(chan outcome, 2)
	m := &publisher.Message{Subject: "acktest.a", Key: "a", Data: []byte("x"), Owner: publisher.OwnerFuncs{Done: func(r publisher.Result) {
		settled.Add(1)
		o := outcome{attempts: r.Attempts}
		if r.Ack.Stream != "" {
			o.seq, o.acked = r.Ack.Sequence, true
		}
		results <- o
	}}}
	if err := p.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	first := <-attempts // ignored: times out
	var second *nats.Msg
	select {
	case second = <-attempts:
	case <-time.After(5 * time.Second):
		t.Fatal("no retry after the ack timeout")
	}
	if first.Reply == second.Reply {
		t.Fatalf("retry reuses the reply subject %q", first.Reply)
	}
	if err := second.Respond([]byte(`{"stream":"S","seq":2}`)); err != nil {
		t.Fatal(err)
	}
	select {
	case res := <-results:
		if res.attempts < 2 || !res.acked || res.seq != 2 {
			t.Fatalf("result %+v, want 2 attempts or more and seq 2", res)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the answer to the second attempt did not settle the message")
	}
	// The late answer to the first attempt must not settle it again.
	if err := first.Respond([]byte(`{"stream":"S","seq":1}`)); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // give a wrong second settle the chance to show
	if n := settled.Load(); n != 1 {
		t.Fatalf("settled %d times", n)
	}
	if n := p.InFlight(); n != 0 {
		t.Fatalf("in flight %d after the ack", n)
	}
}

// TestSpaceSignalsAtLowWater fills the window, is refused, and checks that
// Space is signalled once the window has drained to three quarters, not on
// the first ack: a full window must not wake the producer per message.
func TestSpaceSignalsAtLowWater(t *testing.T) {
	nc := connectNATS(t)
	const window = 8 // low water: 6
	got := make(chan *nats.Msg, window)
	if _, err := nc.Subscribe("spacetest.>", func(m *nats.Msg) { got <- m }); err != nil {
		t.Fatal(err)
	}
	p, err := publisher.New(nc, publisher.Config{MaxInFlight: window, AckTimeout: time.Minute},
		publisher.WithStreamLookup(func(context.Context, string) error { return nil }))
	if err != nil {
		t.Fatal(err)
	}
	runPublisher(t, p)
	var settled atomic.Int32
	msg := func(i int) *publisher.Message {
		return &publisher.Message{Subject: "spacetest.x", Key: string(rune('a' + i)), Data: []byte("x"), Owner: publisher.OwnerFuncs{Done: func(publisher.Result) { settled.Add(1) }}}
	}
	for i := range window {
		if ok, err := p.TryPublish(msg(i)); !ok || err != nil {
			t.Fatalf("message %d: ok %v, err %v", i, ok, err)
		}
	}
	if ok, err := p.TryPublish(msg(window)); ok || err != nil {
		t.Fatalf("a full window accepted a message: ok %v, err %v", ok, err)
	}
	ack := func(seq int) {
		t.Helper()
		m := <-got
		if err := m.Respond([]byte(`{"stream":"S","seq":` + strconv.Itoa(seq) + `}`)); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(5 * time.Second)
		for settled.Load() < int32(seq) || p.InFlight() > window-seq {
			if time.Now().After(deadline) {
				t.Fatalf("ack %d did not settle", seq)
			}
			time.Sleep(time.Millisecond)
		}
	}
	ack(1) // 7 in flight: above the low-water mark
	select {
	case <-p.Space():
		t.Fatal("Space signalled with the window still above three quarters")
	case <-time.After(50 * time.Millisecond): // the chance for a wrong signal to show
	}
	ack(2) // 6 in flight: at the low-water mark
	select {
	case <-p.Space():
	case <-time.After(5 * time.Second):
		t.Fatal("Space not signalled at the low-water mark")
	}
	if ok, err := p.TryPublish(msg(window)); !ok || err != nil {
		t.Fatalf("after the signal: ok %v, err %v", ok, err)
	}
}

// TestPublishConcurrentProducers runs producers that share a small window
// through Publish: each finishes, although a Space signal wakes only one of
// them.
func TestPublishConcurrentProducers(t *testing.T) {
	nc := connectNATS(t)
	if _, err := nc.Subscribe("concurrent.>", func(m *nats.Msg) { _ = m.Respond([]byte(`{"stream":"S","seq":1}`)) }); err != nil {
		t.Fatal(err)
	}
	p, err := publisher.New(nc, publisher.Config{MaxInFlight: 4},
		publisher.WithStreamLookup(func(context.Context, string) error { return nil }))
	if err != nil {
		t.Fatal(err)
	}
	runPublisher(t, p)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const producers, each = 4, 200
	var settled atomic.Int32
	errs := make(chan error, producers)
	for w := range producers {
		go func() {
			for i := range each {
				m := &publisher.Message{Subject: "concurrent.x", Key: strconv.Itoa(w*each + i), Data: []byte("x"),
					Owner: publisher.OwnerFuncs{Done: func(publisher.Result) { settled.Add(1) }}}
				if err := p.Publish(ctx, m); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range producers {
		if err := <-errs; err != nil {
			t.Fatalf("a producer: %v (%d of %d settled)", err, settled.Load(), producers*each)
		}
	}
}

// Regression (issue 16, case 5): an answer shaped like a JetStream ack but
// from something other than the stream meant to store the message (here a
// core NATS subscriber on a subject bound to no stream) was taken as
// stored. It is a bad ack: retried, never settled, until the right stream
// answers.
func TestAckFromAnotherStreamIsNotAnAck(t *testing.T) {
	nc := connectNATS(t)
	var attempts atomic.Int32
	if _, err := nc.Subscribe("fake.>", func(m *nats.Msg) {
		stream := "FAKE"
		if attempts.Add(1) >= 4 {
			stream = "REAL"
		}
		_ = m.Respond([]byte(`{"stream":"` + stream + `","seq":1}`))
	}); err != nil {
		t.Fatal(err)
	}
	p, err := publisher.New(nc, publisher.Config{AckTimeout: time.Second, RetryMin: 10 * time.Millisecond, RetryMax: 20 * time.Millisecond},
		publisher.WithStreamLookup(func(context.Context, string) error { return nil }),
		publisher.WithExpectedStream(func(string) string { return "REAL" }))
	if err != nil {
		t.Fatal(err)
	}
	ctx := runPublisher(t, p)

	settled := make(chan publisher.Result, 1)
	var stream string
	m := &publisher.Message{Subject: "fake.a", Key: "a", Data: []byte("x"), Owner: publisher.OwnerFuncs{Done: func(r publisher.Result) {
		stream = r.Ack.Stream
		settled <- r
	}}}
	if err := p.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-settled:
		if got := attempts.Load(); r.Attempts != 4 || got != 4 || stream != "REAL" {
			t.Fatalf("settled after %d attempts (%d answered) by stream %q; want the 4th, by REAL", r.Attempts, got, stream)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("never settled; %d attempts", attempts.Load())
	}
}

// TestLateAckSettles answers every attempt only after three times the ack
// timeout, as a loaded broker or a slow link does: the first answer that
// says the message is stored settles it, once. Before, every late answer
// was ignored and the message was retried for ever.
func TestLateAckSettles(t *testing.T) {
	nc := connectNATS(t)
	const ackTimeout = 100 * time.Millisecond
	var answered atomic.Int32
	if _, err := nc.Subscribe("latetest.>", func(m *nats.Msg) {
		n := answered.Add(1)
		time.AfterFunc(3*ackTimeout, func() {
			_ = m.Respond([]byte(`{"stream":"S","seq":` + strconv.Itoa(int(n)) + `}`))
		})
	}); err != nil {
		t.Fatal(err)
	}
	p, err := publisher.New(nc, publisher.Config{AckTimeout: ackTimeout, RetryMin: 10 * time.Millisecond, RetryMax: 20 * time.Millisecond},
		publisher.WithStreamLookup(func(context.Context, string) error { return nil }))
	if err != nil {
		t.Fatal(err)
	}
	ctx := runPublisher(t, p)
	results := make(chan publisher.Result, 4)
	for _, key := range []string{"a", "a"} { // the second waits for the first
		m := &publisher.Message{Subject: "latetest." + key, Key: key, Data: []byte("x"), Owner: publisher.OwnerFuncs{Done: func(r publisher.Result) { results <- r }}}
		if err := p.Publish(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 2 {
		select {
		case r := <-results:
			// The first message's attempts time out, and a late answer
			// settles it. That answer's round trip teaches the publisher
			// to wait longer (ackWait): the second may be answered in time.
			if r.Ack.Stream != "S" || i == 0 && r.Attempts < 2 {
				t.Fatalf("message %d: result %+v, want an ack of stream S (after a timed-out attempt for the first)", i, r)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("message %d not settled in 10 s although every attempt is answered %s after it is sent", i, 3*ackTimeout)
		}
	}
	time.Sleep(4 * ackTimeout) // the answers still on their way must not settle again
	select {
	case r := <-results:
		t.Fatalf("settled again: %+v", r)
	default:
	}
	if n := p.InFlight(); n != 0 {
		t.Fatalf("in flight %d after both settled", n)
	}
}
