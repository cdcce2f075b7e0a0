package consumer

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
)

// partition is one partition durable this member pulls from, from the
// moment the assignment gives it to this member until its hand-off is
// done. Its goroutine (run) is owned by the group runner.
//
// It counts the messages it handed to the workers and that are not settled
// yet, per aggregate. A message is settled when it is acknowledged or
// terminated; a nak (with or without delay) does not settle it, because
// the message comes back to the partition's pinned member and the later
// messages of its aggregate must wait for it. See handOff.
type partition struct {
	g          *group
	partitions int
	p          int
	durable    string
	cons       jetstream.Consumer
	handoff    chan struct{} // closed to ask for a hand-off
	done       chan struct{} // closed when run has returned
	once       sync.Once

	mu       sync.Mutex
	inflight map[string]int // aggregate key -> unsettled messages
	n        int            // total unsettled
	// returning holds the stream sequences naked back to the broker, still
	// counted in inflight until they are delivered again.
	returning map[uint64]string
	changed   chan struct{} // receives (non-blocking) on each settle
	lastSeen  atomic.Uint64 // highest consumer sequence received here
	started   bool          // the first delivery was seen (takeOver done); run's goroutine only
}

func newPartition(g *group, partitions, p int, cons jetstream.Consumer) *partition {
	return &partition{
		g: g, partitions: partitions, p: p, cons: cons,
		durable:   PartitionDurable(g.c.cfg.Name, partitions, p),
		handoff:   make(chan struct{}),
		done:      make(chan struct{}),
		inflight:  map[string]int{},
		returning: map[uint64]string{},
		changed:   make(chan struct{}, 1),
	}
}

// release asks for a hand-off; run returns once it is done.
func (pt *partition) release() { pt.once.Do(func() { close(pt.handoff) }) }

func (pt *partition) track(key string) {
	pt.mu.Lock()
	pt.inflight[key]++
	pt.n++
	pt.mu.Unlock()
}

func (pt *partition) settle(key string) {
	pt.mu.Lock()
	if pt.inflight[key]--; pt.inflight[key] <= 0 {
		delete(pt.inflight, key)
	}
	pt.n--
	pt.mu.Unlock()
	select {
	case pt.changed <- struct{}{}:
	default:
	}
}

// awaitReturn keeps a naked message counted until it comes back.
func (pt *partition) awaitReturn(m *trackedMsg) {
	m.once.Do(func() {
		pt.mu.Lock()
		pt.returning[m.seq] = m.key
		pt.mu.Unlock()
	})
}

// returned settles the earlier delivery of seq, now delivered again.
func (pt *partition) returned(seq uint64) {
	pt.mu.Lock()
	key, ok := pt.returning[seq]
	delete(pt.returning, seq)
	pt.mu.Unlock()
	if ok {
		pt.settle(key)
	}
}

func (pt *partition) unsettled(key string) (aggregate, total int) {
	pt.mu.Lock()
	defer pt.mu.Unlock()
	return pt.inflight[key], pt.n
}

// run pulls the partition until ctx ends or a hand-off was asked for and
// is complete. ctx outlives the group's context (the workers do too), so a
// hand-off at shutdown still settles what is in flight.
func (pt *partition) run(ctx context.Context) error {
	defer close(pt.done)
	log := pt.g.c.log.With(zap.String("durable", pt.durable))
	for {
		iter, err := pt.pull()
		if err == nil {
			err = pt.pump(ctx, iter)
			if errors.Is(err, errHandedOff) {
				return pt.handOff(ctx, iter, log)
			}
			// Buffered messages are dropped: they come back after AckWait.
			iter.Stop()
		}
		if errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound) {
			// The generation was drained and removed by a member.
			log.Info("partition durable removed; stopping it")
			return nil
		}
		if errors.Is(err, jetstream.ErrConnectionClosed) || ctx.Err() != nil {
			return err
		}
		log.Warn("partition pull ended; pulling again", zap.Error(err))
		select {
		case <-pt.handoff:
			return nil // nothing in flight can need this subscription
		case <-time.After(time.Second):
		}
	}
}

func (pt *partition) pull() (jetstream.MessagesContext, error) {
	c := pt.g.c
	return pt.cons.Messages(jetstream.PullPriorityGroup(priorityGroup(c.cfg.Name)), jetstream.PullMaxMessages(max(1, min(c.cfg.MaxAckPending, 256))),
		jetstream.PullExpiry(groupPullExpiry))
}

var errHandedOff = errors.New("partition handed off")

// pump hands messages to the workers until a hand-off is asked for.
func (pt *partition) pump(ctx context.Context, iter jetstream.MessagesContext) error {
	hctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { // ends with pump: cancel above
		select {
		case <-pt.handoff:
			cancel()
		case <-hctx.Done():
		}
	}()
	first := !pt.started
	pt.started = true
	for {
		msg, err := iter.Next(jetstream.NextContext(hctx))
		if err != nil {
			if ctx.Err() == nil && isClosed(pt.handoff) {
				return errHandedOff
			}
			return err
		}
		if first {
			first = false
			if err := pt.takeOver(ctx, iter, msg); err != nil {
				return err
			}
			continue
		}
		if err := pt.forward(ctx, msg); err != nil {
			return err
		}
	}
}

// takeOver handles the first deliveries after this member became the
// partition's owner. The messages the previous owner received and never
// settled (all of them, after a crash) come first, as redeliveries, but in
// the order their ack waits expired, which progress acks of queued
// messages make differ from stream order. They are all earlier in the
// stream than any message not delivered yet, so collecting as many
// messages as were unacknowledged when the first arrived, and handing
// them to the workers sorted by stream sequence, restores each
// aggregate's order. The window is bounded by max_ack_pending.
func (pt *partition) takeOver(ctx context.Context, iter jetstream.MessagesContext, msg jetstream.Msg) error {
	ictx, cancel := context.WithTimeout(ctx, 5*time.Second)
	info, err := pt.cons.Info(ictx)
	cancel()
	want := 1
	if err == nil {
		want = max(1, info.NumAckPending)
	}
	window := []jetstream.Msg{msg}
	for len(window) < want {
		m, err := iter.Next(jetstream.NextMaxWait(time.Second))
		if err != nil {
			break // a timeout or a hand-off: what is here goes in order
		}
		window = append(window, m)
	}
	if len(window) > 1 {
		pt.g.c.log.Debug("ordering the redeliveries of a partition taken over", zap.String("durable", pt.durable), zap.Int("messages", len(window)))
	}
	seqOf := func(m jetstream.Msg) uint64 {
		if md, err := m.Metadata(); err == nil {
			return md.Sequence.Stream
		}
		return 0
	}
	slices.SortStableFunc(window, func(a, b jetstream.Msg) int { return cmp.Compare(seqOf(a), seqOf(b)) })
	for _, m := range window {
		if err := pt.forward(ctx, m); err != nil {
			return err
		}
	}
	return nil
}

// forward hands one message to the worker of its aggregate, tracked.
func (pt *partition) forward(ctx context.Context, msg jetstream.Msg) error {
	c := pt.g.c
	pt.seen(msg)
	it := c.newItem(msg)
	pt.track(it.key)
	pt.returned(it.m.StreamSeq)
	tm := &trackedMsg{Msg: msg, pt: pt, key: it.key, seq: it.m.StreamSeq}
	it.msg = tm
	select {
	case c.workers[c.workerIndex(it.key)].in <- it:
		return nil
	case <-ctx.Done():
		_ = msg.Nak() // shutdown: redelivered anyway
		tm.settled()
		return ctx.Err()
	}
}

// handOff settles the partition before it moves. Nothing is given back
// with a nak, whose redelivery order JetStream does not promise: the
// subscription is drained and everything it still held goes to the
// workers as usual. If a worker naked a message (a failure being
// retried), the partition is pulled again until that message is back and
// settled, again handing whatever arrives to the workers. Then, unless
// the durable's last delivery is one received here, a message may be in
// transit, lost with the subscription: the pin is kept until AckWait has
// passed, when such a message is queued for redelivery ahead of newer
// ones. Finally the pin is released, so the next owner need not wait for
// PinnedTTL. DrainTimeout bounds the whole.
func (pt *partition) handOff(ctx context.Context, iter jetstream.MessagesContext, log *zap.Logger) error {
	c := pt.g.c
	start := time.Now()
	deadline := start.Add(c.cfg.Group.DrainTimeout)
	stopped := start
	for {
		iter.Drain()
		for {
			msg, err := iter.Next(jetstream.NextMaxWait(time.Second))
			if errors.Is(err, nats.ErrTimeout) && time.Now().Before(deadline) {
				continue
			}
			if err != nil {
				break
			}
			if err := pt.forward(ctx, msg); err != nil {
				return err
			}
		}
		stopped = time.Now()
		// Wait for the workers, unless something naked must come back.
		for {
			_, n := pt.unsettled("")
			if n == 0 || pt.awaiting() || time.Now().After(deadline) {
				break
			}
			select {
			case <-pt.changed:
			case <-time.After(200 * time.Millisecond):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		if _, n := pt.unsettled(""); n == 0 || time.Now().After(deadline) {
			if n > 0 {
				log.Warn("hand-off timed out with messages in flight; the database guards their order (VersionCheck) and dedup",
					zap.Int("unsettled", n), zap.Duration("drain_timeout", c.cfg.Group.DrainTimeout))
			}
			break
		}
		var err error
		if iter, err = pt.pull(); err != nil {
			log.Warn("pull again during hand-off", zap.Error(err))
			break
		}
		for pt.awaiting() && time.Now().Before(deadline) {
			msg, err := iter.Next(jetstream.NextMaxWait(200 * time.Millisecond))
			if errors.Is(err, nats.ErrTimeout) {
				continue
			}
			if err != nil {
				break
			}
			if err := pt.forward(ctx, msg); err != nil {
				return err
			}
		}
	}
	fctx, cancel := context.WithTimeout(ctx, c.cfg.AckWait+10*time.Second)
	defer cancel()
	if err := c.js.Conn().FlushWithContext(fctx); err != nil {
		log.Warn("flush before unpin failed; the pin expires by itself after PinnedTTL", zap.Error(err))
		return nil
	}
	info, err := pt.cons.Info(fctx)
	if err != nil || info.Delivered.Consumer > pt.lastSeen.Load() {
		wait := time.Until(stopped.Add(c.cfg.AckWait + time.Second))
		log.Debug("a delivery may be in transit; keeping the pin until it is due for redelivery", zap.Duration("wait", wait))
		select {
		case <-fctx.Done():
		case <-time.After(wait):
		}
	}
	if err := pt.g.strm.UnpinConsumer(fctx, pt.durable, priorityGroup(c.cfg.Name)); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		log.Debug("unpin failed; the pin expires by itself after PinnedTTL", zap.Error(err))
	}
	log.Info("partition handed off", zap.Duration("took", time.Since(start)))
	return nil
}

// awaiting reports naked messages not yet back.
func (pt *partition) awaiting() bool {
	pt.mu.Lock()
	defer pt.mu.Unlock()
	return len(pt.returning) > 0
}

// seen records the consumer sequence of a delivery received here.
func (pt *partition) seen(msg jetstream.Msg) {
	if md, err := msg.Metadata(); err == nil {
		for {
			cur := pt.lastSeen.Load()
			if md.Sequence.Consumer <= cur || pt.lastSeen.CompareAndSwap(cur, md.Sequence.Consumer) {
				return
			}
		}
	}
}

func isClosed(ch chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// trackedMsg reports to its partition when the worker settles it.
type trackedMsg struct {
	jetstream.Msg
	pt   *partition
	key  string
	seq  uint64
	once sync.Once
}

func (m *trackedMsg) settled() { m.once.Do(func() { m.pt.settle(m.key) }) }

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

// Nak and NakWithDelay do not settle: the message comes back to this
// partition and is tracked again, but the aggregate stays in flight
// meanwhile. A redelivered message is a new trackedMsg, so the count of
// the naked one must go: it is settled when its redelivery is tracked.
func (m *trackedMsg) Nak() error {
	m.pt.awaitReturn(m)
	return m.Msg.Nak()
}

func (m *trackedMsg) NakWithDelay(d time.Duration) error {
	m.pt.awaitReturn(m)
	return m.Msg.NakWithDelay(d)
}
