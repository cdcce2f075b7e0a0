package main

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/replication"
)

// errMissingEvents means an event the demo wrote to the outbox did not
// arrive in the stream in time.
var errMissingEvents = errors.New("expected events missing from the stream")

// arrivals matches the events written to the outbox against those seen in
// the stream. The watcher goroutine records arrivals; the main flow records
// expectations and waits.
type arrivals struct {
	mu       sync.Mutex
	expected map[string]confirmedEvent
	seen     map[string]uint64 // event id -> stream sequence of its first copy
	maxLSN   replication.LSN   // highest Outbox-Commit-LSN seen
	changed  chan struct{}     // capacity 1: "something was recorded"
}

func newArrivals() *arrivals {
	return &arrivals{expected: map[string]confirmedEvent{}, seen: map[string]uint64{}, changed: make(chan struct{}, 1)}
}

func (a *arrivals) expect(ev confirmedEvent) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.expected[ev.EventID] = ev
}

func (a *arrivals) arrived(eventID string, seq uint64, lsn replication.LSN) {
	a.mu.Lock()
	if _, dup := a.seen[eventID]; !dup {
		a.seen[eventID] = seq
	}
	a.maxLSN = max(a.maxLSN, lsn)
	a.mu.Unlock()
	select {
	case a.changed <- struct{}{}:
	default:
	}
}

// missing returns the expected events not seen yet.
func (a *arrivals) missing() []confirmedEvent {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []confirmedEvent
	for id, ev := range a.expected {
		if _, ok := a.seen[id]; !ok {
			out = append(out, ev)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].EventID < out[j].EventID })
	return out
}

// wait blocks until every expected event arrived, the timeout passes, or ctx
// ends.
func (a *arrivals) wait(ctx context.Context, timeout time.Duration) error {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		miss := a.missing()
		if len(miss) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-a.changed:
		case <-deadline.C:
			ids := make([]string, len(miss))
			for i, ev := range miss {
				ids[i] = fmt.Sprintf("%s (registration %s, version %d)", ev.EventID, ev.RegistrationID, ev.Version)
			}
			return fmt.Errorf("%w: after %s, %d of %d events did not arrive: %v", errMissingEvents, timeout, len(miss), len(a.expected), ids)
		}
	}
}

// watch prints every message of the stream as it arrives, through an
// ordered consumer (ephemeral, in stream order, recreated by the client on
// a gap), until ctx ends.
func (d *demo) watch(ctx context.Context, cons jetstream.Consumer) error {
	it, err := cons.Messages()
	if err != nil {
		return fmt.Errorf("consume stream %s: %w", d.cfg.NATS.Stream, err)
	}
	defer it.Stop()
	for {
		msg, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("read stream %s: %w", d.cfg.NATS.Stream, err)
		}
		seq := uint64(0)
		if md, err := msg.Metadata(); err == nil {
			seq = md.Sequence.Stream
		}
		if !d.quietEvents.Load() {
			d.printEvent(msg, seq)
		}
		h := msg.Headers()
		lsn, _ := replication.ParseLSN(h.Get(contract.CommitLSN))
		d.arrivals.arrived(h.Get(contract.EventID), seq, lsn)
	}
}

// expectedEvents returns the events written to the outbox with the stream
// sequence of their first copy (0 if not seen), in a stable order.
func (a *arrivals) expectedEvents() ([]confirmedEvent, []uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	evs := make([]confirmedEvent, 0, len(a.expected))
	for _, ev := range a.expected {
		evs = append(evs, ev)
	}
	sort.Slice(evs, func(i, j int) bool { return a.seen[evs[i].EventID] < a.seen[evs[j].EventID] })
	seqs := make([]uint64, len(evs))
	for i, ev := range evs {
		seqs[i] = a.seen[ev.EventID]
	}
	return evs, seqs
}

// poll calls cond every 50ms until it returns true (then poll returns true),
// the timeout passes or ctx ends.
func poll(ctx context.Context, timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		select {
		case <-ctx.Done():
			return false
		case <-tick.C:
		}
	}
}

func (d *demo) printEvent(msg jetstream.Msg, seq uint64) {
	h := msg.Headers()
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	body := make([]string, 0, len(keys)+1)
	for _, k := range keys {
		for _, v := range h[k] {
			body = append(body, fmt.Sprintf("%-26s %s", k+":", v))
		}
	}
	body = append(body, fmt.Sprintf("%-26s %s", "payload:", msg.Data()))
	d.out.block(fmt.Sprintf("<-- stream %s seq %d  subject %s", d.cfg.NATS.Stream, seq, msg.Subject()), body)
}
