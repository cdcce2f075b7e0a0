package publisher_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/publisher"
)

// batchFixture is a Batch on a test server of its own, with the per-key
// publisher it hands failures to, both running.
type batchFixture struct {
	t     *testing.T
	nc    *nats.Conn
	js    jetstream.JetStream
	keyed *publisher.Publisher
	b     *publisher.Batch
	runs  chan error

	mu      sync.Mutex
	results map[int]publisher.Result
	retried int // failed batches
}

// Published implements publisher.Observer.
func (f *batchFixture) Published(string, bool, time.Duration) {}

// Retried implements publisher.Observer.
func (f *batchFixture) Retried(string) {
	f.mu.Lock()
	f.retried++
	f.mu.Unlock()
}

// DeadLettered implements publisher.Observer.
func (f *batchFixture) DeadLettered(string) {}

func newBatchFixture(t *testing.T, scfg jetstream.StreamConfig, cfg publisher.Config) *batchFixture {
	t.Helper()
	return newBatchFixtureWith(t, scfg, cfg, publisher.BatchConfig{})
}

// newBatchFixtureWith is newBatchFixture with batch settings (Stream is
// scfg's) and options for its NATS server.
func newBatchFixtureWith(t *testing.T, scfg jetstream.StreamConfig, cfg publisher.Config, bcfg publisher.BatchConfig, opts ...testenv.NATSOption) *batchFixture {
	t.Helper()
	nc := connectNATS(t, opts...)
	return newBatchFixtureOn(t, nc, nc, scfg, cfg, bcfg)
}

// newBatchFixtureOn is newBatchFixtureWith on given connections: the
// publishers use pub, the fixture's streams and reads admin.
func newBatchFixtureOn(t *testing.T, pub, admin *nats.Conn, scfg jetstream.StreamConfig, cfg publisher.Config, bcfg publisher.BatchConfig) *batchFixture {
	t.Helper()
	nc := pub
	js, err := jetstream.New(admin)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, scfg); err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "DLQ", Subjects: []string{"dlq.>"}, Storage: jetstream.FileStorage}); err != nil {
		t.Fatal(err)
	}
	keyed, err := publisher.New(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	f := &batchFixture{t: t, nc: nc, js: js, keyed: keyed, runs: make(chan error, 2), results: map[int]publisher.Result{}}
	bcfg.Stream = scfg.Name
	b, err := publisher.NewBatch(nc, keyed, cfg, bcfg, publisher.WithObserver(f))
	if err != nil {
		t.Fatal(err)
	}
	f.b = b
	rctx, cancel := context.WithCancel(ctx)
	go func() { f.runs <- keyed.Run(rctx) }()
	go func() { f.runs <- b.Run(rctx) }()
	t.Cleanup(func() {
		cancel()
		<-f.runs
		<-f.runs
		_ = b.Close()
		_ = keyed.Close()
	})
	return f
}

// publish hands message i (subject bt.<key>, data "i") to the batch.
func (f *batchFixture) publish(ctx context.Context, i int, key string, data []byte) {
	f.t.Helper()
	id := strconv.Itoa(i)
	m := &publisher.Message{
		Subject: "bt." + key,
		Header:  contract.Headers{{Name: "Nats-Msg-Id", Value: id}, {Name: "Seq", Value: id}},
		Data:    data,
		Key:     key,
		Owner: publisher.DeadLetterFuncs{
			Record: func(reason error) *publisher.Message {
				return &publisher.Message{Subject: "dlq." + key, Header: contract.Headers{{Name: "Seq", Value: id}, {Name: "Reason", Value: reason.Error()}}}
			},
			Done: func(r publisher.Result) {
				f.mu.Lock()
				defer f.mu.Unlock()
				if _, dup := f.results[i]; dup {
					f.t.Errorf("message %d settled twice", i)
				}
				f.results[i] = publisher.Result{DeadLettered: r.DeadLettered, Reason: r.Reason, Attempts: r.Attempts}
			},
		},
	}
	for {
		ok, err := f.b.TryPublish(m)
		if err != nil {
			f.t.Fatalf("publish %d: %v", i, err)
		}
		if ok {
			return
		}
		select {
		case <-f.b.Space():
		case <-time.After(100 * time.Millisecond):
		case <-ctx.Done():
			f.t.Fatal(ctx.Err())
		}
	}
}

// drain waits until every message settled.
func (f *batchFixture) drain(ctx context.Context) {
	f.t.Helper()
	if err := f.b.Drain(ctx); err != nil {
		f.t.Fatal(err)
	}
}

// stored returns the Seq header of every message in stream, in stream
// order. It reads them through an ordered consumer, a few hundred per
// round trip: one request per message took most of a test's deadline on a
// loaded machine (5,000 messages under six busy loops and -race). A read
// that finds no responder (a clustered stream electing its leader after a
// node stopped) starts again, for up to a minute.
func (f *batchFixture) stored(ctx context.Context, stream string) []int {
	f.t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		out, err := f.readStored(ctx, stream)
		if err == nil {
			return out
		}
		if !errors.Is(err, nats.ErrNoResponders) || time.Now().After(deadline) || ctx.Err() != nil {
			f.t.Fatalf("read stream %s: %v", stream, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func (f *batchFixture) readStored(ctx context.Context, stream string) ([]int, error) {
	s, err := f.js.Stream(ctx, stream)
	if err != nil {
		return nil, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, err
	}
	var out []int
	if info.State.Msgs == 0 {
		return out, nil
	}
	c, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return nil, err
	}
	for last := uint64(0); last < info.State.LastSeq; {
		batch, err := c.Fetch(500, jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			return nil, err
		}
		for m := range batch.Messages() {
			md, err := m.Metadata()
			if err != nil {
				return nil, err
			}
			last = md.Sequence.Stream
			n, err := strconv.Atoi(m.Headers().Get("Seq"))
			if err != nil {
				return nil, fmt.Errorf("seq %d: %w", last, err)
			}
			out = append(out, n)
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			return nil, err
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%w after %d messages", ctx.Err(), len(out))
		}
	}
	return out, nil
}

// waitStored waits until stream B holds n messages and also holds.
func (f *batchFixture) waitStored(ctx context.Context, n uint64, also func() bool) {
	f.t.Helper()
	s, err := f.js.Stream(ctx, "B")
	if err != nil {
		f.t.Fatal(err)
	}
	for {
		info, err := s.Info(ctx)
		if err != nil {
			f.t.Fatal(err)
		}
		if info.State.Msgs == n && (also == nil || also()) {
			return
		}
		if ctx.Err() != nil {
			f.t.Fatalf("stream holds %d messages, want %d (in flight %d)", info.State.Msgs, n, f.b.InFlight())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// checkKeyOrder fails unless got holds each of 0..n-1 without skip once,
// and the messages of each key (keyOf) in order: after a failed batch its
// unconfirmed messages go alone, in order per key only.
func checkKeyOrder(t *testing.T, got []int, n int, skip map[int]bool, keyOf func(int) string) {
	t.Helper()
	seen := map[int]bool{}
	last := map[string]int{}
	for i, v := range got {
		if seen[v] || skip[v] || v < 0 || v >= n {
			t.Fatalf("stream position %d holds message %d again, or one not to be stored", i, v)
		}
		seen[v] = true
		if prev, ok := last[keyOf(v)]; ok && v < prev {
			t.Fatalf("stream position %d holds message %d after %d of the same key (order broken)", i, v, prev)
		}
		last[keyOf(v)] = v
	}
	if len(seen) != n-len(skip) {
		t.Fatalf("stream holds %d messages, want %d", len(seen), n-len(skip))
	}
}

// checkInOrder fails unless got is exactly 0..n-1 without skip.
func checkInOrder(t *testing.T, got []int, n int, skip map[int]bool) {
	t.Helper()
	want := 0
	for i, v := range got {
		for skip[want] {
			want++
		}
		if v != want {
			t.Fatalf("stream position %d holds message %d, want %d (order or completeness broken)", i, v, want)
		}
		want++
	}
	for skip[want] {
		want++
	}
	if want != n {
		t.Fatalf("stream holds %d messages, want %d", len(got), n-len(skip))
	}
}

func batchStream(name string) jetstream.StreamConfig {
	return jetstream.StreamConfig{Name: name, Subjects: []string{"bt.>"}, Storage: jetstream.FileStorage, AllowBatchPublish: true, Duplicates: time.Minute}
}

// TestBatchOrder publishes more messages than the window holds over a few
// keys: every message settles once and the stream holds them in exactly
// the order handed over.
func TestBatchOrder(t *testing.T) {
	f := newBatchFixture(t, batchStream("B"), publisher.Config{MaxInFlight: 256})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const n = 5000
	for i := range n {
		f.publish(ctx, i, "k"+strconv.Itoa(i%7), []byte("payload"))
	}
	f.drain(ctx)
	checkInOrder(t, f.stored(ctx, "B"), n, nil)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.retried != 0 {
		t.Fatalf("%d batches failed", f.retried)
	}
	if len(f.results) != n {
		t.Fatalf("%d settled, want %d", len(f.results), n)
	}
	for i, r := range f.results {
		if r.DeadLettered {
			t.Fatalf("message %d dead-lettered: %v", i, r.Reason)
		}
	}
}

// TestBatchIdleCommit publishes bursts with pauses between them: every
// burst settles, which needs its batch committed after the lull (the server
// acknowledges a batch's tail only on commit). The first message of a burst
// leaves alone, as a batch of one; the rest queue behind it, more than a
// short batch, and form a batch left open.
func TestBatchIdleCommit(t *testing.T) {
	f := newBatchFixture(t, batchStream("B"), publisher.Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const bursts, size = 5, 200
	for i := range bursts * size {
		f.publish(ctx, i, "k", []byte("x"))
		if i%size == size-1 {
			f.drain(ctx)
		}
	}
	checkInOrder(t, f.stored(ctx, "B"), bursts*size, nil)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.retried != 0 {
		t.Fatalf("%d batches failed", f.retried)
	}
}

// Likely case of issue 16: a batch left open whose messages were all
// acknowledged by flow acks was never committed; the server abandons an
// uncommitted batch after its max batch timeout (10 s by default), and the
// next message then failed with "batch unknown" (10208): a warning and a
// retry per lull. The idle commit now ends such a batch too. Flow acks for
// every message and a long idle interval make every open batch end fully
// flow-acknowledged; the server here abandons batches after 300 ms.
func TestBatchCommittedAfterFlowAcks(t *testing.T) {
	f := newBatchFixtureWith(t, batchStream("B"), publisher.Config{}, publisher.BatchConfig{AckEvery: 1, IdleCommit: 50 * time.Millisecond},
		func(o *server.Options) { o.JetStreamLimits.MaxBatchTimeout = 300 * time.Millisecond })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	n := 0
	for burst := 0; burst < 3; burst++ {
		for range 300 { // more than a short batch queues behind the first
			f.publish(ctx, n, "k", []byte("x"))
			n++
		}
		f.drain(ctx)
		// Longer than the server keeps an uncommitted batch: a measured
		// wait for the server's timer, not synchronisation.
		time.Sleep(600 * time.Millisecond)
	}
	f.publish(ctx, n, "k", []byte("x"))
	n++
	f.drain(ctx)
	checkInOrder(t, f.stored(ctx, "B"), n, nil)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.retried != 0 {
		t.Fatalf("%d batches failed after lulls", f.retried)
	}
}

// Likely case of issue 16: after a batch that ended without its final
// answer, its messages may still be proposals on the stream's leader; a new
// batch reaching that leader would have them skipped as duplicates "in
// process" (10158) and counted as stored, though the leader may yet lose
// them. Every message the unanswered batch sent goes alone through the
// per-key publisher before batching resumes. A core NATS subscriber stands
// in for the stream: it never answers batch messages and acknowledges lone
// publishes.
func TestBatchUnansweredGoesAlone(t *testing.T) {
	scfg := batchStream("B")
	scfg.Subjects = []string{"unused.>"} // only the stand-in answers on bt.>
	f := newBatchFixtureWith(t, scfg, publisher.Config{AckTimeout: 250 * time.Millisecond, RetryMin: 10 * time.Millisecond, RetryMax: 20 * time.Millisecond}, publisher.BatchConfig{})
	var mu sync.Mutex
	var batched, alone []string
	var seq uint64
	if _, err := f.nc.Subscribe("bt.>", func(m *nats.Msg) {
		mu.Lock()
		defer mu.Unlock()
		if strings.HasSuffix(m.Reply, ".$FI") {
			if len(m.Data) > 0 {
				batched = append(batched, m.Header.Get("Seq"))
			}
			return // silent: the batch ends unanswered
		}
		seq++
		if id := m.Header.Get("Seq"); len(alone) == 0 || alone[len(alone)-1] != id {
			alone = append(alone, id) // a retry after a slow answer counts once
		}
		_ = m.Respond([]byte(`{"stream":"B","seq":` + strconv.FormatUint(seq, 10) + `}`))
	}); err != nil {
		t.Fatal(err)
	}
	const n = 50
	f.publishAndDrain(n, func(int) string { return "k" })
	mu.Lock()
	defer mu.Unlock()
	// Each message at most once in a batch: the first batch, then the one
	// formed behind its first message; after that every message goes alone.
	seen := map[string]bool{}
	for _, s := range batched {
		if seen[s] {
			t.Fatalf("message %s sent in a batch again after an unanswered batch (%d batch sends)", s, len(batched))
		}
		seen[s] = true
	}
	for i, s := range alone {
		if s != strconv.Itoa(i) {
			t.Fatalf("lone publishes out of order: %v", alone)
		}
	}
	if len(alone) != n {
		t.Fatalf("%d lone publishes, want %d", len(alone), n)
	}
}

// TestBatchRejectedMidBatch sends a message the stream refuses as too large
// in the middle of a batch: it is dead-lettered, and every other message is
// stored once, in order per key, none of its key after it overtaking it.
func TestBatchRejectedMidBatch(t *testing.T) {
	cfg := batchStream("B")
	cfg.MaxMsgSize = 1000
	f := newBatchFixture(t, cfg, publisher.Config{MaxInFlight: 128, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const n, big = 600, 301
	for i := range n {
		data := []byte("small")
		if i == big {
			data = make([]byte, 2000)
		}
		f.publish(ctx, i, "k"+strconv.Itoa(i%3), data)
	}
	f.drain(ctx)
	checkKeyOrder(t, f.stored(ctx, "B"), n, map[int]bool{big: true}, func(i int) string { return strconv.Itoa(i % 3) })
	if got := f.stored(ctx, "DLQ"); len(got) != 1 || got[0] != big {
		t.Fatalf("dead-letter stream holds %v, want [%d]", got, big)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, r := range f.results {
		if r.DeadLettered != (i == big) {
			t.Fatalf("message %d dead-lettered %v (reason %v)", i, r.DeadLettered, r.Reason)
		}
	}
}

// TestBatchTransientFailureKeepsOrder fills a stream that discards new
// messages beyond a limit, so that a batch fails in its middle while later
// messages are already on the wire; after the limit is raised everything
// is stored once, in order per key.
func TestBatchTransientFailureKeepsOrder(t *testing.T) {
	cfg := batchStream("B")
	cfg.MaxMsgs = 250
	cfg.Discard = jetstream.DiscardNew
	f := newBatchFixture(t, cfg, publisher.Config{MaxInFlight: 512, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const n = 400
	for i := range n {
		f.publish(ctx, i, "k"+strconv.Itoa(i%5), []byte("x"))
	}
	// Wait until the stream is full and the rest are held back.
	f.waitStored(ctx, 250, func() bool { return f.b.InFlight() == n-250 })
	cfg.MaxMsgs = -1
	if _, err := f.js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	f.drain(ctx)
	checkKeyOrder(t, f.stored(ctx, "B"), n, nil, func(i int) string { return strconv.Itoa(i % 5) })
}

// TestBatchDisabled publishes to a stream that does not allow batches: the
// publisher stops with ErrBatchDisabled rather than dead-lettering.
func TestBatchDisabled(t *testing.T) {
	cfg := batchStream("B")
	cfg.AllowBatchPublish = false
	f := newBatchFixture(t, cfg, publisher.Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	f.publish(ctx, 0, "k", []byte("x"))
	err := f.b.Drain(ctx)
	if !errors.Is(err, publisher.ErrBatchDisabled) {
		t.Fatalf("drain: %v, want ErrBatchDisabled", err)
	}
	if _, err := f.b.TryPublish(&publisher.Message{Subject: "bt.k"}); !errors.Is(err, publisher.ErrBatchDisabled) {
		t.Fatalf("publish after: %v", err)
	}
	if got := f.stored(ctx, "DLQ"); len(got) != 0 {
		t.Fatalf("dead-lettered %v", got)
	}
}

// TestBatchPlainAckServer answers batch messages the way a server without
// fast-ingest batches does, with a plain PubAck: the publisher stops with
// ErrBatchDisabled instead of pipelining lone publishes that a failure
// could reorder.
func TestBatchPlainAckServer(t *testing.T) {
	nc := connectNATS(t)
	if _, err := nc.Subscribe("plain.>", func(m *nats.Msg) { _ = m.Respond([]byte(`{"stream":"S","seq":1}`)) }); err != nil {
		t.Fatal(err)
	}
	keyed, err := publisher.New(nc, publisher.Config{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := publisher.NewBatch(nc, keyed, publisher.Config{}, publisher.BatchConfig{Stream: "S"})
	if err != nil {
		t.Fatal(err)
	}
	runBatch(t, keyed, b)
	if ok, err := b.TryPublish(&publisher.Message{Subject: "plain.a", Data: []byte("x")}); !ok || err != nil {
		t.Fatalf("publish: %v %v", ok, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := b.Drain(ctx); !errors.Is(err, publisher.ErrBatchDisabled) {
		t.Fatalf("drain: %v, want ErrBatchDisabled", err)
	}
}

// TestBatchAfterPublisherDied leaves a batch open on the server, as a
// relay killed mid-batch does (the server keeps it until its timeout), and
// publishes with a new Batch: every message the new one settles is stored.
// Batch ids that repeat across processes would make the server read the new
// batch as a backward gap in the old one and answer with the old one's
// count, settling messages that were never stored.
func TestBatchAfterPublisherDied(t *testing.T) {
	f := newBatchFixture(t, batchStream("B"), publisher.Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// The dead publisher: its own connection, a batch left open (no idle
	// commit), then the connection gone.
	nc, err := nats.Connect(f.nc.ConnectedUrl())
	if err != nil {
		t.Fatal(err)
	}
	keyed, err := publisher.New(nc, publisher.Config{})
	if err != nil {
		t.Fatal(err)
	}
	dead, err := publisher.NewBatch(nc, keyed, publisher.Config{}, publisher.BatchConfig{Stream: "B", IdleCommit: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	runBatch(t, keyed, dead)
	const stale = 100
	for i := range stale {
		id := "dead-" + strconv.Itoa(i)
		if ok, err := dead.TryPublish(&publisher.Message{Subject: "bt.dead", Header: contract.Headers{{Name: "Nats-Msg-Id", Value: id}, {Name: "Seq", Value: strconv.Itoa(1000 + i)}}, Data: []byte("x")}); !ok || err != nil {
			t.Fatalf("dead publisher: %v %v", ok, err)
		}
	}
	f.waitStored(ctx, stale, nil)
	nc.Close()

	const n = 300
	for i := range n {
		f.publish(ctx, i, "k", []byte("x"))
	}
	f.drain(ctx)
	var mine []int
	for _, v := range f.stored(ctx, "B") {
		if v < 1000 {
			mine = append(mine, v)
		}
	}
	checkInOrder(t, mine, n, nil)
}

// runBatch runs keyed and b until the test ends: Run sends what TryPublish
// hands over.
func runBatch(t *testing.T, keyed *publisher.Publisher, b *publisher.Batch) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 2)
	go func() { done <- keyed.Run(ctx) }()
	go func() { done <- b.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
		<-done
		_ = b.Close()
		_ = keyed.Close()
	})
}

// Regression (issue 25): the 10158 "in process" guard covered only batches
// that ended unanswered. A batch the server answered with a failure (a
// gap, an error, a refusal) resumed batching after one lone message while
// the messages sent after the failed one could still be proposals on the
// same leader: a new batch would have them skipped as duplicates in
// process and counted as stored. Every message such a batch sent beyond
// the confirmed count goes alone first. A core NATS subscriber stands in
// for the stream: it answers the first batch of two or more messages with
// a gap at its second message and a count of one, every other batch in
// full, and acknowledges lone publishes.
func TestBatchAnsweredFailureGoesAlone(t *testing.T) {
	scfg := batchStream("B")
	scfg.Subjects = []string{"unused.>"}
	f := newBatchFixtureWith(t, scfg, publisher.Config{AckTimeout: 2 * time.Second, RetryMin: 10 * time.Millisecond, RetryMax: 20 * time.Millisecond}, publisher.BatchConfig{})
	var mu sync.Mutex
	var target string           // the failed batch's id
	var pending, alone []string // its messages after the first; lone publishes
	var seq uint64
	first := true
	if _, err := f.nc.Subscribe("bt.>", func(m *nats.Msg) {
		mu.Lock()
		defer mu.Unlock()
		tok := strings.Split(m.Reply, ".")
		if !strings.HasSuffix(m.Reply, ".$FI") {
			seq++
			alone = append(alone, m.Header.Get("Seq"))
			_ = m.Respond([]byte(`{"stream":"B","seq":` + strconv.FormatUint(seq, 10) + `}`))
			return
		}
		id, op := tok[len(tok)-6], tok[len(tok)-2]
		n, _ := strconv.ParseUint(tok[len(tok)-3], 10, 64)
		if target == "" && n == 2 {
			target = id
			_ = m.Respond([]byte(`{"type":"gap","seq":2}`))
		}
		if id == target && len(m.Data) > 0 && n >= 2 {
			pending = append(pending, m.Header.Get("Seq"))
		}
		count := n
		switch {
		case op == "3":
			count = n - 1
		case op != "2":
			return // flow acks are not needed: every batch is committed
		}
		if id == target {
			count = 1
		}
		if first {
			// Let the rest queue up behind the first batch.
			first = false
			time.Sleep(50 * time.Millisecond)
		}
		_ = m.Respond([]byte(`{"stream":"B","batch":"` + id + `","count":` + strconv.FormatUint(count, 10) + `}`))
	}); err != nil {
		t.Fatal(err)
	}
	f.publishAndDrain(50, func(i int) string { return "k" + strconv.Itoa(i%5) })
	mu.Lock()
	defer mu.Unlock()
	if len(pending) < 2 {
		t.Fatalf("the failed batch sent %d messages after its first: the test proves nothing", len(pending))
	}
	if strings.Join(alone, ",") != strings.Join(pending, ",") {
		t.Fatalf("lone publishes %v, want every message the failed batch sent after its confirmed one, in order: %v", alone, pending)
	}
}

// Regression (issue 25): flow acks {"type":"ack","seq":N} name no stream,
// and settled a batch's messages unchecked. A core NATS subscriber stands
// in for the stream (which does not take the subjects): it answers every
// batch message with a flow ack and never with a final answer, and lone
// publishes with an ack naming the stream. Only the checked answers may
// settle a message: each must have gone alone first.
func TestBatchFlowAcksSettleNothing(t *testing.T) {
	scfg := batchStream("B")
	scfg.Subjects = []string{"unused.>"}
	f := newBatchFixtureWith(t, scfg, publisher.Config{AckTimeout: 300 * time.Millisecond, RetryMin: 10 * time.Millisecond, RetryMax: 20 * time.Millisecond},
		publisher.BatchConfig{AckEvery: 1})
	var mu sync.Mutex
	alone := map[string]bool{}
	var seq uint64
	if _, err := f.nc.Subscribe("bt.>", func(m *nats.Msg) {
		mu.Lock()
		defer mu.Unlock()
		tok := strings.Split(m.Reply, ".")
		if strings.HasSuffix(m.Reply, ".$FI") {
			_ = m.Respond([]byte(`{"type":"ack","seq":` + tok[len(tok)-3] + `,"msgs":1}`))
			return
		}
		seq++
		alone[m.Header.Get("Seq")] = true
		_ = m.Respond([]byte(`{"stream":"B","seq":` + strconv.FormatUint(seq, 10) + `}`))
	}); err != nil {
		t.Fatal(err)
	}
	const n = 10
	f.publishAndDrain(n, func(int) string { return "k" })
	mu.Lock()
	defer mu.Unlock()
	for i := range n {
		if !alone[strconv.Itoa(i)] {
			t.Fatalf("message %d settled without a checked ack: a flow ack from something that is not the stream settled it", i)
		}
	}
}

// publishAndDrain publishes messages 0..n-1 with data "x" under key(i) and
// waits, up to 30 s, until all are settled.
func (f *batchFixture) publishAndDrain(n int, key func(i int) string) {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := range n {
		f.publish(ctx, i, key(i), []byte("x"))
	}
	f.drain(ctx)
}

// After a batch that ended unanswered (an ack stall), the messages it sent
// went alone one at a time, each waiting for the one before whatever its
// key: a 3 s stall turned a 1.48 s drain into 4.02 s (646 lone re-sends).
// They now go alone side by side, one in flight per key, as the per-key
// publisher sends. A core NATS subscriber stands in for the stream: it
// never answers batch messages and answers lone publishes after a delay,
// counting how many wait for an answer at once.
func TestBatchLoneResendsGoSideBySide(t *testing.T) {
	scfg := batchStream("B")
	scfg.Subjects = []string{"unused.>"} // only the stand-in answers on bt.>
	f := newBatchFixtureWith(t, scfg, publisher.Config{AckTimeout: 2 * time.Second, RetryMin: 10 * time.Millisecond, RetryMax: 20 * time.Millisecond}, publisher.BatchConfig{})
	var mu sync.Mutex
	var seq uint64
	outstanding, most, lone := 0, 0, 0
	last := map[string]int{} // per key, the last lone publish's message
	if _, err := f.nc.Subscribe("bt.>", func(m *nats.Msg) {
		if strings.HasSuffix(m.Reply, ".$FI") {
			return // silent: the batch ends unanswered
		}
		mu.Lock()
		defer mu.Unlock()
		i, _ := strconv.Atoi(m.Header.Get("Seq"))
		if prev, ok := last[m.Subject]; ok && i < prev {
			t.Errorf("lone publishes of %s out of order: %d after %d", m.Subject, i, prev)
		}
		last[m.Subject] = i
		lone++
		outstanding++
		most = max(most, outstanding)
		seq++
		ack := []byte(`{"stream":"B","seq":` + strconv.FormatUint(seq, 10) + `}`)
		time.AfterFunc(20*time.Millisecond, func() {
			mu.Lock()
			outstanding--
			mu.Unlock()
			_ = m.Respond(ack)
		})
	}); err != nil {
		t.Fatal(err)
	}
	const n, keys = 200, 40
	f.publishAndDrain(n, func(i int) string { return "k" + strconv.Itoa(i%keys) })
	mu.Lock()
	defer mu.Unlock()
	if lone < n {
		t.Fatalf("%d lone publishes, want every one of the %d messages", lone, n)
	}
	if most < keys/4 {
		t.Fatalf("at most %d lone publishes waited for an answer at once, want them side by side over %d keys", most, keys)
	}
	t.Logf("%d lone publishes, at most %d at once", lone, most)
}

// Regression (issue 25): a batch whose final answer came after the batch
// had ended (answers slower than AckTimeout: a slow link, a loaded broker)
// was ignored as an earlier batch's late answer, and every message it had
// sent waited for its lone publish through the per-key publisher: one
// round trip per message of a key, so a backlog offered faster than that
// never drained. The late final answer, checked for the stream and the
// batch like every other, now settles what it counts. Real JetStream
// through a proxy that delays every chunk both ways: each answer arrives
// about three AckTimeouts after its request. On the old code the 150
// messages of one key went alone one round trip at a time: 49 settled in
// 20 s (the fix: all in under a second).
func TestBatchLateAnswerSettles(t *testing.T) {
	srv := startNATS(t)
	proxy, err := testenv.StartProxy(strings.TrimPrefix(srv.URL, "nats://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxy.Close)
	admin := dialNATS(t, srv.URL)
	slow := dialNATS(t, "nats://"+net.JoinHostPort("127.0.0.1", strconv.Itoa(proxy.Port())))
	const ackTimeout = publisher.MinAckTimeout
	f := newBatchFixtureOn(t, slow, admin, batchStream("B"),
		publisher.Config{AckTimeout: ackTimeout, RetryMin: 10 * time.Millisecond, RetryMax: 20 * time.Millisecond}, publisher.BatchConfig{})
	if err := slow.Flush(); err != nil { // the subscriptions are in place
		t.Fatal(err)
	}
	proxy.SetLatency(3 * ackTimeout / 2) // a round trip of 3 × AckTimeout
	const n = 150
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	start := time.Now()
	for i := range n {
		f.publish(ctx, i, "k", []byte("x"))
	}
	if err := f.b.Drain(ctx); err != nil {
		t.Fatalf("%v: %d of %d settled in %s with every answer about %s after its request", err, n-f.b.InFlight(), n, time.Since(start).Round(time.Millisecond), 3*ackTimeout)
	}
	t.Logf("%d messages settled in %s", n, time.Since(start).Round(time.Millisecond))
	proxy.SetLatency(0)
	checkInOrder(t, f.stored(ctx, "B"), n, nil)
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.results) != n {
		t.Fatalf("%d settled, want %d", len(f.results), n)
	}
}
