package consumer

import (
	"context"
	"errors"
	"sync"
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
// messages of its aggregate must wait for it. A hand-off keeps the
// partition pinned, and keeps pulling, until nothing is unsettled: messages
// of an aggregate with unsettled messages still go to the workers, others
// are given back (Nak) to be delivered first to the next owner.
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
// is complete. ctx is the group's; the workers outlive it, so a hand-off
// at shutdown still settles what is in flight.
func (pt *partition) run(ctx context.Context) error {
	defer close(pt.done)
	log := pt.g.c.log.With(zap.String("durable", pt.durable))
	c := pt.g.c
	batch := max(1, min(c.cfg.MaxAckPending, 256))
	for {
		iter, err := pt.cons.Messages(jetstream.PullPriorityGroup(c.cfg.Name), jetstream.PullMaxMessages(batch),
			jetstream.PullExpiry(groupPullExpiry))
		if err == nil {
			err = pt.pump(ctx, iter)
			if errors.Is(err, errHandedOff) {
				return pt.finish(iter, log)
			}
			iter.Stop()
		}
		if errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound) {
			// The generation was drained and removed by a member.
			log.Info("partition durable removed; stopping it")
			return nil
		}
		if errors.Is(err, jetstream.ErrConnectionClosed) {
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

var errHandedOff = errors.New("partition handed off")

// pump hands messages to the workers. After a hand-off request it keeps
// pulling only to let unsettled messages come back; see partition.
func (pt *partition) pump(ctx context.Context, iter jetstream.MessagesContext) error {
	c := pt.g.c
	hctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { // ends with pump: cancel above
		select {
		case <-pt.handoff:
			cancel()
		case <-hctx.Done():
		}
	}()
	var deadline time.Time
	for {
		draining := deadline != time.Time{}
		var msg jetstream.Msg
		var err error
		if !draining {
			msg, err = iter.Next(jetstream.NextContext(hctx))
			if err != nil && hctx.Err() != nil && isClosed(pt.handoff) {
				deadline = time.Now().Add(c.cfg.Group.DrainTimeout)
				continue
			}
		} else {
			if _, n := pt.unsettled(""); n == 0 || time.Now().After(deadline) {
				return errHandedOff
			}
			msg, err = iter.Next(jetstream.NextMaxWait(200 * time.Millisecond))
			if errors.Is(err, nats.ErrTimeout) {
				continue
			}
		}
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return err
		}
		it := c.newItem(msg)
		if draining {
			if k, _ := pt.unsettled(it.key); k == 0 {
				_ = msg.Nak() // first to the next owner
				continue
			}
		}
		pt.track(it.key)
		pt.returned(it.m.StreamSeq)
		it.msg = &trackedMsg{Msg: msg, pt: pt, key: it.key, seq: it.m.StreamSeq}
		w := c.workers[c.workerIndex(it.key)]
		select {
		case w.in <- it:
		case <-ctx.Done():
			it.msg.(*trackedMsg).Msg.Nak() //nolint:errcheck // shutdown: redelivered anyway
			pt.settle(it.key)
			return ctx.Err()
		}
	}
}

// finish ends a hand-off: the messages still buffered go back first, then
// the pin is released so that the next owner need not wait for PinnedTTL.
func (pt *partition) finish(iter jetstream.MessagesContext, log *zap.Logger) error {
	c := pt.g.c
	if _, n := pt.unsettled(""); n > 0 {
		log.Warn("hand-off timed out with messages in flight; the database guards their order (VersionCheck) and dedup",
			zap.Int("unsettled", n), zap.Duration("drain_timeout", c.cfg.Group.DrainTimeout))
	}
	iter.Drain()
	for {
		msg, err := iter.Next(jetstream.NextMaxWait(200 * time.Millisecond))
		if err != nil {
			break
		}
		_ = msg.Nak()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	// Make sure the naks reached the server before the pin moves.
	if err := c.js.Conn().FlushWithContext(ctx); err != nil {
		log.Warn("flush before unpin failed; the pin expires by itself after PinnedTTL", zap.Error(err))
		return nil
	}
	if err := pt.g.strm.UnpinConsumer(ctx, pt.durable, c.cfg.Name); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		log.Debug("unpin failed; the pin expires by itself after PinnedTTL", zap.Error(err))
	}
	log.Info("partition handed off")
	return nil
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
