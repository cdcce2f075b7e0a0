package consumer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
)

// feed is one JetStream consumer's deliveries on their way to the workers,
// in stream order by construction rather than by timing. It is what both
// the plain durable (durableSource) and each partition of a group member
// (groupSource) pull through; a source decides which consumers to feed,
// the workers stay common.
//
// Order rests on three facts. A consumer reset (ResetConsumer) makes the
// server forget every delivery it has made and deliver again from its ack
// floor + 1, in stream order, numbering deliveries from consumer sequence 1.
// A pull subscription receives the deliveries addressed to it in the order
// they were made, so an unbroken run of consumer sequences 1, 2, 3, … is
// every delivery since the reset. And the workers apply what the feed hands
// them in that order per aggregate (a failed message holds back its
// aggregate's later ones until it is redelivered, worker.go). So a feed
// opens with a reset, and whenever the run of consumer sequences breaks —
// deliveries in transit lost with a pull that ended (`nats: no heartbeat
// received`, a reconnect), another process served by the same consumer, a
// takeover — it drops what it received, waits for the deliveries it handed
// out to settle (not for those held behind a retried message, which come
// back with the reset), resets and goes on from the ack floor. Deliveries
// of before the reset that are still queued in a worker are ahead of their
// repetitions, and are applied first; a repetition of an applied message is
// a duplicate (the dedup row). Nothing here waits for a redelivery timer.
type feed struct {
	e       *engine // whose workers the deliveries go to
	c       *Consumer
	cons    jetstream.Consumer
	name    string // the consumer's name
	pullOpt []jetstream.PullMessagesOpt
	log     *zap.Logger

	iter  jetstream.MessagesContext // nil until open
	next  uint64                    // the consumer sequence expected next
	reset time.Time                 // the last reset, to pace resets in a row
	why   string                    // why the next open resets (resumes_total)
	pin   string                    // the pin id of the last delivery (pinned priority groups)

	mu       sync.Mutex
	inflight map[string]int // aggregate key -> handed out, unsettled
	n        int            // total unsettled
	// returning holds the stream sequences naked back to the broker, still
	// counted in inflight until they are delivered again.
	returning map[uint64]string
	changed   chan struct{} // receives (non-blocking) on each settle
}

func newFeed(e *engine, cons jetstream.Consumer, name string, log *zap.Logger, opts ...jetstream.PullMessagesOpt) *feed {
	return &feed{
		e: e, c: e.c, cons: cons, name: name, pullOpt: opts, log: log, why: resumeStart,
		inflight:  map[string]int{},
		returning: map[uint64]string{},
		changed:   make(chan struct{}, 1),
	}
}

// pinHeader carries the pin id on a delivery to a pinned client.
const pinHeader = "Nats-Pin-Id"

// errFeedGap marks a break in the consumer sequence.
var errFeedGap = errors.New("consumer sequence gap")

// minResetInterval paces resets in a row (two processes sharing one plain
// durable see each other's deliveries as gaps): each costs a redelivery of
// everything unacknowledged.
const minResetInterval = time.Second

// open resets the consumer to its ack floor and opens a new pull
// subscription: deliveries made before the reset went to the previous
// subscription's inbox and are not received here.
func (f *feed) open(ctx context.Context) error {
	f.stop()
	if wait := time.Until(f.reset.Add(minResetInterval)); wait > 0 {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
	}
	var failing loopHealth
	for {
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err := f.c.js.ResetConsumer(rctx, f.c.cfg.Stream, f.name)
		cancel()
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if isGone(err) || errors.Is(err, jetstream.ErrConnectionClosed) {
			return err
		}
		// A reset that cannot be made now (NATS unreachable, a leader
		// election) is tried again: consuming without it could reorder.
		failing.report(f.log, "reset consumer "+f.name+" to its ack floor", err)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
	f.reset = time.Now()
	f.c.met.resumes[f.why].Inc()
	iter, err := f.cons.Messages(f.pullOpt...)
	if err != nil {
		return fmt.Errorf("pull from %s: %w", f.name, err)
	}
	f.iter, f.next = iter, 1
	return nil
}

// stop closes the pull subscription; what it buffered comes again after
// the next reset.
func (f *feed) stop() {
	if f.iter != nil {
		f.iter.Stop()
		f.iter = nil
	}
}

// isGone reports an error meaning the consumer no longer exists.
func isGone(err error) bool {
	return errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound)
}

// recv returns the next delivery in consumer-sequence order, reopening the
// feed after a break. It returns an error only when the consumer cannot be
// pulled any more (deleted, the connection closed) or ctx ends.
func (f *feed) recv(ctx context.Context) (jetstream.Msg, error) {
	for {
		if f.iter == nil {
			if err := f.open(ctx); err != nil {
				return nil, err
			}
		}
		msg, err := f.iter.Next(jetstream.NextContext(ctx))
		if err == nil {
			md, merr := msg.Metadata()
			if merr == nil && md.Sequence.Consumer == f.next {
				f.next++
				if pin := msg.Headers().Get(pinHeader); pin != "" {
					f.pin = pin
				}
				return msg, nil
			}
			err = fmt.Errorf("%w: delivery %d, expected %d", errFeedGap, seqOrZero(md), f.next)
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		switch {
		case isGone(err), errors.Is(err, jetstream.ErrConnectionClosed):
			return nil, err
		case errors.Is(err, jetstream.ErrNoHeartbeat), errors.Is(err, jetstream.ErrPinIDMismatch),
			errors.Is(err, jetstream.ErrConsumerLeadershipChanged), errors.Is(err, nats.ErrTimeout):
			// The subscription lives on; a delivery lost meanwhile shows
			// as a gap in the consumer sequence.
			f.log.Debug("pull interrupted; pulling on", zap.String("durable", f.name), zap.Error(err))
			continue
		case errors.Is(err, errFeedGap):
			f.why = resumeGap
			f.log.Info("deliveries missed; resuming in order from the ack floor", zap.String("durable", f.name), zap.Error(err))
		default:
			f.why = resumeEnded
			f.log.Warn("pull subscription ended; resuming in order from the ack floor", zap.String("durable", f.name), zap.Error(err))
		}
		f.stop()
		if err := f.settle(ctx); err != nil {
			return nil, err
		}
	}
}

func seqOrZero(md *jetstream.MsgMetadata) uint64 {
	if md == nil {
		return 0
	}
	return md.Sequence.Consumer
}

// settle waits until every delivery handed out is settled, except those
// of aggregates with a message naked for a retry: they wait for its
// redelivery, which comes with the reset. So the deliveries of one reset
// are out of the workers (but for those held) before the next reset's
// arrive, and a member never holds more than two resets' worth.
func (f *feed) settle(ctx context.Context) error {
	for !f.quiet() {
		select {
		case <-f.changed:
		case <-time.After(200 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// quiet reports whether everything handed out is settled or held behind a
// naked message of its aggregate.
func (f *feed) quiet() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	waiting := map[string]bool{}
	for _, key := range f.returning {
		waiting[key] = true
	}
	for key, n := range f.inflight {
		if n > 0 && !waiting[key] {
			return false
		}
	}
	return true
}

// forward hands a delivery to the worker of its aggregate, tracked until
// it is settled.
func (f *feed) forward(ctx context.Context, msg jetstream.Msg) error {
	it := f.c.newItem(msg)
	f.track(it.key)
	f.returned(it.m.StreamSeq)
	tm := &trackedMsg{Msg: msg, f: f, key: it.key, seq: it.m.StreamSeq}
	it.msg = tm
	if err := f.e.send(ctx, it); err != nil {
		tm.settled() // comes again after the next reset
		return err
	}
	return nil
}

func (f *feed) track(key string) {
	f.mu.Lock()
	f.inflight[key]++
	f.n++
	f.mu.Unlock()
}

func (f *feed) settleOne(key string) {
	f.mu.Lock()
	if f.inflight[key]--; f.inflight[key] <= 0 {
		delete(f.inflight, key)
	}
	f.n--
	f.mu.Unlock()
	select {
	case f.changed <- struct{}{}:
	default:
	}
}

// awaitReturn keeps a naked message counted until it comes back.
func (f *feed) awaitReturn(m *trackedMsg) {
	m.once.Do(func() {
		f.mu.Lock()
		f.returning[m.seq] = m.key
		f.mu.Unlock()
	})
}

// returned settles the earlier delivery of seq, now delivered again.
func (f *feed) returned(seq uint64) {
	f.mu.Lock()
	key, ok := f.returning[seq]
	delete(f.returning, seq)
	f.mu.Unlock()
	if ok {
		f.settleOne(key)
	}
}

// unsettled is the number of deliveries handed out and not settled.
func (f *feed) unsettled() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.n
}

// trackedMsg reports to its feed when the worker settles it.
type trackedMsg struct {
	jetstream.Msg
	f    *feed
	key  string
	seq  uint64
	once sync.Once
}

func (m *trackedMsg) settled() { m.once.Do(func() { m.f.settleOne(m.key) }) }

func (m *trackedMsg) Ack() error {
	defer m.settled()
	return m.Msg.Ack()
}

func (m *trackedMsg) DoubleAck(ctx context.Context) error {
	defer m.settled()
	return m.Msg.DoubleAck(ctx)
}

func (m *trackedMsg) Term() error {
	defer m.settled()
	return m.Msg.Term()
}

func (m *trackedMsg) TermWithReason(reason string) error {
	defer m.settled()
	return m.Msg.TermWithReason(reason)
}

// Nak and NakWithDelay do not settle: the message comes back and is
// tracked again, and the aggregate stays in flight meanwhile. A
// redelivered message is a new trackedMsg, so the count of the naked one
// must go: it is settled when its redelivery is forwarded.
func (m *trackedMsg) Nak() error {
	m.f.awaitReturn(m)
	return m.Msg.Nak()
}

func (m *trackedMsg) NakWithDelay(d time.Duration) error {
	m.f.awaitReturn(m)
	return m.Msg.NakWithDelay(d)
}
