package watermark

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
)

// LSN is a PostgreSQL WAL position.
type LSN = pglogrepl.LSN

// Tracker turns acknowledgements into the confirmable LSN. The pipeline
// opens a Tx per transaction in commit order, adds one pending message per
// published row, and commits it; the publisher settles messages in any
// order. Confirmed only moves forward, and only past a transaction when it
// and all earlier ones are settled.
type Tracker struct {
	mu        sync.Mutex
	txs       []*Tx // open or unsettled transactions, in commit order
	head      int
	confirmed atomic.Uint64
	// lastEnd is the newest committed transaction's end LSN: the WAL from
	// confirmed to it is what a restart would decode and re-send.
	lastEnd LSN
	// advanced is signalled when the watermark moves, for a pipeline that
	// waits for the unsettled tail to shrink.
	advanced chan struct{}
}

// Tx is one transaction's share of the watermark.
type Tx struct {
	t          *Tracker
	pending    int
	committed  bool
	end        LSN
	CommitTime time.Time
}

// NewTracker returns a tracker whose watermark starts at start (the slot's
// confirmed position).
func NewTracker(start LSN) *Tracker {
	t := &Tracker{advanced: make(chan struct{}, 1)}
	t.confirmed.Store(uint64(start))
	return t
}

// Begin opens the next transaction.
func (t *Tracker) Begin(commitTime time.Time) *Tx {
	tx := &Tx{t: t, CommitTime: commitTime}
	t.mu.Lock()
	t.txs = append(t.txs, tx)
	t.mu.Unlock()
	return tx
}

// Add counts one more message of tx waiting for its ack.
func (tx *Tx) Add() {
	tx.t.mu.Lock()
	tx.pending++
	tx.t.mu.Unlock()
}

// Settle marks one message of tx acknowledged or dead-lettered.
func (tx *Tx) Settle() {
	t := tx.t
	t.mu.Lock()
	tx.pending--
	if tx.pending < 0 {
		t.mu.Unlock()
		panic("watermark: Tx settled more messages than it added")
	}
	t.advanceLocked()
	t.mu.Unlock()
}

// Commit records the transaction's end LSN: it is complete once its pending
// messages settle.
func (tx *Tx) Commit(end LSN) {
	t := tx.t
	t.mu.Lock()
	tx.committed = true
	tx.end = end
	t.lastEnd = max(t.lastEnd, end)
	t.advanceLocked()
	t.mu.Unlock()
}

func (t *Tracker) advanceLocked() {
	head := t.head
	defer func() {
		if t.head != head {
			select {
			case t.advanced <- struct{}{}:
			default:
			}
		}
	}()
	for t.head < len(t.txs) {
		tx := t.txs[t.head]
		if !tx.committed || tx.pending > 0 {
			break
		}
		if uint64(tx.end) > t.confirmed.Load() {
			t.confirmed.Store(uint64(tx.end))
		}
		t.txs[t.head] = nil
		t.head++
	}
	// Compact once the settled prefix dominates, so the slice does not grow
	// without bound on a long run.
	if t.head > 1024 && t.head*2 > len(t.txs) {
		n := copy(t.txs, t.txs[t.head:])
		clear(t.txs[n:])
		t.txs = t.txs[:n]
		t.head, head = 0, -1
	}
}

// Unsettled returns the number of transactions begun and not yet confirmed,
// and the WAL bytes from the watermark to the newest committed
// transaction's end. Both grow without limit while one message holds the
// watermark and everything behind it is published: a restart decodes and
// re-sends that WAL, and the slot retains it.
func (t *Tracker) Unsettled() (txs int, walBytes uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if c := LSN(t.confirmed.Load()); t.lastEnd > c {
		walBytes = uint64(t.lastEnd - c)
	}
	return len(t.txs) - t.head, walBytes
}

// WaitingForAcks reports whether the oldest unsettled transaction is
// committed: the watermark then waits for acks, not for the rest of a
// transaction still being read.
func (t *Tracker) WaitingForAcks() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.head < len(t.txs) && t.txs[t.head].committed
}

// Raise moves the watermark up to lsn if it is behind it: the position
// the slot had already confirmed when streaming started, which a tracker
// made before the stream was opened does not know.
func (t *Tracker) Raise(lsn LSN) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if uint64(lsn) > t.confirmed.Load() {
		t.confirmed.Store(uint64(lsn))
	}
}

// Advanced is signalled (capacity one, never closed) when the watermark
// moves past a transaction.
func (t *Tracker) Advanced() <-chan struct{} { return t.advanced }

// Confirmed returns the end LSN of the newest transaction that, with every
// earlier one, is settled.
func (t *Tracker) Confirmed() LSN { return LSN(t.confirmed.Load()) }

// Idle reports that every transaction begun so far is committed and settled.
func (t *Tracker) Idle() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.head == len(t.txs)
}

// Oldest returns the commit time of the oldest unsettled transaction, or the
// zero time when idle: its age is how late the relay is.
func (t *Tracker) Oldest() time.Time {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.head == len(t.txs) {
		return time.Time{}
	}
	return t.txs[t.head].CommitTime
}
