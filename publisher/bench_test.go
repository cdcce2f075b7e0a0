package publisher_test

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/publisher"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// benchHeader is a header set the size of the router's: ten contract
// headers, the ids unique per message.
func benchHeader(i int) contract.Headers {
	id := fmt.Sprintf("0b7e8f6a-3c1d-4a8e-9a57-%012d", i)
	return contract.Headers{
		{Name: contract.MsgID, Value: id},
		{Name: contract.EventID, Value: id},
		{Name: contract.EventType, Value: "OrderPlaced"},
		{Name: contract.AggregateType, Value: "order"},
		{Name: contract.AggregateID, Value: fmt.Sprintf("agg-%d", i%1000)},
		{Name: contract.AggregateVersion, Value: fmt.Sprint(i/1000 + 1)},
		{Name: contract.CommitLSN, Value: "0/16B3748"},
		{Name: contract.CommitTime, Value: "2026-11-29T09:35:21.123456Z"},
		{Name: contract.Table, Value: "public.outbox"},
		{Name: contract.ContentType, Value: contract.JSONContentType},
	}
}

// BenchmarkPublish measures the publish path end to end against JetStream
// with file storage: TryPublish, the ack, Done, per key (Publisher) and in
// fast-ingest batches (Batch). Messages spread over 1,000 keys like
// outbox-bench's backlog. With the embedded server, time and
// allocations include the server's; for the client's alone run a server as
// a process of its own:
//
//	go build -o /tmp/nats-server github.com/nats-io/nats-server/v2
//	/tmp/nats-server -js -sd /tmp/js -p 4333 &
//	OUTBOX_TEST_NATS_URL=nats://127.0.0.1:4333 go test -run XXX -bench Publish ./publisher/
func BenchmarkPublish(b *testing.B) {
	b.Run("per_key", func(b *testing.B) { benchmarkPublish(b, false) })
	b.Run("batch", func(b *testing.B) { benchmarkPublish(b, true) })
}

// tryPublisher is what Publisher and Batch offer a producer.
type tryPublisher interface {
	TryPublish(m *publisher.Message) (bool, error)
	Space() <-chan struct{}
	Drain(ctx context.Context) error
}

func benchmarkPublish(b *testing.B, batch bool) {
	if testing.Short() {
		b.Skip("needs a NATS server")
	}
	url := os.Getenv("OUTBOX_TEST_NATS_URL")
	if url == "" {
		srv, err := testenv.StartNATS()
		if err != nil {
			b.Fatal(err)
		}
		defer srv.Close()
		url = srv.URL
	}
	nc, err := nats.Connect(url)
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		b.Fatal(err)
	}
	name := strings.ToUpper(testenv.UniqueName("BENCH"))
	prefix := strings.ToLower(name)
	ctx := context.Background()
	if _, err := provision.EnsureStream(ctx, js, provision.StreamSpec{Name: name, Subjects: []string{prefix + ".>"}, Duplicates: 2 * time.Minute, AllowBatch: true}, true); err != nil {
		b.Fatal(err)
	}
	defer func() { _ = js.DeleteStream(ctx, name) }()
	p, err := publisher.New(nc, publisher.Config{})
	if err != nil {
		b.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 2)
	go func() { done <- p.Run(rctx) }()
	defer func() { cancel(); <-done; _ = p.Close() }()
	var pub tryPublisher = p
	if batch {
		bp, err := publisher.NewBatch(nc, p, publisher.Config{}, publisher.BatchConfig{Stream: name})
		if err != nil {
			b.Fatal(err)
		}
		go func() { done <- bp.Run(rctx) }()
		defer func() { cancel(); <-done; _ = bp.Close() }()
		pub = bp
	}

	const n = 1 << 14 // distinct messages, reused with fresh ids
	data := []byte(`{"seq": 1, "note": "` + strings.Repeat("x", 176) + `", "customer": "customer-1", "amount_cents": 7919}`)
	ids := make([]string, 1<<16)
	salt := testenv.UniqueName("r")
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-%d", salt, i)
	}
	subjects := make([]string, 1000)
	keys := make([]string, 1000)
	for i := range subjects {
		subjects[i] = fmt.Sprintf("%s.order.agg-%d", prefix, i)
		keys[i] = fmt.Sprintf("order\x00agg-%d", i)
	}
	var settled atomic.Int64
	msgs := make([]publisher.Message, n)
	free := make([]atomic.Bool, n) // slot i's message is settled
	for i := range msgs {
		free[i].Store(true)
		msgs[i] = publisher.Message{Header: benchHeader(i), Data: data, Owner: publisher.OwnerFuncs{Done: func(publisher.Result) {
			free[i].Store(true)
			settled.Add(1)
		}}}
	}
	b.ReportAllocs()
	b.SetBytes(int64(len(data)))
	cpu0 := processCPU()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		slot := i % n
		for !free[slot].Load() {
			runtime.Gosched() // not reached unless an ack is very late
		}
		free[slot].Store(false)
		m := &msgs[slot]
		m.Subject, m.Key = subjects[i%1000], keys[i%1000]
		// A fresh id, so the stream stores every message.
		m.Header[0].Value = ids[i%len(ids)] // contract.MsgID
		for {
			ok, err := pub.TryPublish(m)
			if err != nil {
				b.Fatal(err)
			}
			if ok {
				break
			}
			<-pub.Space()
		}
	}
	dctx, dcancel := context.WithTimeout(ctx, time.Minute)
	defer dcancel()
	if err := pub.Drain(dctx); err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	// The process's CPU per message: the client's alone when the server
	// runs elsewhere (OUTBOX_TEST_NATS_URL).
	b.ReportMetric(float64(processCPU()-cpu0)/float64(b.N), "cpu-ns/op")
	if got := settled.Load(); got != int64(b.N) {
		b.Fatalf("settled %d of %d", got, b.N)
	}
}
