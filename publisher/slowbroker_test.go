package publisher_test

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/publisher"
)

// fifoBroker stands in for a JetStream server that stores one message per
// interval, in the order they arrive, and answers every one of them (a
// re-sent message is answered again, as a duplicate is): a server whose
// backlog keeps growing while it is offered more than it can take. It
// takes nothing for its first pause (a leader election, a stalled disk, a
// starved process), so that its backlog is there before any answer.
type fifoBroker struct {
	mu       sync.Mutex
	queue    []*nats.Msg
	received atomic.Int64
	stored   map[string]uint64 // message id → stream sequence
}

func startFIFOBroker(t *testing.T, nc *nats.Conn, subjects string, pause, interval time.Duration) *fifoBroker {
	t.Helper()
	b := &fifoBroker{stored: map[string]uint64{}}
	sub, err := nc.Subscribe(subjects, func(m *nats.Msg) {
		b.received.Add(1)
		b.mu.Lock()
		b.queue = append(b.queue, m)
		b.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		select {
		case <-stop:
			return
		case <-time.After(pause):
		}
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			b.mu.Lock()
			if len(b.queue) == 0 {
				b.mu.Unlock()
				continue
			}
			m := b.queue[0]
			b.queue[0] = nil
			b.queue = b.queue[1:]
			id := m.Header.Get(nats.MsgIdHdr)
			seq, dup := b.stored[id]
			if !dup {
				seq = uint64(len(b.stored) + 1)
				b.stored[id] = seq
			}
			b.mu.Unlock()
			_ = m.Respond([]byte(fmt.Sprintf(`{"stream":"S","seq":%d,"duplicate":%t}`, seq, dup)))
		}
	}()
	t.Cleanup(func() { close(stop); <-done; _ = sub.Unsubscribe() })
	return b
}

// A broker that takes messages more slowly than the publisher offers
// them, with every answer later than AckTimeout: found beside six busy
// loops in internal/grouptest, where the relay's ~500 stuck messages were
// re-sent every AckTimeout + backoff for minutes, the server's backlog
// grew with the re-sends, and its answers came later than the last four
// attempts each message still listened for: nothing settled again. Here
// 100 keys with two messages each are offered to a server that takes
// nothing for 2 s and then stores 100 a second in arrival order. Every
// message must settle, once, in its key's order, and the publisher must
// not bury the server in re-sends.
func TestSlowBrokerBacklogSettles(t *testing.T) {
	nc := connectNATS(t)
	const (
		keys     = 100
		perKey   = 2
		interval = 10 * time.Millisecond
	)
	b := startFIFOBroker(t, nc, "slowbroker.>", 2*time.Second, interval)
	p, err := publisher.New(nc, publisher.Config{AckTimeout: 100 * time.Millisecond, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond},
		publisher.WithStreamLookup(func(context.Context, string) error { return nil }))
	if err != nil {
		t.Fatal(err)
	}
	ctx := runPublisher(t, p)
	var mu sync.Mutex
	settled := map[string][]int{}
	var total atomic.Int64
	start := time.Now()
	for i := range perKey {
		for k := range keys {
			key := "k" + strconv.Itoa(k)
			m := &publisher.Message{Subject: "slowbroker." + key, Key: key, Data: []byte("x"),
				Header: contract.Headers{{Name: nats.MsgIdHdr, Value: key + "-" + strconv.Itoa(i)}},
				Owner: publisher.OwnerFuncs{Done: func(publisher.Result) {
					mu.Lock()
					settled[key] = append(settled[key], i)
					mu.Unlock()
					total.Add(1)
				}}}
			if err := p.Publish(ctx, m); err != nil {
				t.Fatal(err)
			}
		}
	}
	const want = keys * perKey
	deadline := time.Now().Add(2 * time.Minute)
	for total.Load() < want && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	took := time.Since(start)
	mu.Lock()
	defer mu.Unlock()
	sent := b.received.Load()
	t.Logf("%d of %d settled in %s; the broker received %d attempts (%.1f per message) and stores %d a second",
		total.Load(), want, took.Round(time.Millisecond), sent, float64(sent)/want, time.Second/interval)
	if n := total.Load(); n != want {
		t.Fatalf("%d of %d messages settled within 2 minutes of a broker that answers every attempt in order", n, want)
	}
	for key, got := range settled {
		for i, v := range got {
			if v != i {
				t.Fatalf("key %s settled in order %v", key, got)
			}
		}
	}
	if sent > 25*want {
		t.Fatalf("the broker received %d attempts for %d messages: re-sends made its backlog", sent, want)
	}
}
