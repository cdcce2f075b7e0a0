package group

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
)

// partition is one partition durable this member pulls from, from the
// moment the assignment gives it to this member until its hand-off is
// done. Its goroutine (run) is owned by the group runner.
//
// It pulls through a Feed of the host (consumer/feed.go), which opens with a reset of the
// durable to its ack floor: whatever the previous owner received and did
// not settle, and whatever JetStream had queued for redelivery in whatever
// order its timers expired, is delivered again in stream order, ahead of
// everything newer. The order of a takeover therefore follows from the
// reset, not from the previous owner's timers having run out. A previous
// owner that is still applying (paused, then resumed) applies its own
// deliveries in stream order too, and the dedup row's unique key makes the
// two meet in order: an insert of the same event waits for the other's
// transaction and then finds the event applied (docs/consumer.md "Order
// across rebalances").
type partition struct {
	g          *Member
	partitions int
	p          int
	durable    string
	cons       jetstream.Consumer
	f          Feed
	handoff    chan struct{} // closed to ask for a hand-off
	done       chan struct{} // closed when run has returned
	once       sync.Once
	// until is the last stream sequence of the partition that may be
	// handed on (generation.until), set by the coordinator loop at every
	// step and read by admit at every delivery; raised receives (without
	// blocking) when it goes up.
	until  atomic.Uint64
	raised chan struct{}
	past   uint64 // the delivery admit refused last; run's
}

func newPartition(g *Member, partitions, p int, cons jetstream.Consumer, until uint64) *partition {
	cfg := &g.cfg
	name := PartitionDurable(cfg.Name, partitions, p)
	pt := &partition{
		g: g, partitions: partitions, p: p, cons: cons, durable: name,
		handoff: make(chan struct{}),
		done:    make(chan struct{}),
		raised:  make(chan struct{}, 1),
	}
	pt.until.Store(until)
	pt.f = g.host.Feed(cons, name, pt.admit, jetstream.PullPriorityGroup(PriorityGroup(cfg.Name)),
		jetstream.PullMaxMessages(pullBatch(cfg.MaxAckPending, partitions)), jetstream.PullExpiry(PullExpiry))
	return pt
}

// errPastFence ends a partition's pump at a delivery stored after the
// stream's partition count went back to the partition's (generation.until).
var errPastFence = errors.New("delivery stored after a newer partition count began")

// admit refuses a delivery stored after the partition's fence: one of an
// older generation stored since the count went back to it, which must not
// go ahead of the newer generation's events (activeGeneration refuses the
// change back).
func (pt *partition) admit(seq uint64) error {
	if until := pt.until.Load(); seq > until {
		pt.past = seq
		return fmt.Errorf("%w: %s delivered stream sequence %d, beyond %d", errPastFence, pt.durable, seq, until)
	}
	return nil
}

// bound lowers the partition's fence to until.
func (pt *partition) bound(until uint64) {
	for {
		cur := pt.until.Load()
		if until >= cur || pt.until.CompareAndSwap(cur, until) {
			return
		}
	}
}

// setUntil sets the partition's fence (the coordinator's step).
func (pt *partition) setUntil(until uint64) {
	if pt.until.Swap(until) < until {
		select {
		case pt.raised <- struct{}{}:
		default:
		}
	}
}

// fenced waits, consuming nothing, after admit refused a delivery: until
// the hand-off is asked for (errHandedOff), the fence is raised past the
// delivery (nil: the newer generation is gone, pull on in order from the
// ack floor), or ctx ends.
func (pt *partition) fenced(ctx context.Context, log *zap.Logger, err error) error {
	log.Warn("the stream's partition count went back to this generation's while it drained: consuming none of it until the newer generation is gone", zap.Error(err))
	pt.f.Stop()
	for pt.until.Load() < pt.past {
		select {
		case <-pt.handoff:
			return errHandedOff
		case <-pt.raised:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// pullBatch is how many deliveries a partition's pull requests and buffers
// at most: the partitions' buffers together hold MaxAckPending at most,
// whatever the member owns, beside the MaxAckPending its workers may hold
// (the host's budget).
func pullBatch(maxAckPending, partitions int) int {
	return min(max(1, maxAckPending/partitions), 256)
}

// release asks for a hand-off; run returns once it is done.
func (pt *partition) release() { pt.once.Do(func() { close(pt.handoff) }) }

// run pulls the partition until ctx ends or a hand-off was asked for and
// is complete. ctx outlives the group's context (the workers do too), so a
// hand-off at shutdown still settles what is in flight.
func (pt *partition) run(ctx context.Context) error {
	defer close(pt.done)
	defer pt.f.Close()
	log := pt.g.log.With(zap.String("durable", pt.durable))
	pt.unpin(ctx, log)
	err := pt.pump(ctx)
	for errors.Is(err, errPastFence) {
		// The coordinator's next step refuses the change back and asks for
		// the hand-off, or finds the newer generation gone.
		if err = pt.fenced(ctx, log, err); err == nil {
			err = pt.pump(ctx)
		}
	}
	switch {
	case errors.Is(err, errHandedOff):
		pt.handOff(ctx, log)
		return nil
	case isGone(err):
		// The generation was drained and removed by a member.
		log.Info("partition durable removed; stopping it")
		return nil
	}
	return err
}

// unpin takes the pin from whichever member held the partition before: it
// is dead, or has been told to hand off (the roster moved the partition),
// and the reset makes what it held come again in order. Without the unpin
// a dead member's pin would hold the partition for PinnedTTL.
func (pt *partition) unpin(ctx context.Context, log *zap.Logger) {
	uctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := pt.g.strm.UnpinConsumer(uctx, pt.durable, PriorityGroup(pt.g.cfg.Name)); err != nil && !isGone(err) {
		log.Debug("unpin the previous owner failed; its pin expires after PinnedTTL", zap.Error(err))
	}
}

// HookHandOffUnpin, set by tests, runs between the hand-off's consumer info
// read and its unpin, with the member, the partition durable and the pin id
// of the member's last delivery.
var HookHandOffUnpin func(member, durable, pin string)

var errHandedOff = errors.New("partition handed off")

// pump hands messages to the workers until a hand-off is asked for.
func (pt *partition) pump(ctx context.Context) error {
	hctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { // ends with pump: cancel above
		select {
		case <-pt.handoff:
			cancel()
		case <-hctx.Done():
		}
	}()
	err := pt.f.Pump(hctx)
	if ctx.Err() == nil && isClosed(pt.handoff) {
		return errHandedOff
	}
	return err
}

// handOff settles the partition before it moves: the subscription is
// closed (what it buffered comes to the next owner after its reset), the
// workers settle what they were handed, except messages held behind one
// naked for a retry (the next owner gets them all again, in order), and the
// pin is released. The next owner does not depend on any of it for order;
// waiting spares it duplicates and keeps the two members from working on
// one partition at once. DrainTimeout bounds the wait.
func (pt *partition) handOff(ctx context.Context, log *zap.Logger) {
	cfg := &pt.g.cfg
	start := time.Now()
	pt.f.Stop()
	dctx, cancel := context.WithTimeout(ctx, cfg.DrainTimeout)
	err := pt.f.Settle(dctx)
	cancel()
	if err != nil && ctx.Err() == nil {
		log.Warn("hand-off timed out with messages in flight; the next owner's reset and the dedup row keep their order",
			zap.Int("unsettled", pt.f.Unsettled()), zap.Duration("drain_timeout", cfg.DrainTimeout))
	}
	// Unpin unless the next owner already holds the pin (it unpins its
	// predecessor itself): taking its pin would only make it pull again.
	ictx, icancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	info, err := pt.cons.Info(ictx)
	icancel()
	if HookHandOffUnpin != nil {
		HookHandOffUnpin(pt.g.cfg.Member, pt.durable, pt.f.Pin())
	}
	if err != nil || pt.f.Pin() == "" || pinnedTo(info, pt.f.Pin()) {
		pt.unpin(context.WithoutCancel(ctx), log)
	}
	log.Info("partition handed off", zap.Duration("took", time.Since(start)))
}

// pinnedTo reports whether the consumer is pinned to the client with pin id.
func pinnedTo(info *jetstream.ConsumerInfo, pin string) bool {
	for _, pg := range info.PriorityGroups {
		if pg.PinnedClientID == pin {
			return true
		}
	}
	return false
}

func isClosed(ch chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}
