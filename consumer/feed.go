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
// received`, a reconnect), a takeover — it drops what it received, waits
// for the deliveries it handed out to settle (not for those held behind a
// retried message, which come back with the reset), resets and goes on from
// the ack floor. Deliveries of before the reset that are still queued in a
// worker are ahead of their repetitions, and are applied first; a
// repetition of an applied message is a duplicate (the dedup row). Nothing
// here waits for a redelivery timer.
//
// A delivery at consumer sequence 1 that the feed did not ask for is a
// reset made by someone else (an operator, another member, another process
// on the durable): it starts a run of its own, the same as one of the
// feed's resets, and the feed adopts it instead of resetting once more
// (which under a storm of such resets would throw away every run before it
// is consumed). It waits only until no more than max_ack_pending deliveries
// are unsettled, so that a storm of resets cannot pile up copies. A reset's
// repetitions cost little either way: one of a delivery still in a worker
// stands in for it (forward), one of a delivery acknowledged lately is
// acknowledged at once (settledBefore).
//
// A plain durable may be pulled by several processes (shareable): each then
// receives a part of every run, and no reset can give one of them an
// unbroken one. A delivery is lost to a process only with its connection or
// pull (a reconnect, a missed heartbeat: the feed sees either); a gap in a
// run that saw neither went to another process. Two such runs in a row make
// the feed shared: it hands on deliveries as they come, since the processes
// split an aggregate's messages between them anyway and only VersionCheck
// keeps its order then; a gap with a connection or pull event still resets.
// Once its deliveries have run unbroken for sharedRecheck (the others are
// gone), it resets to be strict again.
type feed struct {
	e         *engine // whose workers the deliveries go to
	c         *Consumer
	cons      jetstream.Consumer
	name      string // the consumer's name
	pullOpt   []jetstream.PullMessagesOpt
	log       *zap.Logger
	shareable bool    // a plain durable: other processes may pull it too
	budget    *budget // a group member's, shared with its other feeds; nil for a plain durable
	// admitSeq, when set (a group's partition), is asked about each
	// delivery's stream sequence before it is handed on; its error ends
	// the pump, the delivery not handed on.
	admitSeq func(streamSeq uint64) error

	iter   jetstream.MessagesContext // nil until open
	next   uint64                    // the consumer sequence expected next
	run    runState                  // what happened since the run began
	strays int                       // runs in a row broken by a gap nothing explains
	shared time.Time                 // non-zero: shared, since the last break
	reset  time.Time                 // the last reset, to pace resets in a row
	why    string                    // why the next open resets (resumes_total)
	pin    string                    // the pin id of the last delivery (pinned priority groups)
	// top is the highest stream sequence handed out. A delivery above it
	// (the common case) cannot be a repetition, a redelivery of a naked
	// message or one acknowledged lately: forward skips those look-ups.
	// Only the pump's goroutine touches it.
	top uint64

	mu       sync.Mutex
	inflight map[string]int // aggregate key -> handed out, unsettled
	n        int            // total unsettled
	// out holds the deliveries handed out, unsettled and not naked, by
	// stream sequence: a repetition of one (a reset) stands in for it.
	out  map[uint64]*trackedMsg
	done seqRing // stream sequences acknowledged or terminated lately; sized at open
	// returning holds the stream sequences naked back to the broker, still
	// counted in inflight until they are delivered again; nakedKeys counts
	// them by aggregate, so that busy looks at the few held aggregates
	// rather than at every one in flight.
	returning map[uint64]string
	nakedKeys map[string]int
	closed    bool          // close was called: nothing naked comes back here
	changed   chan struct{} // receives (non-blocking) on each settle
}

func newFeed(e *engine, cons jetstream.Consumer, name string, log *zap.Logger, opts ...jetstream.PullMessagesOpt) *feed {
	return &feed{
		e: e, c: e.c, cons: cons, name: name, pullOpt: opts, log: log, why: resumeStart,
		inflight:  map[string]int{},
		out:       map[uint64]*trackedMsg{},
		returning: map[uint64]string{},
		nakedKeys: map[string]int{},
		changed:   make(chan struct{}, 1),
	}
}

// runState is what a feed knows of the run it consumes: when it began, and
// whether anything that can lose deliveries on their way happened since.
type runState struct {
	began       time.Time
	reconnects  uint64 // the connection's reconnects when the run began
	interrupted bool   // a pull was interrupted (missed heartbeat, a status)
}

// beginRun starts the record of a new run.
func (f *feed) beginRun() {
	f.run = runState{began: time.Now(), reconnects: f.c.js.Conn().Stats().Reconnects}
}

// explained reports whether the run saw an event that can lose deliveries.
func (f *feed) explained() bool {
	return f.run.interrupted || f.c.js.Conn().Stats().Reconnects != f.run.reconnects
}

// pinHeader carries the pin id on a delivery to a pinned client.
const pinHeader = "Nats-Pin-Id"

// errFeedGap marks a break in the consumer sequence.
var errFeedGap = errors.New("consumer sequence gap")

// minResetInterval paces the feed's resets in a row: each costs a
// redelivery of everything unacknowledged.
const minResetInterval = time.Second

// sharedRecheck is how long a shared feed's deliveries must run unbroken
// before it resets to find out whether it is alone on the durable again; a
// run that lasted as long before a gap does not count towards sharing.
const sharedRecheck = 10 * time.Second

// straysToShare is how many runs in a row must break by a gap that nothing
// explains before a shareable feed counts as shared.
const straysToShare = 2

// pullHeartbeat is the idle heartbeat a plain durable's pull asks for. It
// bounds a stall nats.go cannot see otherwise: it asks for more messages
// only when fewer than half of those it asked for are on their way, so a
// pull request that the server never holds — lost, or never sent while
// its bookkeeping counted it (bench/README.md, the plain durable's 30 s
// stall) — leaves it waiting for deliveries the server does not owe, and
// the server sends heartbeats only for requests it holds. Two missed
// heartbeats make nats.go ask afresh (TestLostPullRequestDoesNotStallTheFeed):
// with its default of half the 30 s expiry that took 30 s. Much shorter
// would end pulls over hiccups a 30 s pull rode out: on a durable shared by
// processes each such end costs a reset (silence). An idle pull costs a
// heartbeat every 2 s. A group's partitions, whose pulls expire every 2 s,
// have nats.go's 1 s heartbeat.
const pullHeartbeat = 2 * time.Second

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
	f.iter, f.next, f.shared = iter, 1, time.Time{}
	f.beginRun()
	words := doneWords(f.maxAckPending())
	f.mu.Lock()
	f.done.resize(words)
	f.mu.Unlock()
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

// delivery is one message as received, with its JetStream metadata (the
// reply subject) parsed once: the gap check, the repeat look-ups and the
// item all read it.
type delivery struct {
	msg jetstream.Msg
	md  *jetstream.MsgMetadata
}

// recv returns the next delivery in consumer-sequence order, reopening the
// feed after a break. It returns an error only when the consumer cannot be
// pulled any more (deleted, the connection closed) or ctx ends.
func (f *feed) recv(ctx context.Context) (delivery, error) {
	for {
		if f.iter == nil {
			if err := f.open(ctx); err != nil {
				return delivery{}, err
			}
		}
		msg, err := f.iter.Next(jetstream.NextContext(ctx))
		if err == nil {
			var md *jetstream.MsgMetadata
			if md, err = msg.Metadata(); err == nil {
				err = f.admit(ctx, md.Sequence.Consumer)
			}
			if err == nil && f.admitSeq != nil {
				if err = f.admitSeq(md.Sequence.Stream); err != nil {
					return delivery{}, err
				}
			}
			if err == nil {
				if pin := msg.Headers().Get(pinHeader); pin != "" {
					f.pin = pin
				}
				return delivery{msg: msg, md: md}, nil
			}
		}
		if ctx.Err() != nil {
			return delivery{}, ctx.Err()
		}
		switch {
		case isGone(err), errors.Is(err, jetstream.ErrConnectionClosed):
			return delivery{}, err
		case errors.Is(err, jetstream.ErrNoHeartbeat) && f.silence(ctx, err):
			// The server answers: nats.go asks afresh on the next pull.
			f.run.interrupted = true
			continue
		case errors.Is(err, jetstream.ErrNoHeartbeat):
			// The server does not answer either (silence logged it). With
			// the link back, nats.go would ask afresh beside the requests
			// the server still holds, and the server deliver all of them
			// into a buffer sized for one: they would overflow it (slow
			// consumer drops, a gap). A pull of its own after a reset
			// gets only what it asks for.
			f.why = resumeEnded
		case errors.Is(err, jetstream.ErrPinIDMismatch),
			errors.Is(err, jetstream.ErrConsumerLeadershipChanged), errors.Is(err, nats.ErrTimeout):
			// The subscription lives on; a delivery lost meanwhile shows
			// as a gap in the consumer sequence.
			f.run.interrupted = true
			f.log.Debug("pull interrupted; pulling on", zap.String("durable", f.name), zap.Error(err))
			continue
		case errors.Is(err, errFeedGap):
			f.why = resumeGap
			f.log.Info("deliveries missed; resuming in order from the ack floor", zap.String("durable", f.name), zap.Error(err))
		case errors.Is(err, errRecheck):
			f.why = resumeRecheck
		default:
			f.why = resumeEnded
			f.log.Warn("pull subscription ended; resuming in order from the ack floor", zap.String("durable", f.name), zap.Error(err))
		}
		f.stop()
		if err := f.settle(ctx); err != nil {
			return delivery{}, err
		}
	}
}

// silence handles a pull that received nothing, not even the server's
// idle heartbeats, for two heartbeat intervals: it counts and logs it with
// what the server and the feed hold, and reports whether the server
// answers. If it does, the link works and the server held no request of
// ours (pullHeartbeat): pulling on is right. If not, the link or the
// server is down, and the pull is better ended (recv).
func (f *feed) silence(ctx context.Context, err error) (answers bool) {
	f.c.met.silences.Inc()
	fields := []zap.Field{zap.String("durable", f.name), zap.Int("unsettled", f.unsettled()), zap.Error(err)}
	ictx, cancel := context.WithTimeout(ctx, 2*time.Second)
	info, ierr := f.cons.Info(ictx)
	cancel()
	if ierr != nil {
		f.log.Warn("no delivery nor heartbeat for two heartbeat intervals, and no answer from the server; resuming in order from the ack floor once it answers",
			append(fields, zap.NamedError("info_error", ierr))...)
		return false
	}
	f.log.Info("no delivery nor heartbeat for two heartbeat intervals; pulling on",
		append(fields, zap.Int("server_ack_pending", info.NumAckPending),
			zap.Int("server_waiting", info.NumWaiting), zap.Uint64("server_pending", info.NumPending),
			zap.Uint64("server_delivered", info.Delivered.Consumer), zap.Uint64("server_ack_floor", info.AckFloor.Consumer))...)
	return true
}

// errRecheck asks a shared feed to reset, to learn whether it is alone.
var errRecheck = errors.New("recheck whether the durable is still shared")

// admit decides on a delivery at consumer sequence seq: nil hands it on,
// errFeedGap (or errRecheck) drops it and has the feed reset.
func (f *feed) admit(ctx context.Context, seq uint64) error {
	switch {
	case seq == f.next:
		f.next++
		if !f.shared.IsZero() && time.Since(f.shared) >= sharedRecheck {
			return errRecheck // the others stopped pulling: be strict again
		}
		return nil
	case seq == 1:
		// Someone else reset the consumer: its run starts here.
		f.next = 2
		f.beginRun()
		f.c.met.resumes[resumeAdopted].Inc()
		f.log.Info("the durable was reset by another party; consuming on from its ack floor",
			zap.String("durable", f.name), zap.Int("unsettled", f.unsettled()))
		return f.settleTo(ctx, f.maxAckPending())
	case !f.shareable || f.explained():
	case !f.shared.IsZero():
		f.next, f.shared = seq+1, time.Now()
		return nil
	default:
		if time.Since(f.run.began) >= sharedRecheck {
			f.strays = 0 // a long run: this gap is the first of its kind
		}
		if f.strays++; f.strays >= straysToShare {
			f.next, f.shared = seq+1, time.Now()
			f.log.Warn("another process pulls this durable too: deliveries are split between the processes, and only VersionCheck keeps an aggregate's order; use a consumer group (Config.Group) for order without it",
				zap.String("durable", f.name))
			return nil
		}
	}
	return fmt.Errorf("%w: delivery %d, expected %d", errFeedGap, seq, f.next)
}

// maxAckPending is the consumer's max_ack_pending as last seen, 0 when
// unknown.
func (f *feed) maxAckPending() int {
	if info := f.cons.CachedInfo(); info != nil {
		return max(info.Config.MaxAckPending, 0)
	}
	return 0
}

// settle waits until every delivery handed out is settled, except those
// of aggregates with a message naked for a retry: they wait for its
// redelivery, which comes with the reset. So the deliveries of one reset
// are out of the workers (but for those held) before the next reset's
// arrive, and a member never holds more than two resets' worth.
func (f *feed) settle(ctx context.Context) error { return f.settleTo(ctx, 0) }

// settleTo waits until no more than n of the deliveries handed out are
// unsettled, not counting those held behind a naked message.
func (f *feed) settleTo(ctx context.Context, n int) error {
	for f.busy() > n {
		select {
		case <-f.changed:
		case <-time.After(200 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// busy counts the deliveries handed out and unsettled, but for those of
// aggregates held behind a naked message.
func (f *feed) busy() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	held := 0
	for key := range f.nakedKeys {
		held += f.inflight[key]
	}
	return max(f.n-held, 0)
}

// forward hands a delivery to the worker of its aggregate, tracked until
// it is settled. A repetition (after a reset) of a delivery still handed
// out is not handed out again: the earlier delivery's settlement goes to it
// instead (the server keeps acknowledgements by stream sequence, so either
// delivery's ack would do, but a nak or a progress ack counts only for the
// newer). It keeps its place in the worker's queue, ahead of the
// aggregate's later messages, and a reset costs no second application.
// A delivery above every one handed out is none of these, and goes by the
// look-ups: that is nearly every delivery.
func (f *feed) forward(ctx context.Context, d delivery) error {
	seq := d.md.Sequence.Stream
	fresh := seq > f.top
	if !fresh && (f.settledBefore(seq, d.msg) || f.standIn(seq, d.msg)) {
		return nil
	}
	it := f.c.newItemOf(d.msg, d.md, nil)
	if fresh || !f.returned(seq) {
		if err := f.budget.take(ctx); err != nil {
			return err
		}
	}
	f.top = max(f.top, seq)
	tm := &trackedMsg{Msg: d.msg, cur: d.msg, f: f, key: it.key, seq: seq}
	f.track(tm)
	it.msg = tm
	if err := f.e.send(ctx, it); err != nil {
		tm.settled() // comes again after the next reset
		return err
	}
	return nil
}

// settledBefore acknowledges msg, a repetition of a delivery of seq that
// was acknowledged after its commit (or terminated after its dead letter)
// lately: a reset forgets the acknowledgements above the ack floor, and the
// repetition needs no transaction to be known as done.
func (f *feed) settledBefore(seq uint64, msg jetstream.Msg) bool {
	f.mu.Lock()
	done := f.done.has(seq)
	f.mu.Unlock()
	if !done {
		return false
	}
	f.c.met.idem.Inc() // before the ack, as worker.settle counts
	f.c.met.processed(outcomeDuplicate)
	_ = msg.Ack() // lost: it comes again, and is acknowledged again
	return true
}

// doneWords sizes the ring of lately acknowledged sequences for a
// consumer's max_ack_pending: a span of 64 × max(4 × max_ack_pending,
// 1024) stream sequences, at one bit each no more memory than a set of
// that many sequences would take, and wide enough for a filtered consumer
// or a group partition that sees one stream sequence in many.
func doneWords(maxAckPending int) int {
	return max(4*maxAckPending, 1024)
}

// seqRing is a bounded set of stream sequences, one bit each over a window
// of consecutive sequences that slides up as higher ones are added: the
// lowest are forgotten first. One forgotten costs a duplicate's
// transaction, not order; a sequence below the window is not added.
type seqRing struct {
	bits []uint64 // a power of two of words; sequence s is bit s%64 of word (s/64)%len
	base uint64   // the window's first word (a sequence / 64)
}

// resize makes the ring at least words wide, keeping what fits.
func (r *seqRing) resize(words int) {
	n := 1
	for n < words {
		n <<= 1
	}
	if n == len(r.bits) {
		return
	}
	old := *r
	r.bits, r.base = make([]uint64, n), 0
	for i := range old.bits {
		w := old.base + uint64(i)
		for b, word := uint64(0), old.bits[w&uint64(len(old.bits)-1)]; word != 0; b++ {
			if word&1 != 0 {
				r.add(w*64 + b)
			}
			word >>= 1
		}
	}
}

func (r *seqRing) has(seq uint64) bool {
	w := seq / 64
	if len(r.bits) == 0 || w < r.base || w >= r.base+uint64(len(r.bits)) {
		return false
	}
	return r.bits[w&uint64(len(r.bits)-1)]&(1<<(seq%64)) != 0
}

func (r *seqRing) add(seq uint64) {
	w, n := seq/64, uint64(len(r.bits))
	if n == 0 || w < r.base {
		return
	}
	if w >= r.base+n {
		// Slide up: clear the words that leave the window, lowest first.
		newBase := w - n + 1
		for x := r.base; x < newBase && x < r.base+n; x++ {
			r.bits[x&(n-1)] = 0
		}
		r.base = newBase
	}
	r.bits[w&(n-1)] |= 1 << (seq % 64)
}

// standIn gives msg, a repetition of the delivery of seq, to the earlier
// delivery if that is still handed out and neither settled nor naked.
func (f *feed) standIn(seq uint64, msg jetstream.Msg) bool {
	f.mu.Lock()
	tm := f.out[seq]
	f.mu.Unlock()
	return tm != nil && tm.replace(msg)
}

func (f *feed) track(tm *trackedMsg) {
	f.mu.Lock()
	f.inflight[tm.key]++
	f.n++
	f.out[tm.seq] = tm
	f.mu.Unlock()
}

// settlement is how a worker let go of a delivery.
type settlement int

const (
	settleGone  settlement = iota // superseded, or it never reached a worker
	settleDone                    // acknowledged after its commit, or terminated after its dead letter
	settleNaked                   // naked back to the broker: it comes again
)

// release records in one hold of f.mu that tm is settled as how says: it
// stands in for repetitions no more, a done sequence joins the lately
// acknowledged, and the first settlement of tm drops it from the counts
// with its budget slot, but for a naked one: that stays counted, with its
// slot, until it comes back (returned), unless the feed is closed and it
// cannot come back here.
func (f *feed) release(tm *trackedMsg, how settlement) {
	first := false
	tm.once.Do(func() { first = true })
	f.mu.Lock()
	if f.out[tm.seq] == tm {
		delete(f.out, tm.seq)
	}
	if how == settleDone {
		f.done.add(tm.seq)
	}
	free := first && (how != settleNaked || f.closed)
	switch {
	case free:
		f.uncount(tm.key)
	case first:
		f.returning[tm.seq] = tm.key
		f.nakedKeys[tm.key]++
	}
	f.mu.Unlock()
	if free {
		f.budget.give(1)
		select {
		case f.changed <- struct{}{}:
		default:
		}
	}
}

// uncount drops a delivery of key from the counts; f.mu is held.
func (f *feed) uncount(key string) {
	if f.inflight[key]--; f.inflight[key] <= 0 {
		delete(f.inflight, key)
	}
	f.n--
}

// returned reports whether seq is the redelivery of a naked message, and
// if so settles the naked delivery, whose budget slot passes to the
// redelivery: asking for a new one could wait for the very message that
// would free one (budget).
func (f *feed) returned(seq uint64) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	key, ok := f.returning[seq]
	if ok {
		delete(f.returning, seq)
		if f.nakedKeys[key]--; f.nakedKeys[key] <= 0 {
			delete(f.nakedKeys, key)
		}
		f.uncount(key)
	}
	return ok
}

// close stops the feed for good (its partition was handed off or removed):
// the messages naked for a retry come back to whoever pulls the durable
// next, so their budget slots are given back now. Deliveries still in the
// workers give theirs back as they settle.
func (f *feed) close() {
	f.stop()
	f.mu.Lock()
	f.closed = true
	naked := f.returning
	f.returning, f.nakedKeys = map[uint64]string{}, map[string]int{}
	for _, key := range naked {
		f.uncount(key)
	}
	f.mu.Unlock()
	f.budget.give(len(naked))
	if f.budget != nil {
		f.budget.leave(f)
	}
}

// unsettled is the number of deliveries handed out and not settled.
func (f *feed) unsettled() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.n
}

// trackedMsg reports to its feed when the worker settles it. Its
// settlement goes to the newest delivery of its message (cur, see
// feed.forward); the embedded first delivery answers everything else.
type trackedMsg struct {
	jetstream.Msg
	f    *feed
	key  string
	seq  uint64
	once sync.Once // the first settlement: the counts and budget slot go

	mu    sync.Mutex
	cur   jetstream.Msg // the delivery settlements go to
	final bool          // settled or naked: cur no longer changes
}

// replace makes msg the delivery this message's settlement goes to, unless
// it is already settled or naked.
func (m *trackedMsg) replace(msg jetstream.Msg) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.final {
		return false
	}
	m.cur = msg
	return true
}

// finalMsg fixes and returns the delivery a settlement goes to: a
// repetition received from now on is handed out on its own.
func (m *trackedMsg) finalMsg() jetstream.Msg {
	m.mu.Lock()
	m.final = true
	msg := m.cur
	m.mu.Unlock()
	return msg
}

func (m *trackedMsg) current() jetstream.Msg {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.cur
}

// settled lets go of a message without an acknowledgement: superseded by
// a newer delivery of it, or never handed to a worker.
func (m *trackedMsg) settled() {
	m.finalMsg()
	m.f.release(m, settleGone)
}

func (m *trackedMsg) Ack() error {
	err := m.finalMsg().Ack()
	m.f.release(m, settleDone)
	return err
}

func (m *trackedMsg) DoubleAck(ctx context.Context) error {
	err := m.finalMsg().DoubleAck(ctx)
	m.f.release(m, settleDone)
	return err
}

func (m *trackedMsg) Term() error {
	err := m.finalMsg().Term()
	m.f.release(m, settleDone)
	return err
}

func (m *trackedMsg) TermWithReason(reason string) error {
	err := m.finalMsg().TermWithReason(reason)
	m.f.release(m, settleDone)
	return err
}

// InProgress keeps the newest delivery alive.
func (m *trackedMsg) InProgress() error { return m.current().InProgress() }

// Nak and NakWithDelay do not settle: the message comes back and is
// tracked again, and the aggregate stays in flight meanwhile. A
// redelivered message is a new trackedMsg, so the count of the naked one
// must go: it is settled when its redelivery is forwarded.
//
// The release comes first: from then on a repetition of the message is
// its return (feed.returned) and takes over its budget slot. Fixed first,
// a repetition forwarded in between took a slot of its own, and if it was
// acknowledged the naked delivery never came back to give its slot up.
func (m *trackedMsg) Nak() error {
	m.f.release(m, settleNaked)
	return m.finalMsg().Nak()
}

func (m *trackedMsg) NakWithDelay(d time.Duration) error {
	m.f.release(m, settleNaked)
	return m.finalMsg().NakWithDelay(d)
}
