// Package relaytest holds what the relay's integration and fault tests
// share: writing outbox events from concurrent writers, reading a stream
// back, and checking the delivery guarantees on what was read.
package relaytest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
)

// Event is one outbox row a test wrote.
type Event struct {
	ID        string
	Aggregate string
	Version   int64
	Payload   string
}

// Load describes a write load: Events over Aggregates from Writers
// concurrent writers, transactions of 1 row or BigTx rows.
type Load struct {
	Table      string // default "outbox"
	Events     int
	Aggregates int
	Writers    int
	BigTx      int // rows of a large transaction; 0 means 1-row only
	// BigEvery makes every BigEvery-th transaction large (default 2).
	BigEvery int
	// Pause between transactions of one writer, to spread a load in time.
	Pause time.Duration
}

// WriteAsync runs Write on a goroutine; wait blocks until it is done and
// returns its events.
func WriteAsync(ctx context.Context, t testing.TB, pool *pgxpool.Pool, l Load) (wait func() []Event) {
	var evs []Event
	done := make(chan struct{})
	go func() {
		defer close(done)
		evs = Write(ctx, t, pool, l)
	}()
	return func() []Event {
		<-done
		return evs
	}
}

// Write inserts the load's events and returns them. Each writer owns a
// disjoint set of aggregates so versions are assigned without conflicts,
// and inserts them in version order.
func Write(ctx context.Context, t testing.TB, pool *pgxpool.Pool, l Load) []Event {
	t.Helper()
	if l.Table == "" {
		l.Table = "outbox"
	}
	if l.Writers < 1 {
		l.Writers = 1
	}
	if l.BigEvery < 1 {
		l.BigEvery = 2
	}
	prefix := uuid.NewString()[:8]
	var mu sync.Mutex
	var all []Event
	var wg sync.WaitGroup
	errs := make(chan error, l.Writers)
	per := l.Events / l.Writers
	for w := 0; w < l.Writers; w++ {
		n := per
		if w == l.Writers-1 {
			n = l.Events - per*(l.Writers-1)
		}
		wg.Add(1)
		go func(w, n int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			versions := map[string]int64{}
			var aggs []string
			for a := w; a < l.Aggregates; a += l.Writers {
				aggs = append(aggs, fmt.Sprintf("%s-agg-%d", prefix, a))
			}
			if len(aggs) == 0 {
				aggs = []string{fmt.Sprintf("%s-agg-w%d", prefix, w)}
			}
			txi := 0
			for written := 0; written < n; txi++ {
				size := 1
				if l.BigTx > 0 && txi%l.BigEvery == 1 {
					size = min(l.BigTx, n-written)
				}
				batch := &pgx.Batch{}
				var evs []Event
				for i := 0; i < size; i++ {
					agg := aggs[rng.IntN(len(aggs))]
					versions[agg]++
					ev := Event{ID: uuid.NewString(), Aggregate: agg, Version: versions[agg],
						Payload: fmt.Sprintf(`{"aggregate": "%s", "n": %d, "text": "ünïcode ✓"}`, agg, versions[agg])}
					batch.Queue(`INSERT INTO `+l.Table+` (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ($1, 'registration', $2, $3, 'RegistrationConfirmed', $4)`,
						ev.ID, ev.Aggregate, ev.Version, ev.Payload)
					evs = append(evs, ev)
				}
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					return tx.SendBatch(ctx, batch).Close()
				})
				if err != nil {
					errs <- fmt.Errorf("writer %d: %w", w, err)
					return
				}
				mu.Lock()
				all = append(all, evs...)
				mu.Unlock()
				written += size
				if l.Pause > 0 {
					time.Sleep(l.Pause)
				}
			}
		}(w, n)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	return all
}

// Received is one message read back from a stream.
type Received struct {
	Seq     uint64
	Subject string
	Event   contract.Event
	Data    []byte
	Headers map[string][]string
}

// ReadStream reads every message of stream in sequence order.
func ReadStream(ctx context.Context, t testing.TB, js jetstream.JetStream, stream string) []Received {
	t.Helper()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := info.State.Msgs
	if want == 0 {
		return nil
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var out []Received
	for uint64(len(out)) < want {
		batch, err := cons.Fetch(1000, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			t.Fatalf("fetch: %v", err)
		}
		got := 0
		for m := range batch.Messages() {
			got++
			md, _ := m.Metadata()
			ev, _ := contract.Parse(m.Headers(), m.Data())
			out = append(out, Received{Seq: md.Sequence.Stream, Subject: m.Subject(), Event: ev, Data: m.Data(), Headers: m.Headers()})
		}
		if batch.Error() != nil {
			t.Fatalf("fetch: %v", batch.Error())
		}
		if got == 0 {
			t.Fatalf("stream %s: read %d of %d messages, then nothing", stream, len(out), want)
		}
	}
	return out
}

// StreamCount returns the number of messages in stream (0 if it is missing).
func StreamCount(ctx context.Context, js jetstream.JetStream, stream string) uint64 {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return 0
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0
	}
	return info.State.Msgs
}

// Report is the outcome of checking a stream against what was written.
type Report struct {
	Written, Received int
	Missing           int
	Duplicates        int // event ids stored more than once
	OutOfOrder        int // messages whose aggregate version is not above the previous one
	BadContent        int // payload bytes or headers differ from what was written
	Unexpected        int // event ids that were never written
}

// OK reports whether every guarantee held.
func (r Report) OK() bool {
	return r.Missing == 0 && r.Duplicates == 0 && r.OutOfOrder == 0 && r.BadContent == 0 && r.Unexpected == 0
}

func (r Report) String() string {
	return fmt.Sprintf("written %d, received %d, missing %d, duplicates %d, out of order %d, bad content %d, unexpected %d",
		r.Written, r.Received, r.Missing, r.Duplicates, r.OutOfOrder, r.BadContent, r.Unexpected)
}

// Check compares what was written with what the stream holds.
func Check(written []Event, got []Received) Report {
	r := Report{Written: len(written), Received: len(got)}
	byID := make(map[string]Event, len(written))
	for _, e := range written {
		byID[e.ID] = e
	}
	seen := map[string]bool{}
	last := map[string]int64{}
	for _, m := range got {
		id := m.Event.ID
		if seen[id] {
			r.Duplicates++
			continue
		}
		seen[id] = true
		w, ok := byID[id]
		if !ok {
			r.Unexpected++
			continue
		}
		if string(m.Data) != w.Payload ||
			m.Event.AggregateID != w.Aggregate || m.Event.AggregateVersion != w.Version {
			r.BadContent++
		}
		if v, ok := last[w.Aggregate]; ok && w.Version <= v {
			r.OutOfOrder++
		}
		last[w.Aggregate] = w.Version
	}
	for id := range byID {
		if !seen[id] {
			r.Missing++
		}
	}
	return r
}

// StoredPayloads replaces each event's Payload with the jsonb text
// PostgreSQL stored (it normalises key order and spacing), which is what the
// relay must publish byte for byte.
func StoredPayloads(ctx context.Context, t testing.TB, pool *pgxpool.Pool, table string, evs []Event) {
	t.Helper()
	rows, err := pool.Query(ctx, "SELECT event_id::text, payload::text FROM "+table)
	if err != nil {
		t.Fatal(err)
	}
	stored := map[string]string{}
	for rows.Next() {
		var id, p string
		if err := rows.Scan(&id, &p); err != nil {
			t.Fatal(err)
		}
		stored[id] = p
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for i := range evs {
		if p, ok := stored[evs[i].ID]; ok {
			evs[i].Payload = p
		}
	}
}

// Itoa is strconv.Itoa, for building names.
func Itoa(i int) string { return strconv.Itoa(i) }
