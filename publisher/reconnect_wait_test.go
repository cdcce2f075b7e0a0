package publisher_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/publisher"
)

// A network stall of a few seconds (no disconnect: it heals before the
// ping timeout) makes the answers to the attempts sent during it come
// seconds late, and the wait for answers grows with them (ackWait). An
// attempt lost in a later connection reset can never be answered: it must
// be re-sent once the reconnect is seen, not after the grown wait (a
// helper's attack on the first ackWait: 14.4 s here, up to a minute, where
// AckTimeout, 200 ms, was the bound before).
func TestReconnectResetsTheGrownWait(t *testing.T) {
	srv := startNATS(t)
	proxy, err := testenv.StartProxy(strings.TrimPrefix(srv.URL, "nats://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxy.Close)
	pnc, err := nats.Connect(fmt.Sprintf("nats://127.0.0.1:%d", proxy.Port()), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pnc.Close)
	// The stand-in stream, on its own direct connection: answers at once.
	rnc := dialNATS(t, srv.URL)
	var seqs atomic.Uint64
	if _, err := rnc.Subscribe("rwait.>", func(m *nats.Msg) {
		_ = m.Respond([]byte(fmt.Sprintf(`{"stream":"S","seq":%d}`, seqs.Add(1))))
	}); err != nil {
		t.Fatal(err)
	}
	if err := rnc.Flush(); err != nil {
		t.Fatal(err)
	}
	p, err := publisher.New(pnc, publisher.Config{AckTimeout: 200 * time.Millisecond, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond},
		publisher.WithStreamLookup(func(context.Context, string) error { return nil }))
	if err != nil {
		t.Fatal(err)
	}
	ctx := runPublisher(t, p)
	publish := func(key string) chan publisher.Result {
		done := make(chan publisher.Result, 1)
		m := &publisher.Message{Subject: "rwait." + key, Key: key, Data: []byte("x"),
			Header: contract.Headers{{Name: nats.MsgIdHdr, Value: key}},
			Owner:  publisher.OwnerFuncs{Done: func(r publisher.Result) { done <- r }}}
		if err := p.Publish(ctx, m); err != nil {
			t.Fatal(err)
		}
		return done
	}
	// Warm up: answers in well under AckTimeout.
	for i := range 5 {
		select {
		case <-publish("warm" + strconv.Itoa(i)):
		case <-time.After(5 * time.Second):
			t.Fatal("warm-up message not settled")
		}
	}
	// A 6 s stall of the link (both ways): the messages published during
	// it are re-sent every ~200 ms into the stalled socket; when it heals
	// the first attempts are answered ~6 s late.
	proxy.Stall(testenv.Both)
	var stalled []chan publisher.Result
	for i := range 10 {
		stalled = append(stalled, publish("stall"+strconv.Itoa(i)))
	}
	time.Sleep(6 * time.Second)
	proxy.Heal()
	for i, c := range stalled {
		select {
		case <-c:
		case <-time.After(30 * time.Second):
			t.Fatalf("stalled message %d not settled after the link healed", i)
		}
	}
	// Now a connection loss: an attempt is written into the socket, the
	// connection is reset before it reaches the server, nats.go
	// reconnects at once. The attempt is lost for good.
	proxy.Stall(testenv.Upstream)
	start := time.Now()
	lost := publish("lost")
	time.Sleep(100 * time.Millisecond)
	proxy.Cut()
	proxy.Heal()
	select {
	case r := <-lost:
		took := time.Since(start)
		t.Logf("the message whose attempt was lost settled after %s (%d attempts)", took.Round(time.Millisecond), r.Attempts)
		if took > 5*time.Second {
			t.Fatalf("a message whose attempt was lost in a connection reset took %s to settle with AckTimeout 200ms: the wait grown by a healed stall is not reset by the reconnect", took.Round(time.Millisecond))
		}
	case <-time.After(90 * time.Second):
		t.Fatal("the message whose attempt was lost never settled")
	}
}
