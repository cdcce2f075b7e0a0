// Package opstest is the fixture the operations packages' tests share
// (reconcile, cleanup, the metrics acceptance test): a test database with
// the seed's outbox table, unique slot/publication/stream names, and an
// in-process relay that a test starts and stops at will.
package opstest

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

// Fixture is one test's database, names, connections and relay config.
type Fixture struct {
	T      *testing.T
	DB     *testenv.Database
	NC     *nats.Conn
	JS     jetstream.JetStream
	Cfg    relay.Config
	Stream string
	DLQ    string
	// Prefix starts the event subjects; Prefix+"_dlq" the dead letters.
	Prefix string
}

// New creates the fixture on the package's shared servers, or on the NATS
// server at natsURL when it is not empty. Duplicates is the event stream's
// duplicate window (2m when 0).
func New(t *testing.T, natsURL string, duplicates time.Duration) *Fixture {
	t.Helper()
	env := testenv.Get(t)
	if natsURL == "" {
		natsURL = env.NATS.URL
	}
	if duplicates == 0 {
		duplicates = 2 * time.Minute
	}
	db := env.NewDatabase(t)
	db.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "outbox.sql"))
	nc, err := nats.Connect(natsURL, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	name := strings.ToUpper(testenv.UniqueName("R"))
	prefix := strings.ToLower(name)
	f := &Fixture{T: t, DB: db, NC: nc, JS: js, Stream: name, DLQ: name + "_DLQ", Prefix: prefix}
	f.Cfg = relay.Config{
		Replication: replication.Config{
			URL: db.URL, Slot: "slot_" + prefix, Publication: "pub_" + prefix,
			Tables: []string{"public.outbox"}, StatusInterval: 100 * time.Millisecond,
			// An idle relay confirms the server's WAL end from keepalives,
			// which it asks for after a third of this: reconcile's wait
			// for the slot stays short.
			ReceiveTimeout: time.Second,
		},
		Router: router.Config{
			Tables:            []router.TableConfig{{Table: "public.outbox", Subject: prefix + ".{aggregate_type}.{aggregate_id}"}},
			DeadLetterSubject: prefix + "_dlq",
		},
		Publisher:        publisher.Config{AckTimeout: 2 * time.Second},
		Stream:           provision.StreamSpec{Name: name, Subjects: []string{prefix + ".>"}, Duplicates: duplicates, AllowBatch: true},
		DeadLetterStream: provision.StreamSpec{Name: name + "_DLQ", Subjects: []string{prefix + "_dlq.>"}, Duplicates: 2 * time.Minute},
		CreateStreams:    true,
		ReconnectMin:     100 * time.Millisecond,
		ReconnectMax:     time.Second,
	}
	if err := f.Cfg.Router.Validate(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, f.Stream)
		_ = js.DeleteStream(ctx, f.DLQ)
	})
	return f
}

// Setup creates the publication and the slot.
func (f *Fixture) Setup(ctx context.Context) {
	f.T.Helper()
	if _, err := replication.Setup(ctx, f.Cfg.Replication); err != nil {
		f.T.Fatal(err)
	}
}

// CreateStreams creates the event and dead-letter streams, as the relay
// does when it starts.
func (f *Fixture) CreateStreams(ctx context.Context) {
	f.T.Helper()
	for _, spec := range []provision.StreamSpec{f.Cfg.Stream, f.Cfg.DeadLetterStream} {
		if _, err := provision.EnsureStream(ctx, f.JS, spec, true); err != nil {
			f.T.Fatal(err)
		}
	}
}

// Start runs a relay until the test ends or stop is called; stop waits for
// it and returns its error.
func (f *Fixture) Start(ctx context.Context, opts ...relay.Option) (rl *relay.Relay, stop func() error) {
	f.T.Helper()
	opts = append([]relay.Option{relay.WithLogger(zaptest.NewLogger(f.T).Named("relay"))}, opts...)
	rl, err := relay.New(f.Cfg, f.NC, opts...)
	if err != nil {
		f.T.Fatal(err)
	}
	stop = testenv.Background(ctx, f.T, rl.Run)
	return rl, stop
}

// WaitCount waits until the stream holds n messages.
func (f *Fixture) WaitCount(ctx context.Context, stream string, n uint64, timeout time.Duration) {
	f.T.Helper()
	var got uint64
	if !testenv.WaitFor(timeout, func() bool {
		got = relaytest.StreamCount(ctx, f.JS, stream)
		return got >= n
	}) {
		f.T.Fatalf("stream %s holds %d messages after %s, want %d", stream, got, timeout, n)
	}
}

// Write inserts the load's events into public.outbox.
func (f *Fixture) Write(ctx context.Context, l relaytest.Load) []relaytest.Event {
	f.T.Helper()
	evs := relaytest.Write(ctx, f.T, f.DB.Pool, l)
	relaytest.StoredPayloads(ctx, f.T, f.DB.Pool, "outbox", evs)
	return evs
}

// Read returns every message of stream in sequence order, as
// relaytest.ReadStream does, without waiting out a fetch expiry at the end.
func (f *Fixture) Read(ctx context.Context, stream string) []relaytest.Received {
	f.T.Helper()
	s, err := f.JS.Stream(ctx, stream)
	if err != nil {
		f.T.Fatalf("stream %s: %v", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		f.T.Fatal(err)
	}
	var out []relaytest.Received
	if info.State.Msgs == 0 {
		return out
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		f.T.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for uint64(len(out)) < info.State.Msgs && time.Now().Before(deadline) {
		batch, err := cons.FetchNoWait(1000)
		if err != nil {
			f.T.Fatalf("fetch: %v", err)
		}
		for m := range batch.Messages() {
			md, _ := m.Metadata()
			ev, _ := contract.Parse(m.Headers(), m.Data())
			out = append(out, relaytest.Received{Seq: md.Sequence.Stream, Subject: m.Subject(), Event: ev, Data: m.Data(), Headers: m.Headers()})
			if md.NumPending == 0 {
				return out
			}
		}
	}
	if uint64(len(out)) < info.State.Msgs {
		f.T.Fatalf("stream %s: read %d of %d messages", stream, len(out), info.State.Msgs)
	}
	return out
}

// StreamIDs returns the number of times each event id is in the stream.
func (f *Fixture) StreamIDs(ctx context.Context) map[string]int {
	f.T.Helper()
	ids := map[string]int{}
	for _, m := range f.Read(ctx, f.Stream) {
		ids[m.Event.ID]++
	}
	return ids
}

// DeleteFromStream deletes the stored messages of these event ids by hand,
// as an operator's mistake or a broker losing data would, and returns how
// many it deleted.
func (f *Fixture) DeleteFromStream(ctx context.Context, ids map[string]bool) int {
	f.T.Helper()
	s, err := f.JS.Stream(ctx, f.Stream)
	if err != nil {
		f.T.Fatal(err)
	}
	n := 0
	for _, m := range f.Read(ctx, f.Stream) {
		if ids[m.Event.ID] {
			if err := s.DeleteMsg(ctx, m.Seq); err != nil {
				f.T.Fatalf("delete seq %d: %v", m.Seq, err)
			}
			n++
		}
	}
	return n
}

// Writer inserts events for a fixed set of aggregates, continuing their
// versions across calls, so a test can interleave an aggregate's events
// across relay restarts, lost slots and repairs.
type Writer struct {
	// Age, when set, back-dates occurred_at by that much.
	Age      time.Duration
	f        *Fixture
	aggs     []string
	versions map[string]int64
	next     int
}

// NewWriter returns a writer over n aggregates.
func (f *Fixture) NewWriter(n int) *Writer {
	w := &Writer{f: f, versions: map[string]int64{}}
	p := strings.ToLower(testenv.UniqueName("agg"))
	for i := 0; i < n; i++ {
		w.aggs = append(w.aggs, p+"-"+relaytest.Itoa(i))
	}
	return w
}

// Write inserts n events round-robin over the aggregates, batch rows per
// transaction, and returns them with their stored payloads.
func (w *Writer) Write(ctx context.Context, n, batch int) []relaytest.Event {
	t := w.f.T
	t.Helper()
	var out []relaytest.Event
	for len(out) < n {
		tx, err := w.f.DB.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < batch && len(out) < n; i++ {
			agg := w.aggs[w.next%len(w.aggs)]
			w.next++
			w.versions[agg]++
			ev := relaytest.Event{ID: uuid.NewString(), Aggregate: agg, Version: w.versions[agg],
				Payload: `{"n": ` + relaytest.Itoa(int(w.versions[agg])) + `}`}
			if _, err := tx.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, occurred_at) VALUES ($1, 'registration', $2, $3, 'RegistrationConfirmed', $4, now() - $5::interval)`,
				ev.ID, ev.Aggregate, ev.Version, ev.Payload, w.Age); err != nil {
				t.Fatal(err)
			}
			out = append(out, ev)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// Partition makes the fixture's event stream partitioned for consumer
// groups (n partitions, one stream subject without '>'), as nats.partitions
// does. Call it before the streams are created.
func (f *Fixture) Partition(n int) {
	f.Cfg.Stream.Subjects = []string{f.Prefix + ".*.*"}
	f.Cfg.Stream.Partitions = n
}
