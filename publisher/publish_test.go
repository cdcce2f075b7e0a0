package publisher_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/publisher"
)

// TestAckTimeoutRetry answers a publish only on its second attempt and then
// answers the first, late: the message settles once, after the retry, and
// the late answer is ignored.
func TestAckTimeoutRetry(t *testing.T) {
	if testing.Short() {
		t.Skip("needs a NATS server")
	}
	t.Parallel()
	srv, err := testenv.StartNATS()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	nc, err := nats.Connect(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	// A plain subscriber stands in for the stream: it keeps the broker
	// from answering "no responders" and decides which attempt gets an ack.
	attempts := make(chan *nats.Msg, 10)
	if _, err := nc.Subscribe("acktest.>", func(m *nats.Msg) { attempts <- m }); err != nil {
		t.Fatal(err)
	}
	p, err := publisher.New(nc, publisher.Config{AckTimeout: 100 * time.Millisecond, RetryMin: 10 * time.Millisecond, RetryMax: 20 * time.Millisecond},
		publisher.WithStreamLookup(func(context.Context, string) error { return nil }))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done; _ = p.Close() })

	var settled atomic.Int32
	results := make(chan publisher.Result, 2)
	m := &publisher.Message{Subject: "acktest.a", Key: "a", Data: []byte("x"), Done: func(r publisher.Result) {
		settled.Add(1)
		results <- r
	}}
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
	res := <-results
	if res.Attempts != 2 || res.Ack == nil || res.Ack.Sequence != 2 {
		t.Fatalf("result %+v (ack %+v), want 2 attempts and seq 2", res, res.Ack)
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
