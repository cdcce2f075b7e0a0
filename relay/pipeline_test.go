package relay

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
	"github.com/outbox-relay/outbox-relay/watermark"
)

// errEndOfScript ends a scripted stream.
var errEndOfScript = errors.New("end of script")

// scriptStream replays changes, then fails with errEndOfScript.
type scriptStream struct {
	changes     []any
	heartbeats  int
	onHeartbeat func()
}

func (s *scriptStream) Next(context.Context) (any, error) {
	if len(s.changes) == 0 {
		return nil, errEndOfScript
	}
	c := s.changes[0]
	s.changes = s.changes[1:]
	return c, nil
}

func (s *scriptStream) Heartbeat(context.Context) error {
	s.heartbeats++
	if s.onHeartbeat != nil {
		s.onHeartbeat()
	}
	return nil
}

// recordingPublisher keeps what it is handed; room bounds the unsettled
// messages it takes (0: no bound).
type recordingPublisher struct {
	msgs    []*publisher.Message
	settled int
	room    int
	space   chan struct{}
}

func newRecordingPublisher(room int) *recordingPublisher {
	return &recordingPublisher{room: room, space: make(chan struct{}, 1)}
}

func (p *recordingPublisher) TryPublish(m *publisher.Message) (bool, error) {
	if p.room > 0 && len(p.msgs)-p.settled >= p.room {
		return false, nil
	}
	p.msgs = append(p.msgs, m)
	return true, nil
}

func (p *recordingPublisher) Space() <-chan struct{} { return p.space }

// settleNext settles the oldest unsettled message and signals space.
func (p *recordingPublisher) settleNext() {
	p.msgs[p.settled].Owner.Settled(publisher.Result{Attempts: 1})
	p.settled++
	select {
	case p.space <- struct{}{}:
	default:
	}
}

// The pipeline's settle, watermark and dead-letter interplay, without
// servers: a scripted replication stream, recording publishers, the real
// router and tracker. Messages settle in the order each step says; the
// watermark must move past a transaction only once every message of it,
// and of every earlier one, is acked or its dead-letter record is.
func TestPipelineSettleWatermarkDeadLetter(t *testing.T) {
	const start = watermark.LSN(100)
	rel := &replication.Relation{ID: 1, Namespace: "public", Name: "outbox"}
	for _, c := range []string{"event_id", "aggregate_type", "aggregate_id", "aggregate_version", "event_type", "payload", "occurred_at"} {
		rel.Columns = append(rel.Columns, replication.Column{Name: c, TypeOID: 25})
	}
	row := func(id string) *replication.Insert {
		text := func(s string) replication.Value {
			return replication.Value{Kind: replication.ValueText, Data: []byte(s)}
		}
		eventID := text("3f2504e0-4f89-11d3-9a0c-0305e82c33" + id)
		if id == "bad" {
			eventID = replication.Value{Kind: replication.ValueNull} // unroutable: no event id
		}
		return &replication.Insert{Relation: rel, LSN: 150, Values: []replication.Value{
			eventID, text("order"), text("o-" + id), text("1"), text("OrderPlaced"), text(`{}`), text("2026-12-01 12:00:00+00"),
		}}
	}
	tx := func(end watermark.LSN, rows ...*replication.Insert) []any {
		out := []any{&replication.Begin{FinalLSN: end - 8, CommitTime: time.Now()}}
		for _, r := range rows {
			out = append(out, r)
		}
		return append(out, &replication.Commit{CommitLSN: end - 8, EndLSN: end})
	}
	// A non-transactional logical message, unroutable (no envelope): it is
	// a transaction of its own, settled when its record is.
	lone := func(lsn watermark.LSN) []any {
		return []any{&replication.Message{Prefix: "evt", Content: []byte("not an envelope"), LSN: lsn}}
	}
	// A step settles an event ("e<i>"), a dead-letter record ("d<i>"), or
	// has the broker reject event i ("r<i>": its DeadLetter builds the
	// record, which is then acked), and checks the watermark after it.
	type step struct {
		op   string
		want watermark.LSN
	}
	tests := []struct {
		name     string
		changes  [][]any
		room     int // event publisher's window, 0 unbounded
		maxTxs   int // MaxUnsettledTxs, 0 default
		events   int // messages handed to the event publisher
		dead     int // records handed to the dead-letter publisher
		afterRun watermark.LSN
		steps    []step
	}{
		{name: "a transaction without rows confirms at its commit",
			changes: [][]any{tx(200)}, afterRun: 200},
		{name: "every row of a transaction must settle",
			changes: [][]any{tx(200, row("01"), row("02"))}, events: 2, afterRun: start,
			steps: []step{{"e1", start}, {"e0", 200}}},
		{name: "a later ack does not pass an earlier transaction",
			changes: [][]any{tx(200, row("01")), tx(300, row("02"))}, events: 2, afterRun: start,
			steps: []step{{"e1", start}, {"e0", 300}}},
		{name: "an unroutable row is dead-lettered and holds the watermark until its record is acked",
			changes: [][]any{tx(200, row("01")), tx(300, row("bad")), tx(400, row("03"))}, events: 2, dead: 1, afterRun: start,
			steps: []step{{"e0", 200}, {"e1", 200}, {"d0", 400}}},
		{name: "a row the broker rejects settles once its dead-letter record is acked",
			changes: [][]any{tx(200, row("01")), tx(300, row("02"))}, events: 2, afterRun: start,
			steps: []step{{"e1", start}, {"r0", 300}}},
		{name: "a full window waits, answering the server, and resumes",
			changes: [][]any{tx(200, row("01")), tx(300, row("02"))}, room: 1, events: 2, afterRun: 200,
			steps: []step{{"e1", 300}}},
		{name: "at the unsettled-transaction bound intake waits for the watermark",
			changes: [][]any{tx(200, row("01")), tx(300, row("02")), tx(400, row("03"))}, maxTxs: 2, events: 3, afterRun: 300,
			steps: []step{{"e2", 400}}},
		// Regression (issue 25): a message outside any transaction skipped
		// the bound.
		{name: "non-transactional messages wait at the bound too",
			changes: [][]any{lone(200), lone(300), lone(400)}, maxTxs: 1, dead: 3, afterRun: 300,
			steps: []step{{"d2", 400}}},
		{name: "a bound of one transaction resumes once it settles",
			changes: [][]any{tx(200, row("01")), tx(300, row("02"))}, maxTxs: 1, events: 2, afterRun: 200,
			steps: []step{{"e1", 300}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rt, err := router.New(router.Config{Tables: []router.TableConfig{{Table: "public.outbox"}}, Messages: []router.MessageConfig{{Prefix: "evt"}}})
			if err != nil {
				t.Fatal(err)
			}
			cfg := Config{MaxUnsettledTxs: DefaultMaxUnsettledTxs, MaxUnsettledBytes: DefaultMaxUnsettledBytes, StallWarning: time.Minute}
			if tt.maxTxs > 0 {
				cfg.MaxUnsettledTxs = tt.maxTxs
			}
			r := &Relay{cfg: cfg, log: zaptest.NewLogger(t), obs: NopObserver{}, router: rt}
			events, dead := newRecordingPublisher(tt.room), newRecordingPublisher(0)
			st := &scriptStream{}
			for _, c := range tt.changes {
				st.changes = append(st.changes, c...)
			}
			var paused bool
			// A waiting pipeline answers the server; the first ack arrives
			// meanwhile.
			st.onHeartbeat = func() {
				paused = paused || r.IntakePaused()
				switch {
				case events.settled < len(events.msgs):
					events.settleNext()
				case dead.settled < len(dead.msgs):
					dead.settleNext()
				}
			}
			tracker := watermark.NewTracker(start)
			p := pipeline{r: r, st: st, events: func() publishTarget { return events }, deadLetters: dead,
				tracker: tracker, msgs: newMessagePrefixes([]string{"evt"})}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if err := p.run(ctx); !errors.Is(err, errEndOfScript) {
				t.Fatalf("run: %v", err)
			}
			if len(events.msgs) != tt.events || len(dead.msgs) != tt.dead {
				t.Fatalf("%d events and %d dead-letter records published, want %d and %d", len(events.msgs), len(dead.msgs), tt.events, tt.dead)
			}
			if (tt.room > 0 || tt.maxTxs > 0) && st.heartbeats == 0 {
				t.Fatal("the pipeline waited without answering the server")
			}
			if tt.maxTxs > 0 && !paused {
				t.Fatal("intake was not reported paused at the bound")
			}
			if got := tracker.Confirmed(); got != tt.afterRun {
				t.Fatalf("after the stream: confirmed %s, want %s", got, tt.afterRun)
			}
			for _, s := range tt.steps {
				i := int(s.op[1] - '0')
				switch s.op[0] {
				case 'e':
					events.msgs[i].Owner.Settled(publisher.Result{Attempts: 1})
				case 'd':
					dead.msgs[i].Owner.Settled(publisher.Result{Attempts: 1})
				case 'r':
					m := events.msgs[i]
					reason := &publisher.PublishError{Subject: m.Subject, Class: "too_large", Err: publisher.ErrRejected}
					rec := m.Owner.(publisher.DeadLetterer).DeadLetter(reason)
					if !strings.HasPrefix(rec.Subject, router.DefaultDeadLetterSubject+".") {
						t.Fatalf("dead-letter record on %q", rec.Subject)
					}
					m.Owner.Settled(publisher.Result{Attempts: 2, DeadLettered: true, Reason: reason})
				}
				if got := tracker.Confirmed(); got != s.want {
					t.Fatalf("after %s: confirmed %s, want %s", s.op, got, s.want)
				}
			}
			if !tracker.Idle() {
				t.Fatal("transactions left unsettled")
			}
		})
	}
}

// discardPublisher takes every message and forgets it.
type discardPublisher struct{ space chan struct{} }

func (discardPublisher) TryPublish(*publisher.Message) (bool, error) { return true, nil }
func (p discardPublisher) Space() <-chan struct{}                    { return p.space }

// TestPublishEventAllocs pins what handing a routed event to the publisher
// allocates: its outbound alone, the message's Owner pointing back to it
// (bench/README.md, issue 28: the Done and DeadLetter method values were
// two allocations more per event).
func TestPublishEventAllocs(t *testing.T) {
	rt, err := router.New(router.Config{Tables: []router.TableConfig{{Table: "public.outbox"}}})
	if err != nil {
		t.Fatal(err)
	}
	rel := &replication.Relation{ID: 1, Namespace: "public", Name: "outbox"}
	var vals []replication.Value
	for _, c := range []struct{ name, v string }{{"event_id", "e-1"}, {"aggregate_id", "a-1"}, {"aggregate_version", "1"}, {"event_type", "Created"}, {"payload", "{}"}} {
		rel.Columns = append(rel.Columns, replication.Column{Name: c.name, TypeOID: 25})
		vals = append(vals, replication.Value{Kind: replication.ValueText, Data: []byte(c.v)})
	}
	r := &Relay{log: zaptest.NewLogger(t), obs: NopObserver{}, router: rt}
	tracker := watermark.NewTracker(100)
	events := discardPublisher{space: make(chan struct{})}
	p := pipeline{r: r, events: func() publishTarget { return events }, tracker: tracker, tx: tracker.Begin(time.Now())}
	rm, err := rt.Route(&replication.Insert{Relation: rel, Values: vals}, router.CommitInfo{LSN: 100})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if n := testing.AllocsPerRun(100, func() {
		if err := p.publishEvent(ctx, rm); err != nil {
			t.Fatal(err)
		}
	}); n > 1 {
		t.Fatalf("publishEvent: %.0f allocations per event, want 1", n)
	}
}
