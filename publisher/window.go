package publisher

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// window is the capacity unsettled messages hold, shared by Publisher and
// Batch: a count and a byte size bound, the signal that wakes a refused
// producer, and the reason the publisher closed. It is the one piece of a
// publisher that producers and the publisher's Run goroutine both touch,
// so it has a lock of its own and nothing else is under it. Admission also
// bounds the hand-over channel to Run: it never holds more messages than
// the window admits.
type window struct {
	mu       sync.Mutex
	count    int // messages holding window capacity
	bytes    int
	maxCount int
	maxBytes int
	closed   error
	// done is closed with the first close, so that Run stops.
	done chan struct{}
	// space is signalled when a refused producer may succeed: once the
	// window has drained to its low-water mark (lowCount, lowBytes), not
	// on every ack. A full window then costs the waiting producer one
	// wake-up per quarter window instead of one per message.
	space    chan struct{}
	waiting  bool // a producer was refused since the last signal
	lowCount int
	lowBytes int
}

func newWindow(cfg Config) window {
	return window{
		maxCount: cfg.MaxInFlight,
		maxBytes: cfg.MaxInFlightBytes,
		done:     make(chan struct{}),
		space:    make(chan struct{}, 1),
		lowCount: cfg.MaxInFlight - (cfg.MaxInFlight+3)/4,
		lowBytes: cfg.MaxInFlightBytes - (cfg.MaxInFlightBytes+3)/4,
	}
}

// admit takes capacity for a message of size bytes. It refuses with the
// reason once the publisher closed, and without one when the window is
// full, remembering that a producer waits. A single message larger than the
// byte bound is admitted alone.
func (w *window) admit(size int) (bool, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed != nil {
		return false, w.closed
	}
	if w.count > 0 && (w.count+1 > w.maxCount || w.bytes+size > w.maxBytes) {
		w.waiting = true
		return false, nil
	}
	w.count++
	w.bytes += size
	return true, nil
}

// release frees a settled message's capacity and signals a waiting
// producer at the low-water mark.
func (w *window) release(size int) {
	w.mu.Lock()
	w.count--
	w.bytes -= size
	wake := w.waiting && (w.count == 0 || w.count <= w.lowCount && w.bytes <= w.lowBytes)
	if wake {
		w.waiting = false
	}
	w.mu.Unlock()
	if wake {
		w.signal()
	}
}

func (w *window) signal() {
	select {
	case w.space <- struct{}{}:
	default:
	}
}

// Space is signalled after a refused TryPublish once the window has drained
// to three quarters of its limits (or is empty), and when the publisher
// closes. A signal is a hint: TryPublish again. It wakes one waiter: a
// producer sharing the publisher with others must also try again on a timer
// (Publish does), or a signal another producer took could leave it waiting.
func (w *window) Space() <-chan struct{} { return w.space }

// InFlight returns the number of messages holding window capacity.
func (w *window) InFlight() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.count
}

// close records why the publisher stopped (the first reason wins), stops
// Run and wakes a waiting producer to see it.
func (w *window) close(err error) {
	w.mu.Lock()
	if w.closed == nil {
		w.closed = err
		close(w.done)
	}
	w.mu.Unlock()
	w.signal()
}

// closedErr returns the reason the publisher closed, or nil.
func (w *window) closedErr() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.closed
}

// stopErr is what Run returns when ctx ended or the publisher closed: the
// reason it closed, or ctx's error.
func (w *window) stopErr(ctx context.Context) error {
	if err := w.closedErr(); err != nil {
		return err
	}
	return ctx.Err()
}

// tickEvery is the least time between two of Run's looks for ack timeouts
// and due retries: a deadline is acted on at most that late.
const tickEvery = 20 * time.Millisecond

// checkTimer wakes a Run loop when its earliest deadline is due, and not at
// all while it has none: a ticker woke an idle relay 50 times a second per
// publisher, and a loaded one as often for nothing. Run owns it.
type checkTimer struct {
	t     *time.Timer
	at    time.Time // when the armed timer fires
	armed bool
}

func newCheckTimer() *checkTimer {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return &checkTimer{t: t}
}

// C is the timer's channel; after a receive, call fired.
func (c *checkTimer) C() <-chan time.Time { return c.t.C }

func (c *checkTimer) fired() { c.armed = false }

// arm makes the timer fire by at (zero: no deadline), never sooner than
// tickEvery from now. An armed timer that fires sooner is kept: the look
// it causes finds nothing due and arms the timer again.
func (c *checkTimer) arm(at time.Time) {
	if at.IsZero() || (c.armed && !at.Before(c.at)) {
		return
	}
	now := time.Now()
	if floor := now.Add(tickEvery); at.Before(floor) {
		at = floor
	}
	if c.armed && !at.Before(c.at) {
		return
	}
	c.at, c.armed = at, true
	c.t.Reset(at.Sub(now))
}

func (c *checkTimer) stop() { c.t.Stop() }

// compactFront drops s[:head], a consumed front whose entries the caller
// has already cleared: an empty slice is reset, and a front of more than
// 1024 entries and half the slice is copied over, so a queue consumed from
// the front reuses its array instead of growing.
func compactFront[T any](s []T, head int) ([]T, int) {
	if head == len(s) {
		return s[:0], 0
	}
	if head > 1024 && head*2 > len(s) {
		n := copy(s, s[head:])
		clear(s[n:])
		return s[:n], 0
	}
	return s, head
}

// Drain waits until every message handed over is settled or ctx ends.
func (w *window) Drain(ctx context.Context) error {
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for {
		w.mu.Lock()
		n, closed := w.count, w.closed
		w.mu.Unlock()
		if n == 0 {
			return nil
		}
		if closed != nil {
			return closed
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("drain with %d messages unacknowledged: %w", n, ctx.Err())
		case <-t.C:
		}
	}
}

// admitted is a message handed to Run with the capacity it holds.
type admitted struct {
	m     *Message
	size  int
	first time.Time // when it was handed over, for the publish latency
}

// stuckQuery asks Run for the oldest unsettled message.
type stuckQuery chan stuckAnswer

type stuckAnswer struct {
	s  Stuck
	ok bool
}

// askOldest asks Run, through q, for its oldest unsettled message; it
// reports none once Run has returned (stopped closed).
func askOldest(q chan stuckQuery, stopped <-chan struct{}) (Stuck, bool) {
	ans := make(stuckQuery, 1)
	select {
	case q <- ans:
	case <-stopped:
		return Stuck{}, false
	}
	a := <-ans
	return a.s, a.ok
}
