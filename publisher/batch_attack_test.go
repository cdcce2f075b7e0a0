package publisher_test

import (
	"context"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/publisher"
)

// Adversarial review of issue 25 (third round, publisher/batch.go): the
// settle on a failed batch's late final answer, the hand-over held while
// a batch waits for its answer, and the deadline timers, attacked through
// a proxy to real JetStream and a restarted server. Each expects every
// message settled exactly once (the fixture fails on a second settle),
// every one stored once, and each key's messages in order.

// proxiedBatchFixture is a batch fixture whose publishing connection goes
// through a proxy; the streams are made and read directly.
func proxiedBatchFixture(t *testing.T, cfg publisher.Config) (*batchFixture, *testenv.Proxy) {
	t.Helper()
	srv := startNATS(t)
	proxy, err := testenv.StartProxy(strings.TrimPrefix(srv.URL, "nats://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxy.Close)
	admin := dialNATS(t, srv.URL)
	pub := dialNATS(t, "nats://"+net.JoinHostPort("127.0.0.1", strconv.Itoa(proxy.Port())))
	f := newBatchFixtureOn(t, pub, admin, batchStream("B"), cfg, publisher.BatchConfig{})
	if err := pub.Flush(); err != nil {
		t.Fatal(err)
	}
	return f, proxy
}

// publishAsync publishes messages from..to-1 of key(i) from a goroutine;
// the returned wait waits for the producer.
func (f *batchFixture) publishAsync(ctx context.Context, from, to int, key func(int) string) (wait func()) {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := from; i < to; i++ {
			f.publish(ctx, i, key(i), []byte("x"))
		}
	}()
	return wg.Wait
}

// checkSettledOnce fails unless each of 0..n-1 settled, none dead-lettered.
func (f *batchFixture) checkSettledOnce(n int) {
	f.t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.results) != n {
		f.t.Fatalf("%d of %d settled", len(f.results), n)
	}
	for i, r := range f.results {
		if r.DeadLettered {
			f.t.Fatalf("message %d dead-lettered: %v", i, r.Reason)
		}
	}
}

// TestBatchAttackJitteredLateAnswers: answers whose delay swings around
// AckTimeout (none, half, one and a half round trip of it), so batches
// fail unanswered, their messages go alone and their late final answers
// arrive while the lone copies are in flight, over several keys.
func TestBatchAttackJitteredLateAnswers(t *testing.T) {
	const ackTimeout = publisher.MinAckTimeout
	f, proxy := proxiedBatchFixture(t, publisher.Config{AckTimeout: ackTimeout, MaxInFlight: 128, RetryMin: 10 * time.Millisecond, RetryMax: 40 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const n, keys = 1500, 7
	keyOf := func(i int) string { return "k" + strconv.Itoa(i%keys) }
	stop := make(chan struct{})
	var jitter sync.WaitGroup
	jitter.Add(1)
	go func() {
		defer jitter.Done()
		lat := []time.Duration{0, ackTimeout / 4, ackTimeout / 2, 3 * ackTimeout / 4, 0, ackTimeout}
		for i := 0; ; i++ {
			proxy.SetLatency(lat[i%len(lat)])
			select {
			case <-stop:
				proxy.SetLatency(0)
				return
			case <-time.After(ackTimeout / 3):
			}
		}
	}()
	wait := f.publishAsync(ctx, 0, n, keyOf)
	wait()
	err := f.b.Drain(ctx)
	close(stop)
	jitter.Wait()
	if err != nil {
		t.Fatalf("%v: %d of %d settled", err, n-f.b.InFlight(), n)
	}
	f.mu.Lock()
	retried := f.retried
	f.mu.Unlock()
	t.Logf("%d messages, %d failed batches", n, retried)
	f.checkSettledOnce(n)
	checkKeyOrder(t, f.stored(ctx, "B"), n, nil, keyOf)
}

// TestBatchAttackNeverAnswered: the server's answers stop for many
// AckTimeouts while producers keep offering more than the window holds;
// nothing else arrives. The waiting batch must still time out (a failed
// batch is counted), producers must be held back (the window bounds what
// is in flight), and once answers flow again everything drains.
func TestBatchAttackNeverAnswered(t *testing.T) {
	const ackTimeout = publisher.MinAckTimeout
	const window = 64
	f, proxy := proxiedBatchFixture(t, publisher.Config{AckTimeout: ackTimeout, MaxInFlight: window, RetryMin: 10 * time.Millisecond, RetryMax: 40 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const n, keys = 600, 5
	keyOf := func(i int) string { return "k" + strconv.Itoa(i%keys) }
	// A first batch answered, then silence.
	for i := range 10 {
		f.publish(ctx, i, keyOf(i), []byte("x"))
	}
	f.drain(ctx)
	proxy.Stall(testenv.Downstream)
	wait := f.publishAsync(ctx, 10, n, keyOf)
	stallEnd := time.Now().Add(6 * ackTimeout)
	for time.Now().Before(stallEnd) {
		if got := f.b.InFlight(); got > window {
			t.Fatalf("%d in flight with a window of %d", got, window)
		}
		time.Sleep(10 * time.Millisecond)
	}
	f.mu.Lock()
	retried, settled := f.retried, len(f.results)
	f.mu.Unlock()
	if retried == 0 {
		t.Fatalf("no batch timed out in %s of silence (AckTimeout %s)", 6*ackTimeout, ackTimeout)
	}
	if settled != 10 {
		t.Fatalf("%d settled while the server's answers were stalled, want the 10 answered before", settled)
	}
	proxy.Heal()
	wait()
	if err := f.b.Drain(ctx); err != nil {
		t.Fatalf("%v: %d of %d settled after the answers flowed again", err, n-f.b.InFlight(), n)
	}
	f.mu.Lock()
	t.Logf("%d failed batches", f.retried)
	f.mu.Unlock()
	f.checkSettledOnce(n)
	checkKeyOrder(t, f.stored(ctx, "B"), n, nil, keyOf)
}

// TestBatchAttackLateAnswerOtherStream: a stand-in answers on the stream's
// subjects (a core subscriber, as in TestBatchUnansweredGoesAlone): batch
// messages unanswered, the failed batch's count request answered only
// after the batch ended, naming another stream; lone publishes answered
// only once the test lets it. The late answer must settle nothing.
func TestBatchAttackLateAnswerOtherStream(t *testing.T) {
	const ackTimeout = publisher.MinAckTimeout
	scfg := batchStream("B")
	scfg.Subjects = []string{"unused.>"} // only the stand-in answers on bt.>
	f := newBatchFixtureWith(t, scfg, publisher.Config{AckTimeout: ackTimeout, RetryMin: 10 * time.Millisecond, RetryMax: 20 * time.Millisecond}, publisher.BatchConfig{})
	var mu sync.Mutex
	var lateSent int
	gate := make(chan struct{})
	var seq uint64
	if _, err := f.nc.Subscribe("bt.>", func(m *nats.Msg) {
		if strings.HasSuffix(m.Reply, ".$FI") {
			tok := strings.Split(m.Reply, ".")
			id, op := tok[len(tok)-6], tok[len(tok)-2]
			n, _ := strconv.Atoi(tok[len(tok)-3])
			switch op {
			case "2": // committed by this message
			case "3": // the count request
				n--
			default:
				return // batch message: silent
			}
			// The final answer after the batch ended, from another
			// stream, counting everything.
			reply := m.Reply
			time.AfterFunc(2*ackTimeout, func() {
				mu.Lock()
				lateSent++
				mu.Unlock()
				_ = f.nc.Publish(reply, []byte(`{"stream":"OTHER","seq":9,"batch":"`+id+`","count":`+strconv.Itoa(n)+`}`))
			})
			return
		}
		reply := m.Reply
		go func() {
			<-gate
			mu.Lock()
			seq++
			s := seq
			mu.Unlock()
			_ = f.nc.Publish(reply, []byte(`{"stream":"B","seq":`+strconv.FormatUint(s, 10)+`}`))
		}()
	}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const n = 20
	for i := range n {
		f.publish(ctx, i, "k"+strconv.Itoa(i%3), []byte("x"))
	}
	if !testenv.WaitFor(10*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return lateSent > 0 }) {
		t.Fatal("no final batch answer sent")
	}
	if err := f.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(ackTimeout / 2) // the late answer's delivery to Run: nothing to poll for
	f.mu.Lock()
	settled := len(f.results)
	f.mu.Unlock()
	if settled != 0 {
		t.Fatalf("%d messages settled by a late batch answer naming another stream", settled)
	}
	close(gate)
	f.drain(ctx)
	f.checkSettledOnce(n)
}

// TestBatchAttackServerRestart: the server stops while batches are in
// flight and waiting for their answers, and starts again on the same store
// a little later, while producers keep publishing over several keys.
func TestBatchAttackServerRestart(t *testing.T) {
	srv := startNATS(t)
	nc, err := nats.Connect(srv.URL, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	f := newBatchFixtureOn(t, nc, nc, batchStream("B"), publisher.Config{AckTimeout: publisher.MinAckTimeout, MaxInFlight: 256, RetryMin: 10 * time.Millisecond, RetryMax: 100 * time.Millisecond}, publisher.BatchConfig{})
	ctx, cancel := context.WithTimeout(context.Background(), 240*time.Second)
	defer cancel()
	const n, keys = 6000, 9
	keyOf := func(i int) string { return "k" + strconv.Itoa(i%keys) }
	wait := f.publishAsync(ctx, 0, n, keyOf)
	for round := 0; round < 2; round++ {
		if !testenv.WaitFor(90*time.Second, func() bool { f.mu.Lock(); defer f.mu.Unlock(); return len(f.results) >= (round+1)*n/4 }) {
			t.Fatalf("round %d: %d of %d in flight, too few settled", round, f.b.InFlight(), n)
		}
		srv.Stop()
		time.Sleep(300 * time.Millisecond) // the outage: longer than AckTimeout
		if err := srv.Start(); err != nil {
			t.Fatal(err)
		}
	}
	wait()
	if err := f.b.Drain(ctx); err != nil {
		t.Fatalf("%v: %d of %d settled after two server restarts", err, n-f.b.InFlight(), n)
	}
	f.checkSettledOnce(n)
	checkKeyOrder(t, f.stored(ctx, "B"), n, nil, keyOf)
}

// TestBatchAttackLeaderChange: an R3 stream on three servers whose leader
// steps down, and then is stopped, while batches wait for their answers,
// producers publishing over several keys throughout.
func TestBatchAttackLeaderChange(t *testing.T) {
	if testing.Short() {
		t.Skip("needs a NATS cluster")
	}
	t.Parallel()
	cl, err := testenv.StartCluster(3)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	nc, err := nats.Connect(cl.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	scfg := batchStream("B")
	scfg.Replicas = 3
	f := newBatchFixtureOn(t, nc, nc, scfg, publisher.Config{AckTimeout: time.Second, MaxInFlight: 256, RetryMin: 10 * time.Millisecond, RetryMax: 200 * time.Millisecond}, publisher.BatchConfig{})
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Second)
	defer cancel()
	const n, keys = 6000, 9
	keyOf := func(i int) string { return "k" + strconv.Itoa(i%keys) }
	wait := f.publishAsync(ctx, 0, n, keyOf)
	settled := func() int { f.mu.Lock(); defer f.mu.Unlock(); return len(f.results) }
	start := time.Now()
	for round := 0; round < 3; round++ {
		if !testenv.WaitFor(90*time.Second, func() bool { return settled() >= (round+1)*n/5 }) {
			t.Fatalf("round %d: %d settled", round, settled())
		}
		t.Logf("%s: %d settled, leader change %d", time.Since(start).Round(time.Millisecond), settled(), round+1)
		if round < 2 {
			if _, err := nc.Request("$JS.API.STREAM.LEADER.STEPDOWN.B", nil, 5*time.Second); err != nil {
				t.Fatalf("step down: %v", err)
			}
			continue
		}
		leader, err := cl.StreamLeader(ctx, f.js, "B")
		if err != nil {
			t.Fatal(err)
		}
		cl.Nodes[leader].Stop()
		defer func() {
			if err := cl.Nodes[leader].Start(); err != nil {
				t.Error(err)
			}
		}()
	}
	wait()
	if err := f.b.Drain(ctx); err != nil {
		t.Fatalf("%v: %d of %d settled after leader changes", err, n-f.b.InFlight(), n)
	}
	f.mu.Lock()
	t.Logf("%s: all %d settled, %d failed batches", time.Since(start).Round(time.Millisecond), n, f.retried)
	f.mu.Unlock()
	f.checkSettledOnce(n)
	checkKeyOrder(t, f.stored(ctx, "B"), n, nil, keyOf)
}
