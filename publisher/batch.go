package publisher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
)

// ErrBatchDisabled means the stream refused a fast-ingest batch because it
// does not allow batched publishing (any more): publish per key instead.
var ErrBatchDisabled = errors.New("stream does not allow batched publishing")

// Batch publishes every message of one stream, in the order handed over,
// as fast-ingest batches (nats-server 2.14 or later, stream allow_batched).
//
// Its Run goroutine owns the queue and the current batch: it sends every
// message and commit, reads every answer and calls every Done. Producers,
// the reply subscription and the per-key publisher (for the isolated
// message) hand it events over bounded channels; only the window's
// capacity is shared, under its own lock.
//
// A batch is one ordered, flow-controlled publishing session in "gap: fail"
// mode: the server acknowledges every few hundred messages, and its final
// answer counts the messages stored, in order. Only that answer settles
// messages: it names the stream, which is checked like every other ack,
// while a flow ack names none and so only tells that the server is alive.
// A message that fails ends the batch where it failed: the server stores
// nothing after it. So within a batch order holds for every message, not
// only per key, and a hot aggregate is not limited to one round trip per
// event, while the server answers once per few hundred messages instead
// of once per message (less CPU on both sides).
//
// The server acknowledges a batch's last messages only when it is
// committed. What queued up while the previous batch was answered forms the
// next batch: a short queue (moderate load) is committed by its last
// message; a longer one stays open while messages keep coming and is
// committed as soon as none was sent for IdleCommit. A new batch starts only
// after the previous one's final answer: a batch that failed must not be
// overtaken by the next.
//
// Failures are not handled here but by the per-key Publisher given to
// NewBatch: when a batch fails (an error, a gap, no answer within
// AckTimeout), every message the server has not confirmed is sent again
// alone through the per-key publisher, which keeps each key's order and
// retries, classifies and dead-letters them as it does any message. Once
// they settle the next batch starts behind them; messages the failed
// batch did store after all are reported as duplicates by the stream
// (Nats-Msg-Id) and skipped. The failed batch's final answer, should it
// still come (answers slower than AckTimeout), settles what it counts,
// sent alone or not. Across keys, the stream's order then follows
// the lone publishes' answers: order holds per key. The per-key publisher also carries the
// messages of other streams (dead-letter records).
type Batch struct {
	cfg    Config
	nc     *nats.Conn
	keyed  *Publisher
	log    *zap.Logger
	obs    Observer
	idle   time.Duration
	flow   string // the ack frequency asked for, a reply subject token
	stream string // the stream's name, for Result.Ack

	prefix string // reply prefix: <inbox>.; a reply is prefix+<id>.<flow>.fail.<seq>.<op>.$FI
	idBase string // unique start of every batch id
	sub    *nats.Subscription

	window

	// Hand-over to Run. in holds admitted messages only, so it never
	// fills; replies is the reply subscription's own channel (see
	// NewBatch); isoDone holds the results of the messages gone alone (at
	// most the window's, so the per-key publisher never blocks on it).
	in      chan admitted
	replies chan *nats.Msg
	isoDone chan loneResult
	oldestQ chan stuckQuery
	stopped chan struct{} // closed when Run returns

	// Owned by Run.
	batchState
}

// batchState is what Run owns: the queue and the current batch.
type batchState struct {
	queue []*bpending // unsettled, in publish order, from head
	free  []*bpending // settled, for reuse
	wire  wireHeader  // every sent message's nats.Header
	// pubAck is what Result.Ack holds: fast-ingest acks carry no
	// per-message stream sequence, so it names the stream only.
	pubAck jetstream.PubAck
	head   int
	sent   int // queue[head:head+sent] were sent in the current batch
	state  batchPhase
	id     string // current batch id
	// subject is the current batch's first subject: its commit goes to
	// the same stream.
	subject string
	ids     uint64
	seq     uint64 // last batch sequence sent in the current batch
	acked   uint64 // every message of the current batch up to it is stored and settled
	eob     uint64 // batch sequence of the commit, 0 before it is sent
	// commitAt is the batch sequence whose message commits the batch, 0
	// for a batch committed after a lull.
	commitAt uint64
	// failed is the first failure reported in the current batch.
	failed  error
	lastAck time.Time // last ack of the current batch, or its start
	endBy   time.Time // deadline for the final answer once ending
	// lone counts the messages from head that go alone after a failure;
	// loneHanded of them are with the per-key publisher.
	lone, loneHanded int
	// lateID is the failed batch whose unconfirmed messages go alone, and
	// lateSent how many messages it sent: its final answer, should it come
	// after the batch ended, still settles what it counts (lateAnswer).
	lateID   string
	lateSent uint64
	failures int // consecutive failed batches, for logging
	// sends counts messages sent; idleAt is its value when the idle timer
	// was armed, so a timer that fires after more sends waits again.
	sends     uint64
	idleAt    uint64
	idleArmed bool
	reply     []byte // reply subject buffer
}

type batchPhase int

const (
	batchIdle      batchPhase = iota // no batch: the next send starts one
	batchOpen                        // sending
	batchEnding                      // committing or failed: waiting for the final answer
	batchIsolating                   // a failed batch's unconfirmed messages go alone through the per-key publisher
)

// bpending is one message on its way through a Batch.
type bpending struct {
	m     *Message
	size  int
	bseq  uint64 // batch sequence in the current batch; 0 when not sent in it
	first time.Time
	// alone is the message's copy with the per-key publisher after a
	// failure, and res its result once loneDone.
	alone    Message
	loneDone bool
	res      Result
	// lateSeq is the message's sequence in the failed batch lateID, 0 if
	// it was not sent in it. handed is set while the per-key publisher
	// holds alone; settled marks a message settled while handed (by its
	// batch's late answer), whose pending is reused only once the per-key
	// publisher's result is back.
	lateSeq         uint64
	handed, settled bool
}

// loneResult is the per-key publisher's result for a message gone alone.
type loneResult struct {
	pd  *bpending
	res Result
}

// BatchConfig configures a Batch beyond Config.
type BatchConfig struct {
	// Stream is the stream every message goes to (for Result.Ack).
	Stream string
	// IdleCommit is how long no message must have been sent before the
	// current batch is committed, so that its last messages are
	// acknowledged. Default 100µs: a lull that long costs the next message
	// one round trip to start a new batch.
	IdleCommit time.Duration
	// AckEvery asks the server to acknowledge every AckEvery messages (it
	// may choose fewer). Default min(500, MaxInFlight/4), at least 1.
	AckEvery int
}

// shortBatch is the longest queue sent as a batch committed by its last
// message.
const shortBatch = 32

// Fast-ingest batch operations, the next-to-last token of a reply subject.
const (
	opStart     = "0"
	opAppend    = "1"
	opCommit    = "2"
	opCommitEOB = "3"
)

// NewBatch returns a fast-ingest publisher on nc that hands failures to
// keyed (whose Run must be running). Run must be running for messages to
// be sent.
func NewBatch(nc *nats.Conn, keyed *Publisher, cfg Config, bcfg BatchConfig, opts ...Option) (*Batch, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	if bcfg.IdleCommit <= 0 {
		bcfg.IdleCommit = 100 * time.Microsecond
	}
	if bcfg.AckEvery <= 0 {
		bcfg.AckEvery = max(1, min(500, cfg.MaxInFlight/4))
	}
	if bcfg.AckEvery > 65535 {
		return nil, fmt.Errorf("%w: ack_every %d exceeds 65535", ErrInvalidConfig, bcfg.AckEvery)
	}
	o, err := applyOptions(opts)
	if err != nil {
		return nil, err
	}
	b := &Batch{
		cfg:     cfg,
		nc:      nc,
		keyed:   keyed,
		log:     o.log,
		obs:     o.obs,
		idle:    bcfg.IdleCommit,
		flow:    strconv.Itoa(bcfg.AckEvery),
		stream:  bcfg.Stream,
		window:  newWindow(cfg),
		in:      make(chan admitted, cfg.MaxInFlight),
		replies: make(chan *nats.Msg, cfg.MaxInFlight+replyQueue),
		isoDone: make(chan loneResult, cfg.MaxInFlight),
		oldestQ: make(chan stuckQuery),
		stopped: make(chan struct{}),
	}
	b.pubAck = jetstream.PubAck{Stream: bcfg.Stream}
	// The connection's reader hands answers straight to Run's channel: an
	// asynchronous subscription's goroutine in between woke once more per
	// answer, which at moderate rates is once more per event. The server
	// sends at most one answer per message sent (a flow ack, a failure or
	// the final count), so the channel, sized by the window, holds every
	// answer Run has yet to read; one it could not hold would be dropped as
	// a slow consumer, costing a batch timeout, never a wrong settle.
	b.prefix = nc.NewInbox() + "."
	if b.sub, err = nc.ChanSubscribe(b.prefix+">", b.replies); err != nil {
		return nil, fmt.Errorf("subscribe to acks: %w", err)
	}
	// Batch ids must be unique across processes and restarts: the server
	// keys batches by id within a stream, and keeps a batch whose publisher
	// died for its timeout. A new batch taking such an id would be read as
	// a backward gap in the old one, and the old one's count answered to
	// the new one's messages: messages never stored would count as stored.
	// The inbox's last token is a fresh NUID; a counter follows it.
	inbox := b.prefix[:len(b.prefix)-1]
	b.idBase = inbox[strings.LastIndexByte(inbox, '.')+1:]
	return b, nil
}

// TryPublish hands m to Run if the window has room and reports whether it
// did. Messages are stored in the order they are handed over.
func (b *Batch) TryPublish(m *Message) (bool, error) {
	size := msgSize(m)
	if ok, err := b.admit(size); !ok {
		return false, err
	}
	b.in <- admitted{m: m, size: size, first: time.Now()}
	return true, nil
}

// Run sends batches, commits them after a lull, reads their answers and
// handles timeouts and failures until ctx ends or the publisher closes. It
// returns the reason the publisher closed, or ctx's error. It may be called
// once.
//
// While a batch waits for its final answer (or its messages go alone) Run
// does not take handed-over messages: nothing could be sent before that
// answer, and taking each would wake Run once per message for nothing.
// They wait in the hand-over channel and form the next batch, all taken at
// once when the answer comes.
func (b *Batch) Run(ctx context.Context) error {
	defer close(b.stopped)
	check := newCheckTimer()
	defer check.stop()
	idle := time.NewTimer(time.Hour)
	idle.Stop()
	defer idle.Stop()
	for {
		in := b.in
		if b.state == batchEnding || b.state == batchIsolating {
			in = nil
		}
		select {
		case a := <-in:
			b.enqueue(a)
		case msg := <-b.replies:
			b.onReply(msg)
		case r := <-b.isoDone:
			b.isolatedSettled(r)
		case q := <-b.oldestQ:
			s, ok := b.oldest()
			q <- stuckAnswer{s, ok}
		case <-idle.C:
			b.idleArmed = false
			b.idleFired()
		case <-check.C():
			check.fired()
			b.tick()
		case <-b.done:
			return b.stopErr(ctx)
		case <-ctx.Done():
			return b.stopErr(ctx)
		}
		b.takeHandedOver()
		b.step()
		if !b.idleArmed && b.state == batchOpen && b.commitAt == 0 && b.seq > 0 {
			// Only a batch left open needs the idle commit: one committed
			// by its last message is answered anyway.
			b.idleArmed, b.idleAt = true, b.sends
			idle.Reset(b.idle)
		}
		check.arm(b.nextCheck())
	}
}

// takeHandedOver queues what was handed over, when a batch may take it, so
// that the next batch is sized by the whole queue.
func (b *Batch) takeHandedOver() {
	for b.state == batchIdle || b.state == batchOpen {
		select {
		case a := <-b.in:
			b.enqueue(a)
		default:
			return
		}
	}
}

// enqueue appends a handed-over message to the queue.
func (b *Batch) enqueue(a admitted) {
	var pd *bpending
	if n := len(b.free); n > 0 {
		pd = b.free[n-1]
		b.free[n-1] = nil
		b.free = b.free[:n-1]
	} else {
		pd = &bpending{}
	}
	pd.m, pd.size, pd.first = a.m, a.size, a.first
	b.queue = append(b.queue, pd)
}

// step does what the state allows after an event: ask a failed batch for
// its count, hand the isolated message over, send what the current batch
// may take. Each case leaves a state the previous ones do not act on
// again, so the loop ends.
func (b *Batch) step() {
	for b.closedErr() == nil {
		switch {
		case b.state == batchEnding && b.failed != nil && b.eob == 0:
			b.commit()
		case b.state == batchIsolating && b.loneHanded < b.lone:
			b.sendIsolated()
			return
		case (b.state == batchIdle || b.state == batchOpen) && b.head+b.sent < len(b.queue):
			b.pump()
			if b.state != batchEnding || b.failed == nil || b.eob != 0 {
				return
			}
		default:
			return
		}
	}
}

// pump sends the queued messages the current batch may take.
func (b *Batch) pump() {
	for (b.state == batchIdle || b.state == batchOpen) && b.head+b.sent < len(b.queue) {
		if !b.sendOne() {
			return
		}
	}
}

// startBatch opens a new batch for the queued messages.
func (b *Batch) startBatch() {
	b.ids++
	b.id = b.idBase + strconv.FormatUint(b.ids, 36)
	b.seq, b.acked, b.eob, b.failed = 0, 0, 0, nil
	b.state = batchOpen
	b.lastAck = time.Now()
	b.subject = b.queue[b.head+b.sent].m.Subject
	// A short queue (what arrived while the previous batch was answered,
	// at moderate load) goes as a batch committed by its last message: no
	// idle wait, no separate commit, and for a single message one answer
	// instead of three. A longer one opens a batch that stays open while
	// messages keep coming.
	b.commitAt = 0
	if k := len(b.queue) - b.head - b.sent; k <= shortBatch {
		b.commitAt = uint64(k)
	}
}

// sendOne sends the next queued message in the current batch, starting one
// if none is open. It reports false when the message could not be sent.
func (b *Batch) sendOne() bool {
	if b.state == batchIdle {
		b.startBatch()
	}
	pd := b.queue[b.head+b.sent]
	b.sent++
	b.seq++
	pd.bseq = b.seq
	op := opAppend
	switch {
	case b.seq == b.commitAt:
		op = opCommit
		b.state = batchEnding
		b.eob = b.seq
		b.endBy = time.Now().Add(b.cfg.AckTimeout)
	case b.seq == 1:
		op = opStart
	}
	b.reply = b.replySubject(b.reply[:0], b.seq, op)
	m := pd.m
	msg := nats.Msg{Subject: m.Subject, Reply: string(b.reply), Header: b.wire.fill(m.Header), Data: m.Data}
	err := b.nc.PublishMsg(&msg)
	b.wire.release()
	b.sends++
	if err == nil {
		return true
	}
	if errors.Is(err, nats.ErrConnectionClosed) {
		b.close(fmt.Errorf("%w: nats connection closed", ErrClosed))
		return false
	}
	// Not on the wire (and nothing after it): the batch ends before it.
	pd.bseq = 0
	b.sent--
	if b.eob == b.seq {
		b.eob = 0 // the batch of one's commit did not leave either
	}
	b.seq--
	b.failBatch(fmt.Errorf("publish to %s: %w", m.Subject, err))
	return false
}

// replySubject appends the reply subject of batch sequence seq.
func (b *Batch) replySubject(dst []byte, seq uint64, op string) []byte {
	dst = append(dst, b.prefix...)
	dst = append(dst, b.id...)
	dst = append(dst, '.')
	dst = append(dst, b.flow...)
	dst = append(dst, ".fail."...)
	dst = strconv.AppendUint(dst, seq, 10)
	dst = append(dst, '.')
	dst = append(dst, op...)
	return append(dst, ".$FI"...)
}

// failBatch records the current batch's first failure and stops sending;
// step then asks the server for the count it stored.
func (b *Batch) failBatch(err error) {
	if b.failed == nil {
		b.failed = err
	}
	if b.state == batchOpen {
		b.state = batchEnding
		b.endBy = time.Now().Add(min(b.cfg.AckTimeout, 2*time.Second))
	}
}

// commit ends the current batch with an end-of-batch commit unless it has
// one already. The server answers with a PubAck counting the messages it
// stored.
func (b *Batch) commit() {
	if (b.state != batchOpen && b.state != batchEnding) || b.eob != 0 {
		return
	}
	if b.seq == 0 {
		// Nothing of this batch reached the server: no answer comes.
		b.finish(0)
		return
	}
	if b.state == batchOpen {
		b.state = batchEnding
		b.endBy = time.Now().Add(b.cfg.AckTimeout)
	}
	b.eob = b.seq + 1
	err := b.nc.PublishMsg(&nats.Msg{Subject: b.subject, Reply: string(b.replySubject(nil, b.eob, opCommitEOB))})
	if err != nil {
		b.failBatch(fmt.Errorf("commit batch: %w", err))
		b.finishUnanswered()
	}
}

// batchReply is any answer of the server to a fast-ingest batch: a flow
// ack {"type":"ack","seq":N,"msgs":M}, a gap or error report
// {"type":"gap"|"err",...}, or a PubAck ending the batch (with "batch" and
// "count") or refusing a message ({"error":...}).
type batchReply struct {
	Type   string              `json:"type"`
	Seq    uint64              `json:"seq"`
	Stream string              `json:"stream"`
	Batch  string              `json:"batch"`
	Count  uint64              `json:"count"`
	Error  *jetstream.APIError `json:"error"`
}

// batchAnswer is a decoded answer: the batch and sequence its subject
// names, and its body.
type batchAnswer struct {
	id           string
	seq          uint64
	noResponders bool
	r            batchReply
	data         []byte
}

// parseReplySubject returns the batch id and sequence a reply subject names.
func (b *Batch) parseReplySubject(subj string) (id string, seq uint64, ok bool) {
	rest, ok := strings.CutPrefix(subj, b.prefix)
	if !ok {
		return "", 0, false
	}
	rest, ok = strings.CutSuffix(rest, ".$FI")
	if !ok {
		return "", 0, false
	}
	// id.flow.fail.seq.op, cut without a slice of parts: one answer per
	// event at moderate rates.
	var tok [4]string
	for k := range 4 {
		if tok[k], rest, ok = strings.Cut(rest, "."); !ok {
			return "", 0, false
		}
	}
	if strings.IndexByte(rest, '.') >= 0 {
		return "", 0, false
	}
	seq, err := strconv.ParseUint(tok[3], 10, 64)
	if err != nil {
		return "", 0, false
	}
	return tok[0], seq, true
}

// onReply decodes an answer and acts on it.
func (b *Batch) onReply(msg *nats.Msg) {
	id, seq, ok := b.parseReplySubject(msg.Subject)
	if !ok {
		return
	}
	a := batchAnswer{id: id, seq: seq, data: msg.Data}
	a.noResponders = len(msg.Data) == 0 && msg.Header.Get("Status") == "503"
	if !a.noResponders && !parseBatchReply(msg.Data, &a.r, b.stream, b.id) {
		if err := json.Unmarshal(msg.Data, &a.r); err != nil {
			a.r = batchReply{Type: "err", Seq: seq, Error: &jetstream.APIError{Description: "unreadable answer: " + err.Error()}}
		}
	}
	b.answer(a)
}

// answer acts on the server's answer to the current batch.
func (b *Batch) answer(a batchAnswer) {
	if a.id != b.id || (b.state != batchOpen && b.state != batchEnding) {
		b.lateAnswer(a)
		return
	}
	r, seq := a.r, a.seq
	switch {
	case a.noResponders:
		b.failBatch(&PublishError{Subject: b.subjectAt(seq), Class: ClassNoResponders, Err: ErrTransient})
		// Nothing reached a stream: no final answer comes.
		b.finish(b.acked)
	case r.Type == "ack" && r.Seq > b.seq:
		// Never confirm what was not sent: this answer is not about
		// this batch's messages.
		b.failBatch(fmt.Errorf("%w: batch ack for %d of %d sent", ErrTransient, r.Seq, b.seq))
	case r.Type == "ack":
		// A flow ack names no stream, and anything subscribed to the
		// subjects can answer in its shape: it says the server is alive,
		// it settles nothing. The batch's final PubAck, which must name
		// the stream (pubAckAnswer), settles what it counts; a batch
		// left open is committed once the window is full and sends stop
		// (idleFired), so that costs one commit per window.
		b.lastAck = time.Now()
	case r.Type == "gap":
		b.failBatch(fmt.Errorf("%w: batch gap at %d", ErrTransient, r.Seq))
	case r.Type == "err":
		b.failBatch(b.apiFailure(r.Seq, r.Error))
	case r.Error != nil:
		b.refused(seq, r.Error)
	default:
		b.pubAckAnswer(seq, r, a.data)
	}
}

// refused acts on a PubAck refusing message seq of the current batch.
func (b *Batch) refused(seq uint64, api *jetstream.APIError) {
	if api.ErrorCode == errCodeBatchDisabled {
		b.close(fmt.Errorf("%w: stream %s: set allow_batched on it, or publish per key (nats.batch_publish: off)", ErrBatchDisabled, b.stream))
		return
	}
	b.failBatch(b.apiFailure(seq, api))
	if seq == 1 || seq == b.eob || api.ErrorCode == errCodeBatchUnknown || api.ErrorCode == errCodeNotLeader {
		// The server dropped the batch (its first message failed, or it is
		// unknown here): no final answer comes.
		b.finish(b.acked)
	}
}

// pubAckAnswer acts on a PubAck without an error: the batch's final answer,
// or a lone publish's ack from a server that does not know batches.
func (b *Batch) pubAckAnswer(seq uint64, r batchReply, data []byte) {
	switch {
	case (r.Batch != "" || r.Stream != "") && r.Stream != b.stream:
		// Not the stream's answer: nothing is known to be stored.
		b.log.Warn("bad batch ack: the answer names another stream; failing the batch (is something other than JetStream answering on the subjects?)",
			zap.String("want_stream", b.stream), zap.String("acked_by_stream", r.Stream), zap.String("batch", r.Batch))
		b.failBatch(&PublishError{Subject: b.subjectAt(seq), Class: ClassBadAck, Err: fmt.Errorf("%w: batch answer from stream %q, want %q", ErrTransient, r.Stream, b.stream)})
		b.finishUnanswered()
	case r.Batch != "" && (r.Batch != b.id || r.Count > b.seq):
		b.failBatch(fmt.Errorf("%w: batch %s committed with %d messages, %d sent in batch %s", ErrTransient, r.Batch, r.Count, b.seq, b.id))
		b.finishUnanswered()
	case r.Batch != "":
		// The batch's final PubAck: Count messages are stored.
		b.finish(r.Count)
	case r.Stream != "":
		// A plain PubAck: the server took the message as a lone publish,
		// so it does not know fast-ingest batches, and pipelined lone
		// publishes could be reordered by a failure.
		b.close(fmt.Errorf("%w: the server answered a batch message with a plain ack (fast-ingest batches need nats-server 2.14 or later)", ErrBatchDisabled))
	default:
		b.failBatch(fmt.Errorf("%w: unexpected batch answer %q", ErrTransient, data))
	}
}

// JetStream error codes of fast-ingest batches.
const (
	errCodeBatchDisabled = 10205
	errCodeBatchUnknown  = 10208
	errCodeNotLeader     = 10009
)

func (b *Batch) apiFailure(seq uint64, api *jetstream.APIError) error {
	if api == nil {
		return fmt.Errorf("%w: batch error without details at %d", ErrTransient, seq)
	}
	return classifyAPIError(b.subjectAt(seq), api)
}

// subjectAt returns the subject of the current batch's message seq.
func (b *Batch) subjectAt(seq uint64) string {
	if seq >= 1 && seq <= b.seq {
		if i := b.head + int(seq-b.acked) - 1; i >= b.head && i < len(b.queue) && b.queue[i].bseq == seq {
			return b.queue[i].m.Subject
		}
	}
	return b.stream
}

// ack settles the current batch's messages up to batch sequence n.
func (b *Batch) ack(n uint64) {
	if n <= b.acked || n > b.seq {
		return
	}
	b.acked = n
	b.lastAck = time.Now()
	for b.head < len(b.queue) && b.sent > 0 {
		pd := b.queue[b.head]
		if pd.bseq == 0 || pd.bseq > n {
			break
		}
		b.queue[b.head] = nil
		b.head++
		b.sent--
		b.settle(pd, Result{Ack: b.pubAck, Attempts: 1})
	}
	b.queue, b.head = compactFront(b.queue, b.head)
}

// settle calls pd's Done and frees its capacity.
func (b *Batch) settle(pd *bpending, res Result) {
	b.obs.Published(pd.m.Subject, false, time.Since(pd.first))
	settled(pd.m, res)
	b.release(pd.size)
	if pd.handed {
		// The per-key publisher still holds its copy and will report it.
		pd.settled = true
		return
	}
	b.recycle(pd)
}

// recycle keeps a settled pending for reuse.
func (b *Batch) recycle(pd *bpending) {
	if len(b.free) < b.cfg.MaxInFlight {
		*pd = bpending{}
		b.free = append(b.free, pd)
	}
}

// finishUnanswered ends the current batch without its final answer (no
// answer in time, or none to trust), with what flow acks confirmed.
func (b *Batch) finishUnanswered() { b.finish(b.acked) }

// finish ends the current batch with its first n messages stored: the rest
// are sent again.
//
// After a failure, answered or not, every message it sent beyond n (at
// least the first queued one) goes alone through the per-key publisher
// before batching resumes: the stream's leader may still hold some as
// proposals not yet committed (it answered the failure of one while later
// ones were on their way, or its answers were lost), and a new batch
// reaching it would skip each as a duplicate "in process" (10158) and
// count it as stored, though the leader may yet lose it. A lone publish of
// such a message is answered with that error instead, and retried until
// the proposal is stored (a duplicate ack) or lost (stored anew). They go
// together, as the per-key publisher sends any messages: one in flight
// per key, keys side by side, so each aggregate keeps its order and the
// failed window drains at per-key speed, not one round trip per message.
func (b *Batch) finish(n uint64) {
	b.ack(n)
	lone := max(1, b.sent)
	for i := b.head; i < b.head+b.sent; i++ {
		pd := b.queue[i]
		pd.lateSeq, pd.bseq = pd.bseq, 0
	}
	b.sent = 0
	b.lateID, b.lateSent = b.id, b.seq
	b.id = ""
	if b.failed == nil {
		b.failures = 0
		b.state = batchIdle
		b.lateID = ""
		return
	}
	b.failures++
	if b.failures == 1 || b.failures%100 == 0 {
		b.log.Warn("fast-ingest batch failed; the messages it sent and the server did not confirm go alone, then batching resumes",
			zap.Int("failures_in_a_row", b.failures), zap.Int("alone", min(lone, len(b.queue)-b.head)), zap.Error(b.failed))
	}
	b.obs.Retried(failureClass(b.failed))
	if b.head == len(b.queue) {
		b.state = batchIdle
		b.lateID = ""
		return
	}
	b.state = batchIsolating
	b.lone, b.loneHanded = min(lone, len(b.queue)-b.head), 0
}

func failureClass(err error) string {
	var pe *PublishError
	if errors.As(err, &pe) {
		return pe.Class
	}
	return ClassBatch
}

// sendIsolated hands the messages that go alone to the per-key publisher,
// as many as its window takes; the next tick or result hands the rest.
func (b *Batch) sendIsolated() {
	for b.loneHanded < b.lone {
		pd := b.queue[b.head+b.loneHanded]
		pd.alone = *pd.m
		// Its result comes back to Run; its dead-letter record stays its
		// own owner's.
		done := func(res Result) { b.isoDone <- loneResult{pd, res} }
		pd.alone.Owner = OwnerFuncs{Done: done}
		if dl := deadLetterer(pd.m); dl != nil {
			pd.alone.Owner = DeadLetterFuncs{Done: done, Record: dl.DeadLetter}
		}
		ok, err := b.keyed.TryPublish(&pd.alone)
		if err != nil {
			b.close(err)
			return
		}
		if !ok {
			return
		}
		pd.handed = true
		b.loneHanded++
	}
}

// isolatedSettled records a lone message's result and settles the queue's
// head as far as the messages gone alone are settled; once all are, the
// next batch may start.
func (b *Batch) isolatedSettled(r loneResult) {
	pd := r.pd
	pd.handed = false
	if pd.settled {
		// Its batch's late answer settled it already.
		b.recycle(pd)
		return
	}
	if !pd.loneDone {
		pd.loneDone, pd.res = true, r.res
	}
	b.settleLone()
}

// settleLone settles the queue's head as far as the messages gone alone
// are settled; once all are, the next batch may start.
func (b *Batch) settleLone() {
	for b.lone > 0 && b.queue[b.head].loneDone {
		pd := b.queue[b.head]
		b.queue[b.head] = nil
		b.head++
		b.lone--
		if b.loneHanded > 0 {
			b.loneHanded-- // handed from the front: the head was
		}
		b.settle(pd, pd.res)
	}
	b.queue, b.head = compactFront(b.queue, b.head)
	if b.lone == 0 {
		b.state = batchIdle
		b.lateID = ""
	}
}

// lateAnswer acts on an answer for a batch that has already ended. The
// final answer of the failed batch whose messages are going alone, if it
// names the stream and that batch and counts no more than it sent, says
// its first Count messages are stored, in order: they settle now, whether
// they still wait to go alone or are with the per-key publisher (whose
// re-send the stream then reports as a duplicate). Without this, on a link
// or broker slower than AckTimeout every batch ended unanswered and every
// message waited for its lone publish, one round trip per message of a
// key: a backlog offered faster than that never drained. Anything else
// late (flow acks, failures of a batch already failed) means nothing.
func (b *Batch) lateAnswer(a batchAnswer) {
	r := a.r
	if b.state != batchIsolating || b.lateID == "" || a.id != b.lateID || a.noResponders ||
		r.Type != "" || r.Error != nil || r.Batch != b.lateID || r.Stream != b.stream || r.Count > b.lateSent {
		return
	}
	for i := b.head; i < b.head+b.lone; i++ {
		pd := b.queue[i]
		if pd.lateSeq == 0 || pd.lateSeq > r.Count {
			break
		}
		if !pd.loneDone {
			pd.loneDone, pd.res = true, Result{Ack: b.pubAck, Attempts: 1}
		}
	}
	b.settleLone()
}

// nextCheck returns when tick has something to look at: the current
// batch's answer deadline, or soon while messages wait to go alone (the
// per-key publisher's window was full); zero when there is nothing.
func (b *Batch) nextCheck() time.Time {
	switch {
	case b.state == batchOpen && b.sent > 0:
		at := b.lastAck
		if first := b.queue[b.head].first; first.After(at) {
			at = first
		}
		return at.Add(b.cfg.AckTimeout)
	case b.state == batchEnding:
		return b.endBy
	case b.state == batchIsolating && b.loneHanded < b.lone:
		return time.Now()
	}
	return time.Time{}
}

// tick fails a batch whose answers are overdue.
func (b *Batch) tick() {
	now := time.Now()
	switch {
	case b.state == batchOpen && b.sent > 0 && now.Sub(b.lastAck) > b.cfg.AckTimeout && now.Sub(b.queue[b.head].first) > b.cfg.AckTimeout:
		b.failBatch(&PublishError{Subject: b.stream, Class: ClassTimeout, Err: fmt.Errorf("%w: no batch ack within %s", ErrTransient, b.cfg.AckTimeout)})
		// Ask for the count; a silent server gets endBy.
	case b.state == batchEnding && now.After(b.endBy):
		b.failBatch(&PublishError{Subject: b.stream, Class: ClassTimeout, Err: fmt.Errorf("%w: no final batch answer", ErrTransient)})
		b.finishUnanswered()
	}
}

// idleFired commits the open batch once no message was sent for the idle
// interval: the server acknowledges a batch's last messages only then.
// Even a batch whose messages flow acks all confirmed is committed: the
// server abandons a batch that receives nothing for its max batch timeout
// (10 s by default), and the next message would find it gone ("batch
// unknown", 10208) and fail. A send since the timer was armed makes Run
// arm it again.
func (b *Batch) idleFired() {
	if b.sends == b.idleAt && b.state == batchOpen && b.seq > 0 && b.head+b.sent == len(b.queue) {
		b.commit()
	}
}

// Oldest returns the oldest unsettled message of the batch publisher, and
// false when there is none or Run has returned; Attempts counts the
// batches that failed in a row. It is the one holding the watermark when
// events are batched.
func (b *Batch) Oldest() (Stuck, bool) { return askOldest(b.oldestQ, b.stopped) }

// oldest is Oldest on the Run goroutine.
func (b *Batch) oldest() (Stuck, bool) {
	if b.head == len(b.queue) {
		return Stuck{}, false
	}
	pd := b.queue[b.head]
	return Stuck{Key: pd.m.Key, Subject: pd.m.Subject, Since: pd.first, Attempts: b.failures}, true
}

// Close stops Run and unsubscribes from acks. Unsettled messages stay
// unsettled: the watermark never passes them, so they are re-sent after a
// restart.
func (b *Batch) Close() error {
	b.close(ErrClosed)
	return b.sub.Unsubscribe()
}
