package faults

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// storedMsg is one message read back from a stream.
type storedMsg struct {
	Seq       uint64
	Stored    time.Time // when the stream stored it (server clock = ours)
	Subject   string
	EventID   string
	Aggregate string
	Version   int64
	CommitLSN replication.LSN
	Data      []byte
	Header    map[string][]string
}

// readStream reads every message of stream in sequence order.
func readStream(ctx context.Context, t *testing.T, js jetstream.JetStream, stream string) []storedMsg {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	st, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs == 0 {
		return nil
	}
	// A cluster that just lost a node may answer "no responders" or time
	// out for a while: read again from the next sequence, with a fresh
	// consumer, until the deadline.
	var out []storedMsg
	var cons jetstream.Consumer
	for uint64(len(out)) < info.State.Msgs {
		if cons == nil {
			cfg := jetstream.OrderedConsumerConfig{}
			if len(out) > 0 {
				cfg.DeliverPolicy = jetstream.DeliverByStartSequencePolicy
				cfg.OptStartSeq = out[len(out)-1].Seq + 1
			}
			if cons, err = st.OrderedConsumer(ctx, cfg); err != nil {
				if ctx.Err() != nil {
					t.Fatalf("consume %s: %v", stream, err)
				}
				time.Sleep(200 * time.Millisecond)
				continue
			}
		}
		// Ask for no more than remain: Fetch waits for the whole batch.
		remain := int(info.State.Msgs) - len(out)
		batch, err := cons.Fetch(min(remain, 2000), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			if ctx.Err() != nil {
				t.Fatalf("fetch from %s: %v", stream, err)
			}
			cons = nil
			time.Sleep(200 * time.Millisecond)
			continue
		}
		n := 0
		for m := range batch.Messages() {
			n++
			md, _ := m.Metadata()
			h := m.Headers()
			sm := storedMsg{Seq: md.Sequence.Stream, Stored: md.Timestamp, Subject: m.Subject(), Data: m.Data(), Header: h,
				EventID: h.Get(contract.EventID), Aggregate: h.Get(contract.AggregateID)}
			sm.Version, _ = strconv.ParseInt(h.Get(contract.AggregateVersion), 10, 64)
			sm.CommitLSN, _ = replication.ParseLSN(h.Get(contract.CommitLSN))
			out = append(out, sm)
		}
		if err := batch.Error(); err != nil {
			if ctx.Err() != nil {
				t.Fatalf("fetch from %s: %v", stream, err)
			}
			cons = nil
			continue
		}
		if n == 0 {
			t.Fatalf("stream %s: read %d of %d messages, then nothing", stream, len(out), info.State.Msgs)
		}
	}
	return out
}

// committedRows reads the outbox table: every row in it was committed,
// which makes it the ground truth for "every committed event".
func committedRows(ctx context.Context, t *testing.T, s *scenario) []relaytest.Event {
	t.Helper()
	var out []relaytest.Event
	var err error
	// The database may just be coming back from a restart.
	for deadline := time.Now().Add(30 * time.Second); ; {
		var rows pgx.Rows
		rows, err = s.db.Pool.Query(ctx, "SELECT event_id::text, aggregate_id, aggregate_version, payload::text FROM outbox ORDER BY aggregate_id, aggregate_version")
		if err == nil {
			out, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (relaytest.Event, error) {
				var e relaytest.Event
				err := r.Scan(&e.ID, &e.Aggregate, &e.Version, &e.Payload)
				return e, err
			})
		}
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("read outbox rows: %v", err)
	}
	return out
}

// lsnSampler records the slot's confirmed_flush_lsn every interval, with
// the time the answer arrived.
type lsnSampler struct {
	mu      sync.Mutex
	samples []lsnSample
	cancel  context.CancelFunc
	done    chan struct{}
}

type lsnSample struct {
	at        time.Time
	confirmed replication.LSN
}

// sample starts recording the scenario's slot position until the test ends
// or verify runs.
func (s *scenario) sample() {
	ctx, cancel := context.WithCancel(context.Background())
	ls := &lsnSampler{cancel: cancel, done: make(chan struct{})}
	s.sampler = ls
	url := s.pg.URL("postgres")
	go func() {
		defer close(ls.done)
		var conn *pgx.Conn
		defer func() {
			if conn != nil {
				conn.Close(context.Background())
			}
		}()
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			if conn == nil || conn.IsClosed() {
				cctx, cancel := context.WithTimeout(ctx, time.Second)
				c, err := pgx.Connect(cctx, url)
				cancel()
				if err != nil {
					continue // the server is restarting
				}
				conn = c
			}
			qctx, cancel := context.WithTimeout(ctx, time.Second)
			var txt *string
			err := conn.QueryRow(qctx, "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1", s.name).Scan(&txt)
			cancel()
			if err != nil {
				conn.Close(context.Background())
				conn = nil
				continue
			}
			// The position the query saw was confirmed by a status update
			// the relay sent before now.
			at := time.Now()
			if txt == nil {
				continue
			}
			l, err := replication.ParseLSN(*txt)
			if err != nil {
				continue
			}
			ls.mu.Lock()
			ls.samples = append(ls.samples, lsnSample{at: at, confirmed: l})
			ls.mu.Unlock()
		}
	}()
}

func (ls *lsnSampler) stop() {
	ls.cancel()
	<-ls.done
}

// lsnAhead counts samples in which the slot had confirmed a position
// covering a transaction that was not yet (fully) stored: a message with
// commit LSN below the sampled position whose first copy was stored after
// the sample was taken. msgs are every event and dead-letter record read
// back.
func lsnAhead(samples []lsnSample, msgs []storedMsg) (bad int, detail string) {
	first := map[string]storedMsg{}
	for _, m := range msgs {
		key := m.EventID
		if key == "" {
			key = "seq:" + strconv.FormatUint(m.Seq, 10)
		}
		if f, ok := first[key]; !ok || m.Stored.Before(f.Stored) {
			first[key] = m
		}
	}
	byLSN := make([]storedMsg, 0, len(first))
	for _, m := range first {
		if m.CommitLSN != 0 {
			byLSN = append(byLSN, m)
		}
	}
	sort.Slice(byLSN, func(i, j int) bool { return byLSN[i].CommitLSN < byLSN[j].CommitLSN })
	// latest[i] is the latest store time among byLSN[:i+1].
	latest := make([]time.Time, len(byLSN))
	for i, m := range byLSN {
		latest[i] = m.Stored
		if i > 0 && latest[i-1].After(m.Stored) {
			latest[i] = latest[i-1]
		}
	}
	for _, smp := range samples {
		// Messages of transactions that commit before the confirmed
		// position: CommitLSN < confirmed.
		n := sort.Search(len(byLSN), func(i int) bool { return byLSN[i].CommitLSN >= smp.confirmed })
		if n == 0 {
			continue
		}
		if latest[n-1].After(smp.at) {
			bad++
			if detail == "" {
				// Find one culprit for the message.
				for _, m := range byLSN[:n] {
					if m.Stored.After(smp.at) {
						detail = fmt.Sprintf("at %s the slot confirmed %s, but event %s (commit %s) was stored only at %s",
							smp.at.Format("15:04:05.000"), smp.confirmed, m.EventID, m.CommitLSN, m.Stored.Format("15:04:05.000"))
						break
					}
				}
			}
		}
	}
	return bad, detail
}

// outcome is what verify found.
type outcome struct {
	relaytest.Report
	LSNAhead int
	Samples  int
	Detail   string
	Stream   []storedMsg
	DLQ      []storedMsg
}

func (o outcome) String() string {
	return fmt.Sprintf("%s, lsn-ahead %d of %d samples %s", o.Report, o.LSNAhead, o.Samples, o.Detail)
}

// verify waits until the stream holds every committed row (minus the
// expected dead letters), stops the LSN sampler, and checks the
// guarantees. deadLettered are event ids expected in the dead-letter stream
// instead of the event stream.
func (s *scenario) verify(timeout time.Duration, deadLettered ...string) outcome {
	s.t.Helper()
	ctx := context.Background()
	dl := map[string]bool{}
	for _, id := range deadLettered {
		dl[id] = true
	}
	expected := func() []relaytest.Event {
		var want []relaytest.Event
		for _, r := range committedRows(ctx, s.t, s) {
			if !dl[r.ID] {
				want = append(want, r)
			}
		}
		return want
	}
	want := expected()
	var n uint64
	if !testenv.WaitFor(timeout, func() bool {
		n, _ = s.streamState(ctx, s.stream)
		return n >= uint64(len(want))
	}) {
		s.t.Logf("stream %s holds %d of %d committed events after %s", s.stream, n, len(want), timeout)
	}
	s.logf("verify: %d committed rows, stream holds %d", len(want)+len(deadLettered), n)
	if s.sampler != nil {
		// Let the slot catch up so the last samples cover the tail too.
		testenv.WaitFor(5*time.Second, func() bool {
			st, err := s.slot(ctx)
			return err == nil && st.LagBytes < 1<<16
		})
		time.Sleep(300 * time.Millisecond)
		s.sampler.stop()
	}
	msgs := readStream(ctx, s.t, s.js, s.stream)
	// A writer stopped by cancellation may have had its COMMIT finish on
	// the server after the first look at the table: read it again, and
	// the stream too if a late row appeared.
	if late := expected(); len(late) != len(want) {
		s.logf("verify: %d rows committed late", len(late)-len(want))
		want = late
		testenv.WaitFor(timeout, func() bool {
			n, _ = s.streamState(ctx, s.stream)
			return n >= uint64(len(want))
		})
		msgs = readStream(ctx, s.t, s.js, s.stream)
	}
	s.logf("verify: read %d messages", len(msgs))
	got := make([]relaytest.Received, len(msgs))
	for i, m := range msgs {
		got[i] = relaytest.Received{Seq: m.Seq, Subject: m.Subject, Data: m.Data, Headers: m.Header,
			Event: contract.Event{ID: m.EventID, AggregateID: m.Aggregate, AggregateVersion: m.Version}}
	}
	o := outcome{Report: relaytest.Check(want, got), Stream: msgs}
	all := msgs
	if dn, _ := s.streamState(ctx, s.dlq); dn > 0 {
		o.DLQ = readStream(ctx, s.t, s.js, s.dlq)
		all = append(append([]storedMsg(nil), msgs...), o.DLQ...)
	}
	if s.sampler != nil {
		s.sampler.mu.Lock()
		samples := append([]lsnSample(nil), s.sampler.samples...)
		s.sampler.mu.Unlock()
		o.Samples = len(samples)
		o.LSNAhead, o.Detail = lsnAhead(samples, all)
	}
	return o
}

// mustHold fails the test unless every guarantee held, and records the
// outcome in the summary table.
func (s *scenario) mustHold(fault string, o outcome, recovery time.Duration, note string) {
	s.t.Helper()
	record(faultRow{Fault: fault, Events: o.Written, Missing: o.Missing, OutOfOrder: o.OutOfOrder,
		Duplicates: o.Duplicates, LSNAhead: o.LSNAhead, Recovery: recovery, Note: note})
	s.t.Logf("%s: %s; recovery %s %s", fault, o, recovery.Round(time.Millisecond), note)
	if !o.OK() || o.LSNAhead > 0 {
		s.t.Fatalf("%s: guarantees broken: %s", fault, o)
	}
	if o.Written == 0 {
		s.t.Fatalf("%s: no events were written", fault)
	}
	if s.sampler != nil && o.Samples < 5 {
		s.t.Fatalf("%s: only %d slot samples: the LSN check proves nothing", fault, o.Samples)
	}
}
