package consumer

import (
	"context"
	"sync"
	"time"
)

// budget is a group member's MaxAckPending, shared by the feeds of the
// partitions it owns: a feed hands a new delivery to the workers only with
// a slot of it, and the slot comes back when the delivery is settled. So
// the member holds at most MaxAckPending deliveries in its workers however
// many partitions it owns, while a single busy partition may use all of
// them (each partition durable's max_ack_pending is the whole budget).
//
// Each slot has one owner, the feed that took it, which counts it in its
// unsettled deliveries (feed.n): a slot is taken where a delivery is
// tracked and given back where it is settled. A delivery naked for a retry
// keeps its slot until it is delivered again, and the redelivery takes it
// over (feed.forward): were it to ask for a new one, a budget full of
// messages held behind retried ones would never see the retries back.
//
// That leaves one way to wait forever: every slot held by a delivery that
// waits for a retried message, the retry's redelivery behind a new
// delivery in a feed's pull buffer, and that feed waiting for a slot. A
// feed that has waited checks for it (every budgetCheck) and then goes
// over the budget, one delivery at a time while the state lasts. It takes
// more messages held behind failing ones than MaxAckPending to get there.
type budget struct {
	limit int

	mu      sync.Mutex
	used    int                // slots taken, over limit only while stuck
	waiters int                // feeds waiting for a slot
	wake    chan struct{}      // closed (and replaced) when a slot comes back to waiters
	feeds   map[*feed]struct{} // the feeds sharing it, for stuck
}

// budgetCheck is how often a feed that waits for a slot checks whether
// the budget is stuck.
const budgetCheck = 200 * time.Millisecond

func newBudget(limit int) *budget {
	return &budget{limit: max(limit, 1), wake: make(chan struct{}), feeds: map[*feed]struct{}{}}
}

// join and leave register f as a feed sharing the budget.
func (b *budget) join(f *feed) {
	b.mu.Lock()
	b.feeds[f] = struct{}{}
	b.mu.Unlock()
}

func (b *budget) leave(f *feed) {
	b.mu.Lock()
	delete(b.feeds, f)
	b.mu.Unlock()
}

// take takes a slot, waiting while the budget is full unless it is stuck.
// A nil budget (a plain durable: its max_ack_pending bounds it) has room.
func (b *budget) take(ctx context.Context) error {
	if b == nil {
		return nil
	}
	wake := b.room(1)
	if wake == nil {
		return nil
	}
	defer b.room(-1)
	tick := time.NewTicker(budgetCheck)
	defer tick.Stop()
	for ; wake != nil; wake = b.room(0) {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-wake:
		case <-tick.C:
			if b.stuck() {
				b.mu.Lock()
				b.used++
				b.mu.Unlock()
				return nil
			}
		}
	}
	return nil
}

// room takes a slot if there is one and returns nil, or else the channel
// closed when a slot comes back to waiters. The caller's wait begins with
// waiting 1 (it counts as a waiter if it must wait) and ends with -1.
func (b *budget) room(waiting int) chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case waiting < 0:
		b.waiters--
		return nil
	case b.used < b.limit:
		b.used++
		return nil
	}
	b.waiters += waiting
	return b.wake
}

// give gives n slots back.
func (b *budget) give(n int) {
	if b == nil || n <= 0 {
		return
	}
	b.mu.Lock()
	b.used -= n
	if b.waiters > 0 {
		close(b.wake)
		b.wake = make(chan struct{})
	}
	b.mu.Unlock()
}

// forget gives back the slot of a message naked for a retry that will not
// come back: it left the stream, or was settled elsewhere (worker.heartbeat
// releases its aggregate then). Its feed would keep the slot for the
// redelivery until it closes, one slot less for every such message.
func (b *budget) forget(seq uint64) {
	if b == nil {
		return
	}
	for _, f := range b.members() {
		if f.returned(seq) { // the slot would have passed to the redelivery
			b.give(1)
		}
	}
}

// inUse is the number of slots taken.
func (b *budget) inUse() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.used
}

// stuck reports whether no slot can come back but with a retried
// message's redelivery: every delivery handed out waits for one.
func (b *budget) stuck() bool {
	for _, f := range b.members() {
		if f.busy() > 0 {
			return false
		}
	}
	return true
}

// members returns the feeds sharing the budget, for a caller to visit
// without b.mu: f.mu is never held while b.mu is.
func (b *budget) members() []*feed {
	b.mu.Lock()
	defer b.mu.Unlock()
	feeds := make([]*feed, 0, len(b.feeds))
	for f := range b.feeds {
		feeds = append(feeds, f)
	}
	return feeds
}
