package consumer

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"
)

// worker applies the messages of the aggregates hashed to it, one at a time
// and in arrival order, except that a message waiting for a retry holds back
// only the later messages of its own aggregate, and that its redelivery goes
// first (enqueue).
//
// Everything here is owned by the worker's goroutine: the queue it drains
// its channel into (so it can keep queued messages alive with progress
// acks), the blocked aggregates, and the per-message retry state. All of it
// is bounded by the durable consumer's MaxAckPending, because every entry is
// a delivered, unacknowledged message.
type worker struct {
	c       *Consumer
	src     source // asked whether a retried message is gone
	id      int
	in      chan *item
	queue   []*item
	blocked map[string]*block
	fails   map[uint64]*failState // by stream sequence
	gaps    map[uint64]*gapState  // by stream sequence
	solo    int                   // take this many messages one at a time (a batch fell back)
	// size is how many messages the next batch may hold: BatchSize, less
	// after a batch overran its deadline (adapt).
	size     int
	tookSolo bool // the messages in flight were taken one at a time after a fallback
	// inflight is the message or batch the processor has, nil while
	// idle; a retried message among it counts as back (queued).
	inflight []*item
	// answers brings back the heartbeat's look-up of overdue blocks'
	// heads (lookUp), which runs on a goroutine of its own; asking is set
	// while one is out.
	answers chan goneAnswer
	asking  bool
}

// head is what a look-up needs of an overdue block: its retried message's
// stream sequence, event id and content hash, copied, since the worker may
// change the block meanwhile.
type head struct {
	seq  uint64
	id   string
	hash []byte
}

// goneAnswer is a look-up's answer: which of the heads asked about need no
// more processing here.
type goneAnswer struct {
	asked []head
	gone  map[uint64]bool
}

// block holds back an aggregate's messages while one of them (head) waits
// for its redelivery after a failure.
type block struct {
	head    uint64    // stream sequence of the failed message
	id      string    // its event id and content hash: its dedup row tells
	hash    []byte    // whether another process applied it (worker.gone)
	version int64     // its aggregate version: a gap it would fill waits for its retries (settle)
	retryAt time.Time // when the broker redelivers head (its nak delay ends)
	until   time.Time // ask JetStream whether head is gone after this
	held    []*item   // later messages of the aggregate, in arrival order
	waiting bool      // the overdue head was reported once
}

// failState counts failed attempts of one message. Each class counts
// against its own limit: transient failures through an outage must not use
// up the attempts an unclassified error is allowed afterwards.
type failState struct {
	attempts    int           // all failed attempts: the backoff step, the record's attempts
	byClass     map[Class]int // failed attempts per class, against the class's limit
	first, last time.Time
}

// gapState tracks how long one message has waited for a version gap.
type gapState struct {
	since     time.Time
	deferrals int
}

func newWorker(c *Consumer, src source, id int) *worker {
	return &worker{
		c:       c,
		src:     src,
		id:      id,
		in:      make(chan *item, 64),
		blocked: map[string]*block{},
		fails:   map[uint64]*failState{},
		gaps:    map[uint64]*gapState{},
		size:    c.cfg.BatchSize,
		answers: make(chan goneAnswer, 1),
	}
}

// run applies the worker's messages until ctx is cancelled, then waits for
// the message in flight and gives the rest back to the broker. The message
// being processed runs on a goroutine of its own, the worker's processor,
// started here and waited for on return, while this goroutine keeps taking
// messages from the dispatcher and keeping them alive: a slow handler, or
// one that ignores its context and hangs, delays this worker's aggregates
// only, never the dispatcher and so never the other workers. Only this
// goroutine touches the worker's state; the processor gets the items and
// hands back a result, and the heartbeat's look-up (lookUp) gets copies of
// the heads it asks about and hands back an answer. One processor for the
// worker's life, not a goroutine per message: a new goroutine grew its
// stack again through pgx for every message, a few percent of the
// consumer's CPU at moderate rates.
func (w *worker) run(ctx context.Context) error {
	tick := time.NewTicker(w.c.cfg.AckWait / 3)
	defer tick.Stop()
	var (
		busy chan batchOutcome // w.inflight's results; nil while idle
		stop = ctx.Done()
	)
	jobs, results, exited := make(chan []*item, 1), make(chan batchOutcome, 1), make(chan struct{})
	go func() {
		defer close(exited)
		for its := range jobs {
			results <- w.c.processItems(ctx, its)
		}
	}()
	defer func() { // returns only while idle: the processor ends at once
		close(jobs)
		<-exited
		if w.asking { // ctx has ended: the look-up ends at once too
			<-w.answers
			w.asking = false
		}
	}()
	for {
		if busy == nil {
			if ctx.Err() != nil {
				w.release()
				return nil
			}
			if w.inflight = w.take(); len(w.inflight) > 0 {
				busy = results
				jobs <- w.inflight
			}
		}
		select {
		case <-stop:
			stop = nil // wake once; the message in flight finishes first
		case it := <-w.in:
			w.enqueue(it)
		case <-tick.C:
			if len(w.inflight) > 1 {
				// A batch in flight may take longer than one message's
				// handling (a retry without a failed message): its
				// messages are kept alive like queued ones. A single
				// message is not, so that ack_wait still bounds it.
				keepAlive(w.inflight)
			}
			w.heartbeat(ctx)
		case a := <-w.answers:
			w.settleOverdue(a)
		case out := <-busy:
			busy = nil
			cur := w.inflight
			w.inflight = nil
			w.finishAll(ctx, cur, out)
		}
	}
}

// take takes what to process next: up to BatchSize messages already queued
// (it never waits for more to arrive), one when the batch would hold a
// single message, a replay, or the worker is retrying a failed batch's
// messages one at a time.
func (w *worker) take() []*item {
	k := w.size
	w.tookSolo = w.solo > 0
	if w.solo > 0 {
		w.solo--
		k = 1
	}
	if k > 1 {
		w.drain()
	}
	var its []*item
	for len(its) < k {
		it := w.next()
		if it == nil {
			break
		}
		if it.replay != nil && len(its) > 0 {
			// Replays go alone, through the per-message path: next takes
			// it again, after this batch.
			w.queue = append([]*item{it}, w.queue...)
			break
		}
		its = append(its, it)
		if it.replay != nil {
			break
		}
	}
	return its
}

// finishAll settles what processItems returned for its, in order; messages
// a batch did not attempt go back to the front of the queue, where next
// holds them behind a failed message of their aggregate, as if they had
// arrived after it. Version gaps are settled last, once the others are
// settled and back (settle looks for the missing version there),
// and one that a later message of the batch filled goes back too.
func (w *worker) finishAll(ctx context.Context, its []*item, out batchOutcome) {
	w.adapt(len(its), out)
	var back []*item
	var gaps []int
	for i, it := range its {
		res := out.res[i]
		if res.kind == resGap && it.replay == nil && gapFilled(its, out.res, i) {
			w.c.met.gap.Inc() // it came before its predecessor all the same
			res.kind = resRequeue
		}
		switch {
		case res.kind == resRequeue:
			back = append(back, it)
		case it.replay != nil:
			w.finishReplay(ctx, it, res)
		case res.kind == resGap:
			gaps = append(gaps, i)
		default:
			w.finish(ctx, it, res)
		}
	}
	if len(back) > 0 {
		w.queue = append(back, w.queue...)
		if out.solo {
			w.solo = len(back)
		}
	}
	for _, i := range gaps {
		w.finish(ctx, its[i], out.res[i])
	}
}

// gapFilled reports whether a missing version of its[i]'s gap was applied
// (or its rejection recorded: either moves the aggregate's version) in the
// same transaction, after its check: a batch [9, 8] at version 7.
func gapFilled(its []*item, res []result, i int) bool {
	g := res[i]
	for j, it := range its {
		if (res[j].kind == resApplied || res[j].kind == resRejected) && it.key == its[i].key && g.misses(it.m.AggregateVersion) {
			return true
		}
	}
	return false
}

// adapt sizes the next batches after one of n messages came to out. A
// batch that overran its HandlerTimeout (a loaded machine, a slow
// handler) would overrun again at its size, and each overrun throws its
// work away: the next batches hold half as many, down to one message, so a
// batch too slow at any size ends in per-message mode. Processing that took
// under half the timeout lets the size grow back by one message at a time,
// up to BatchSize: one more message then fits in the same deadline.
// Messages taken one at a time after a fallback say nothing about a
// batch's time and change nothing. The overrun itself is charged to no
// message: the deadline is the batch's.
func (w *worker) adapt(n int, out batchOutcome) {
	switch {
	case out.overran:
		w.size = max(1, min(w.size, n)/2)
	case w.tookSolo:
	case out.took < w.c.cfg.HandlerTimeout/2 && w.size < w.c.cfg.BatchSize && n >= w.size:
		w.size++
	}
}

// next takes the next message to process from the queue: not one of an
// aggregate held back behind a failed message (it joins the held ones), nor
// a replay of an aggregate whose earlier record failed in the same batch.
// It returns nil when nothing is left to process.
func (w *worker) next() *item {
	for len(w.queue) > 0 {
		it := w.queue[0]
		w.queue[0] = nil
		w.queue = w.queue[1:]
		if it.replay != nil {
			if it.replay.failedBefore(it.key) {
				// Left 'replaying': the next poll takes it again, after the
				// earlier record, in order.
				it.replay.done()
				continue
			}
			return it
		}
		if b := w.blocked[it.key]; b != nil && it.m.StreamSeq > b.head {
			b.hold(it)
			continue
		}
		return it
	}
	return nil
}

// drain moves whatever waits in the channel to the queue without blocking.
func (w *worker) drain() {
	for {
		select {
		case it := <-w.in:
			w.enqueue(it)
		default:
			return
		}
	}
}

// enqueue queues a delivery behind those that arrived before it, except
// the redelivery of a retried message (its aggregate's block head): that
// goes ahead of every queued message but its own aggregate's earlier ones
// (a batch's, put back unattempted when a later one failed, or a replay)
// and a failed batch's messages waiting for their turns one at a time.
// Until it is applied the durable's ack floor stays below it, and every
// reset of the durable (feed.go) delivers all that is above the floor
// again; behind a long queue that lasted as long as the queue did, and
// under CPU load the resets' repetitions took the feed's time until the
// worker ran dry (TestRetriedMessageGoesFirst). Its aggregate's later
// messages are held behind it; there is no order between aggregates to
// keep. A redelivery before its backoff ended (a reset's) is given back
// until then (early).
func (w *worker) enqueue(it *item) {
	b := w.blocked[it.key]
	if b == nil || it.replay != nil || it.msg == nil || it.m.StreamSeq != b.head {
		w.queue = append(w.queue, it)
		return
	}
	if wait := time.Until(b.retryAt); wait > 0 {
		w.early(it, wait)
		return
	}
	// The first solo queued messages are a failed batch's, put back to be
	// taken one at a time: a message inserted ahead of them would take one
	// of their turns, and the last of them would go in a batch again.
	at := min(w.solo, len(w.queue))
	for i, q := range w.queue {
		if q.key == it.key && (q.replay != nil || q.m.StreamSeq < it.m.StreamSeq) {
			at = i + 1
		}
	}
	w.queue = slices.Insert(w.queue, at, it)
}

// early gives back a retried message's delivery that came before its
// backoff ended, wait from now: a reset of the durable (feed.go) delivers
// everything above the ack floor at once, naked messages included.
// Processed, it would spend an attempt within its backoff, and a few
// resets in a row would dead-letter it within seconds of its first
// failure (TestResetsDoNotHurryARetry). Naked for the rest of its backoff,
// it comes back when it was due; its aggregate stays held meanwhile.
func (w *worker) early(it *item, wait time.Duration) {
	it.endSpan(result{kind: resStale}, true)
	if err := it.msg.NakWithDelay(wait); err != nil {
		// Not lost: the delivery comes back after AckWait.
		w.msgLog(it).Warn("defer a retried message redelivered before its backoff ended", zap.Error(err))
	}
}

// heartbeat tells the broker that queued and held messages are still being
// worked on, so that ack_wait only has to cover one message's handling, and
// asks whether the retried messages of overdue blocks are gone (lookUp).
func (w *worker) heartbeat(ctx context.Context) {
	now := time.Now()
	keepAlive(w.queue)
	var overdue []head
	for _, b := range w.blocked {
		keepAlive(b.held)
		switch {
		case !now.After(b.until):
		case w.queued(b.head):
			b.until = now.Add(w.c.cfg.AckWait) // redelivered: not yet reached, or being processed
		default:
			overdue = append(overdue, head{seq: b.head, id: b.id, hash: b.hash})
		}
	}
	if len(overdue) > 0 && !w.asking {
		w.asking = true
		go w.lookUp(ctx, overdue)
	}
}

// lookUp asks, on a goroutine of its own, whether the overdue heads are
// gone, and hands the answer back to the worker's goroutine (settleOverdue).
// The questions go to the database and to JetStream, and a server that is
// slow to answer makes each take as long as its deadline: asked on the
// worker's goroutine, every heartbeat held up the worker's messages for
// seconds, and a heartbeat later it asked again. Blocks go overdue when
// their retried messages cannot come back, as while the feed waits for the
// workers before a reset (feed.settle) — so the workers it waited for
// applied a message every few seconds instead of several a second, under
// CPU load for minutes, with the durable's ack floor held below the
// retried messages meanwhile (TestSlowLookUpDoesNotHoldUpTheWorker). One
// look-up is out at a time.
func (w *worker) lookUp(ctx context.Context, overdue []head) {
	w.answers <- goneAnswer{asked: overdue, gone: w.gone(ctx, overdue)}
}

// settleOverdue applies a look-up's answer to the blocks that are still
// overdue with a head it asked about: one whose retried message came back
// meanwhile, or failed again (a new deadline), is left as it is.
func (w *worker) settleOverdue(a goneAnswer) {
	w.asking = false
	asked := make(map[uint64]bool, len(a.asked))
	for _, h := range a.asked {
		asked[h.seq] = true
	}
	// The retried message did not come back in time. Its successors may go
	// only when it cannot come back: settled (by another process sharing
	// the durable consumer) or removed from the stream. A message that is
	// merely late, because JetStream is unreachable or slow, keeps its
	// aggregate held: releasing it then would apply a later event first.
	now := time.Now()
	for key, b := range w.blocked {
		switch {
		case !asked[b.head] || !now.After(b.until) || w.queued(b.head):
		case a.gone[b.head]:
			w.c.log.Warn("retried message was settled elsewhere or left the stream; releasing its aggregate",
				zap.Uint64(fieldSeq, b.head), zap.Int("held", len(b.held)))
			w.forget(b.head)
			w.unblock(key, b)
		case !b.waiting:
			b.waiting = true
			w.c.log.Warn("retried message not redelivered yet; holding its aggregate until it is back or known to be gone",
				zap.Uint64(fieldSeq, b.head), zap.Int("held", len(b.held)))
		}
	}
}

// gone reports which overdue heads need no more processing here: those
// whose own dedup row is committed (another process sharing the durable
// got the redelivery and applied it: the durable's ack floor does not show
// that while any lower message is unacknowledged, which on a busy shared
// durable can be for minutes), and those the source knows settled or
// removed from the stream. A lookup that fails tells nothing. It runs on
// the look-up's goroutine (lookUp): it touches no state of the worker.
func (w *worker) gone(ctx context.Context, overdue []head) map[uint64]bool {
	var (
		look   []head // those with a dedup row to look for
		ids    []string
		hashes [][]byte
	)
	for _, h := range overdue {
		if h.hash != nil {
			look, ids, hashes = append(look, h), append(ids, h.id), append(hashes, h.hash)
		}
	}
	gone := map[uint64]bool{}
	if len(look) > 0 {
		lctx, cancel := context.WithTimeout(ctx, min(w.c.cfg.AckWait/3, 5*time.Second))
		found, _ := w.c.recordedAmong(lctx, ids, hashes)
		cancel()
		var applied []uint64
		for i, h := range look {
			gone[h.seq] = found[i]
			if found[i] {
				applied = append(applied, h.seq)
			}
		}
		if len(applied) > 0 {
			// Not asked about, the source would keep their slots for
			// redeliveries that may never come (they can leave the stream).
			w.src.forget(applied)
		}
	}
	var ask []uint64
	for _, h := range overdue {
		if !gone[h.seq] {
			ask = append(ask, h.seq)
		}
	}
	if len(ask) > 0 {
		for seq, g := range w.src.gone(ctx, ask) {
			gone[seq] = g
		}
	}
	return gone
}

// keepAlive sends a progress ack for each delivery among its.
func keepAlive(its []*item) {
	for _, it := range its {
		if it.msg != nil {
			_ = it.msg.InProgress() // a lost progress ack only costs a harmless redelivery
		}
	}
}

// queued reports whether a delivery of the message at seq waits in the
// queue or is being processed. A retried message whose redelivery is in
// flight is back: its result settles its aggregate's block. Missed, the
// heartbeat warned that it was not redelivered, or, its transaction just
// committed, released its aggregate as settled elsewhere.
func (w *worker) queued(seq uint64) bool {
	for _, its := range [2][]*item{w.queue, w.inflight} {
		for _, it := range its {
			if it.msg != nil && it.m.StreamSeq == seq {
				return true
			}
		}
	}
	return false
}

// release gives the queued and held messages back to the broker on shutdown,
// so that they are redelivered at once rather than after ack_wait; except
// that the messages held behind a failed one come back only after it can
// have been applied: it is redelivered at its retryAt, to whichever process
// pulls first (a rolling deploy), and applied within HandlerTimeout, which
// is below AckWait. Were they released at once, another process could apply
// a later event of the aggregate first.
func (w *worker) release() {
	w.drain()
	delay := func(b *block) time.Duration { return max(time.Until(b.retryAt), 0) + w.c.cfg.AckWait }
	for _, it := range w.queue {
		switch b := w.blocked[it.key]; {
		case it.msg == nil:
		case b != nil && it.m.StreamSeq > b.head: // would have been held
			_ = it.msg.NakWithDelay(delay(b))
		default:
			_ = it.msg.Nak()
		}
	}
	for _, b := range w.blocked {
		for _, it := range b.held {
			_ = it.msg.NakWithDelay(delay(b))
		}
	}
	w.queue, w.blocked = nil, map[string]*block{}
}

// hold adds a message to those held behind the block's head. A delivery of
// a message already held (repeated by a reset of its feed, feed.go) takes
// the earlier delivery's place, so that resets while a message is retried
// do not pile up copies.
func (b *block) hold(it *item) {
	for i, h := range b.held {
		if h.msg != nil && it.msg != nil && h.m.StreamSeq == it.m.StreamSeq {
			if tm, ok := h.msg.(*trackedMsg); ok {
				tm.settled() // superseded: its feed no longer waits for it
			}
			h.endSpan(result{kind: resStale}, false)
			b.held[i] = it
			return
		}
	}
	b.held = append(b.held, it)
}

func (w *worker) unblock(key string, b *block) {
	delete(w.blocked, key)
	if len(b.held) == 0 {
		return
	}
	q := make([]*item, 0, len(b.held)+len(w.queue))
	w.queue = append(append(q, b.held...), w.queue...)
}

// finish settles a processed delivery with the broker and holds back or
// releases its aggregate.
func (w *worker) finish(ctx context.Context, it *item, res result) {
	seq := it.m.StreamSeq
	b := w.blocked[it.key]
	// Before the nak: the broker redelivers no earlier than retryAt, so a
	// delivery before it is early (enqueue).
	naked := time.Now()
	retryDelay, retry := w.settle(ctx, it, res)
	it.endSpan(res, retry)
	now := time.Now()
	retryAt := naked.Add(retryDelay)
	switch {
	case retry && b == nil:
		w.blocked[it.key] = &block{head: seq, id: it.m.ID, hash: it.hash, version: it.m.AggregateVersion, retryAt: retryAt, until: now.Add(retryDelay + 2*w.c.cfg.AckWait)}
	case retry:
		b.head, b.id, b.hash, b.version = seq, it.m.ID, it.hash, it.m.AggregateVersion
		b.retryAt, b.until, b.waiting = retryAt, now.Add(retryDelay+2*w.c.cfg.AckWait), false
	case b != nil && seq == b.head:
		w.unblock(it.key, b)
	}
}

// settle acknowledges, defers or dead-letters a delivery according to res.
// It reports whether the message will be redelivered for a retry (its
// aggregate must then wait for it) and after which delay.
func (w *worker) settle(ctx context.Context, it *item, res result) (time.Duration, bool) {
	c, seq := w.c, it.m.StreamSeq
	switch res.kind {
	case resApplied, resRejected, resDuplicate, resSkipped:
		w.forget(seq)
		// Counted before the ack: whoever sees the message settled (the
		// consumer's ack floor) sees it counted too.
		switch res.kind {
		case resApplied:
			c.met.processed(outcomeApplied)
		case resRejected:
			c.met.processed(outcomeRejected)
		case resDuplicate:
			c.met.idem.Inc()
			c.met.processed(outcomeDuplicate)
		default:
			c.met.processed(outcomeSkipped)
		}
		if err := it.msg.Ack(); err != nil {
			// The transaction committed; a lost ack means a redelivery that
			// the dedup row turns into a duplicate.
			w.msgLog(it).Warn("ack failed", zap.Error(err))
		}
		return 0, false
	case resGap:
		c.met.gap.Inc()
		g := w.gaps[seq]
		if g == nil {
			g = &gapState{since: time.Now()}
			w.gaps[seq] = g
		}
		g.deferrals++
		if w.behindMissing(it, res) {
			c.met.processed(outcomeDeferred)
			return 0, false
		}
		waited := time.Since(g.since)
		b := w.blocked[it.key]
		retrying := b != nil && res.misses(b.version)
		if res.blockedBy == 0 && (retrying || waited < c.cfg.GapWait) {
			delay := min(c.cfg.GapRecheck, c.cfg.GapWait-waited)
			if retrying {
				// A missing version is this worker's message waiting for
				// its retry: the gap is late, not lost, and waits for
				// those retries however long they take, not GapWait (under
				// load, or with a backoff longer than GapWait, it was
				// dead-lettered meanwhile: TestGapBehindARetriedVersion).
				// Back a GapRecheck after the retry is due: applied, the
				// missing version lets it go; dead-lettered, here or by
				// another process, it makes this gap one that names its
				// record. Not held here: held below the block's head, it
				// would keep the durable's ack floor under it, and the
				// heartbeat's look-up could never see a head another
				// process settled as gone.
				delay = max(time.Until(b.retryAt), 0) + c.cfg.GapRecheck
			}
			if err := it.msg.NakWithDelay(delay); err != nil {
				w.msgLog(it).Warn("defer message", zap.Error(err))
			}
			c.met.processed(outcomeDeferred)
			return 0, false
		}
		reason := res.err
		if res.blockedBy == 0 {
			reason = fmt.Errorf("%w; waited %s", res.err, waited.Round(time.Millisecond))
		}
		return w.deadLetter(ctx, it, ClassGap, reason, &failState{attempts: g.deferrals, first: g.since, last: time.Now()})
	case resConflict:
		c.met.conflict.Inc()
		return w.deadLetter(ctx, it, ClassConflict, res.err, w.fail(seq, ClassConflict))
	case resStale:
		return 0, false
	case resInDoubt: // never charged: the redelivery finds the dedup row if it committed
		return w.retry(it, ClassTransient, res.err, 1, w.msgLog(it))
	}
	// resFailed
	f := w.fail(seq, res.class)
	limit := 0
	switch res.class {
	case ClassTransient:
		limit = c.cfg.TransientAttempts
	case ClassUnknown:
		limit = c.cfg.MaxAttempts
	default: // permanent, and conflict or gap returned by a handler
		return w.deadLetter(ctx, it, res.class, res.err, f)
	}
	if n := f.byClass[res.class]; limit > 0 && n >= limit {
		return w.deadLetter(ctx, it, res.class, fmt.Errorf("%w (gave up after %d %s attempts, %d in all)", unclassed(res.err), n, res.class, f.attempts), f)
	}
	return w.retry(it, res.class, res.err, f.attempts, w.msgLog(it))
}

// behindMissing puts a message back in the queue right behind a version
// its gap misses, when that version waits there: a reset's deliveries, or
// a batch's messages put back unattempted, in another order than their
// versions. It is taken again once that version was tried, without a
// redelivery after GapRecheck. It reports whether it put the message back.
func (w *worker) behindMissing(it *item, res result) bool {
	if res.blockedBy != 0 {
		return false
	}
	for i := len(w.queue) - 1; i >= 0; i-- {
		q := w.queue[i]
		if q.key == it.key && q.err == nil && res.misses(q.m.AggregateVersion) {
			switch {
			case i < w.solo:
				w.solo++ // behind one of a fallen-back batch's messages: taken alone too
			case w.tookSolo:
				// Taken alone after its batch fell back, it must stay
				// alone (BatchHandler's contract); behind the fallen-back
				// messages it would go in a batch.
				return false
			}
			w.queue = slices.Insert(w.queue, i+1, it)
			return true
		}
	}
	return false
}

// msgLog is the logger for one message's trouble; built only when needed,
// because With encodes its fields at once and most messages log nothing.
func (w *worker) msgLog(it *item) *zap.Logger {
	return w.c.log.With(zap.String(fieldEventID, it.m.ID), zap.Uint64(fieldSeq, it.m.StreamSeq))
}

// fail records a failed attempt of class of the message at seq.
func (w *worker) fail(seq uint64, class Class) *failState {
	now := time.Now()
	f := w.fails[seq]
	if f == nil {
		f = &failState{first: now, byClass: map[Class]int{}}
		w.fails[seq] = f
	}
	f.attempts++
	f.byClass[class]++
	f.last = now
	return f
}

func (w *worker) forget(seq uint64) {
	delete(w.fails, seq)
	delete(w.gaps, seq)
}

func (w *worker) retry(it *item, class Class, err error, attempt int, log *zap.Logger) (time.Duration, bool) {
	delay := backoff(attempt, w.c.cfg.RetryBase, w.c.cfg.RetryMax, jitter)
	w.c.met.retried(class)
	it.retrySpanEvent(class, attempt, delay, err)
	log.Warn("message failed; retrying", zap.String(fieldClass, string(class)), zap.Int(fieldAttempt, attempt),
		zap.Duration(fieldDelay, delay), zap.Error(err))
	if nerr := it.msg.NakWithDelay(delay); nerr != nil {
		// Without the nak the broker redelivers after ack_wait instead.
		log.Warn("nak failed", zap.Error(nerr))
	}
	return delay, true
}

// deadLetter stores the message in consumer_dead_letter and terminates it.
// When the record cannot be written (the database is down) the message is
// retried instead: nothing leaves the stream without a record. A record the
// database refuses as is gets stored escaped (see insertDeadLetter), so
// that a message is never retried for good for want of a record.
func (w *worker) deadLetter(ctx context.Context, it *item, class Class, reason error, f *failState) (time.Duration, bool) {
	log := w.msgLog(it)
	if applied, err := w.c.recordedBefore(ctx, it); err == nil && applied {
		// An attempt whose commit was in doubt went through: the message
		// is applied, and its failure since (a Begin while the database
		// was away) says nothing about it.
		log.Warn("not dead-lettering a message whose own dedup row is committed; acknowledging it as a duplicate",
			zap.String(fieldClass, string(class)), zap.Error(reason))
		return w.settle(ctx, it, result{kind: resDuplicate})
	}
	class, reason = storableClass(class, reason)
	id, err := w.c.insertDeadLetter(ctx, it, class, reason, f)
	if err != nil {
		return w.retry(it, ClassTransient, fmt.Errorf("write dead letter (%s: %v): %w", class, reason, err), f.attempts, log)
	}
	w.forget(it.m.StreamSeq)
	w.c.met.deadLettered(class)
	it.deadLetterSpanEvent(class, id)
	log.Warn("message dead-lettered", zap.String(fieldClass, string(class)), zap.Int64(fieldDeadID, id),
		zap.String("owner", w.c.cfg.Owner), zap.Error(reason))
	if err := it.msg.TermWithReason(fmt.Sprintf("dead-lettered as %s, consumer_dead_letter id %d", class, id)); err != nil {
		// A redelivery updates the same open record.
		log.Warn("terminate dead-lettered message", zap.Error(err))
	}
	return 0, false
}

// finishReplay settles a processed replay: the record was closed in its
// transaction, or it is reopened with the new failure. A failure holds back
// the aggregate's later records of the same batch (see next).
func (w *worker) finishReplay(ctx context.Context, it *item, res result) {
	defer it.replay.done()
	defer it.endSpan(res, false)
	c := w.c
	switch res.kind {
	case resApplied, resRejected, resDuplicate:
		c.met.replayResult(map[resultKind]string{resApplied: outcomeApplied, resRejected: outcomeRejected, resDuplicate: outcomeDuplicate}[res.kind])
		return
	case resStale:
		return
	case resInDoubt: // left 'replaying' for the next poll, ahead of its aggregate's later records
		it.replay.fail(it.key)
		return
	case resSkipped:
		res = result{kind: resFailed, class: ClassPermanent, err: fmt.Errorf("event type %q is not in the consumer's EventTypes", it.m.Type)}
	}
	class, reason := res.class, res.err
	switch res.kind {
	case resGap:
		class = ClassGap
	case resConflict:
		class = ClassConflict
	}
	if reason == nil {
		reason = errors.New("replay failed")
	}
	c.met.replayResult("failed")
	it.replay.fail(it.key)
	if err := c.reopenDeadLetter(ctx, it, class, reason); err != nil {
		// The record stays 'replaying' and is taken again by the next poll.
		c.log.Warn("reopen dead letter after failed replay", zap.Int64(fieldDeadID, it.m.DeadLetterID), zap.Error(err))
	}
}
