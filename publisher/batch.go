package publisher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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
// A batch is one ordered, flow-controlled publishing session in "gap: fail"
// mode: the server acknowledges every few hundred messages, and an
// acknowledgement of batch sequence N means every message up to N is
// stored, in order. A message that fails ends the batch where it failed:
// the server stores nothing after it. So order holds for every message,
// not only per key, and a hot aggregate is not limited to one round trip
// per event, while the server answers once per few hundred messages
// instead of once per message (less CPU on both sides).
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
// AckTimeout), every message the server has not confirmed is sent again in
// order, starting with the first one alone through the per-key publisher,
// which retries, classifies and dead-letters it as it does any message.
// Once it settles the next batch starts behind it; messages the failed
// batch did store after all are reported as duplicates by the stream
// (Nats-Msg-Id) and skipped. The per-key publisher also carries the
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

	// sendMu serialises sending: batch sequence order must be wire order,
	// and a commit must follow the batch's last message.
	sendMu sync.Mutex

	window
	queue []*bpending // unsettled, in publish order, from head
	free  []*bpending // settled, for reuse
	// ack is what Result.Ack points to: fast-ingest acks carry no
	// per-message stream sequence, so it names the stream only.
	pubAck jetstream.PubAck
	head   int
	sent   int // queue[head:head+sent] were sent in the current batch
	state  batchState
	id     string // current batch id
	// subject is the current batch's first subject: its commit goes to
	// the same stream.
	subject string
	ids     uint64
	seq     uint64 // last batch sequence sent in the current batch
	acked   uint64 // every message of the current batch up to it is stored
	eob     uint64 // batch sequence of the commit, 0 before it is sent
	// commitAt is the batch sequence whose message commits the batch, 0
	// for a batch committed after a lull.
	commitAt uint64
	// failed is the first failure reported in the current batch.
	failed  error
	lastAck time.Time // last ack of the current batch, or its start
	endBy   time.Time // deadline for the final answer once ending
	iso     Message   // the message isolated after a failure, with Done = isoDone
	isoSent bool      // iso is with the per-key publisher
	isoDone func(Result)
	// isoRest counts the messages still to go alone after iso, the rest of
	// a batch that ended without its final answer (finishUnanswered sets
	// it to -1 for finish to fill in).
	isoRest  int
	failures int // consecutive failed batches, for logging

	lastSend  atomic.Int64 // counts sends, so the flusher sees a lull
	flushIdle atomic.Bool  // the flusher waits for a kick
	kick      chan struct{}
}

type batchState int

const (
	batchIdle      batchState = iota // no batch: the next send starts one
	batchOpen                        // sending
	batchEnding                      // committing or failed: waiting for the final answer
	batchIsolating                   // the first unconfirmed message is with the per-key publisher
)

// bpending is one message on its way through a Batch.
type bpending struct {
	m     *Message
	size  int
	bseq  uint64 // batch sequence in the current batch; 0 when not sent in it
	first time.Time
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
// keyed (which must be running). Run must be running for the idle commit,
// timeouts and failure handling to happen.
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
	// The options are the per-key publisher's; apply them to one to read
	// the logger and observer.
	o := &Publisher{log: zap.NewNop(), obs: nopObserver{}}
	for _, opt := range opts {
		opt(o)
	}
	b := &Batch{
		cfg:    cfg,
		nc:     nc,
		keyed:  keyed,
		log:    o.log,
		obs:    o.obs,
		idle:   bcfg.IdleCommit,
		flow:   strconv.Itoa(bcfg.AckEvery),
		stream: bcfg.Stream,
		pubAck: jetstream.PubAck{Stream: bcfg.Stream},
		window: newWindow(cfg),
		kick:   make(chan struct{}, 1),
	}
	b.isoDone = b.isolatedSettled
	b.flushIdle.Store(true)
	var err error
	if b.prefix, b.sub, err = subscribeAcks(nc, ">", b.onReply); err != nil {
		return nil, err
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

// TryPublish queues m if the window has room and reports whether it did.
// Messages are stored in the order they are handed over.
func (b *Batch) TryPublish(m *Message) (bool, error) {
	size := msgSize(m)
	b.mu.Lock()
	if ok, err := b.admit(size); !ok {
		b.mu.Unlock()
		return false, err
	}
	var pd *bpending
	if n := len(b.free); n > 0 {
		pd = b.free[n-1]
		b.free[n-1] = nil
		b.free = b.free[:n-1]
	} else {
		pd = &bpending{}
	}
	pd.m, pd.size, pd.first = m, size, time.Now()
	b.queue = append(b.queue, pd)
	b.mu.Unlock()
	b.pump()
	return true, nil
}

// pump sends the queued messages the current batch may take.
func (b *Batch) pump() {
	var reply []byte
	for {
		more, failed := b.sendOne(&reply)
		if failed {
			b.commitIfFailed()
			b.afterFinish()
			return
		}
		if !more {
			return
		}
	}
}

// sendOne sends the next queued message if the current batch may take it.
// It reports whether it sent one, and whether the batch failed.
func (b *Batch) sendOne(reply *[]byte) (sent, failed bool) {
	b.sendMu.Lock()
	defer b.sendMu.Unlock()
	b.mu.Lock()
	if b.closed != nil || (b.state != batchIdle && b.state != batchOpen) || b.head+b.sent == len(b.queue) {
		b.mu.Unlock()
		return false, false
	}
	if b.state == batchIdle {
		b.ids++
		b.id = b.idBase + strconv.FormatUint(b.ids, 36)
		b.seq, b.acked, b.eob, b.failed = 0, 0, 0, nil
		b.state = batchOpen
		b.lastAck = time.Now()
		b.subject = b.queue[b.head+b.sent].m.Subject
		// A short queue (what arrived while the previous batch was
		// answered, at moderate load) goes as a batch committed by its
		// last message: no idle wait, no separate commit, and for a
		// single message one answer instead of three. A longer one opens
		// a batch that stays open while messages keep coming.
		b.commitAt = 0
		if k := len(b.queue) - b.head - b.sent; k <= shortBatch {
			b.commitAt = uint64(k)
		}
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
	*reply = b.reply((*reply)[:0], b.seq, op)
	m, id, seq := pd.m, b.id, b.seq
	// Only a batch left open needs the flusher: one committed by its last
	// message is answered anyway.
	open := b.commitAt == 0
	b.mu.Unlock()

	msg := nats.Msg{Subject: m.Subject, Reply: string(*reply), Header: m.Header, Data: m.Data}
	err := b.nc.PublishMsg(&msg)
	b.lastSend.Add(1)
	if open && b.flushIdle.CompareAndSwap(true, false) {
		select {
		case b.kick <- struct{}{}:
		default:
		}
	}
	if err == nil {
		return true, false
	}
	if errors.Is(err, nats.ErrConnectionClosed) {
		b.close(fmt.Errorf("%w: nats connection closed", ErrClosed))
		return false, false
	}
	// Not on the wire (and, sendMu held, nothing after it): the batch ends
	// before it, unless an answer ended the batch meanwhile (then pd is
	// unsent already).
	b.mu.Lock()
	if b.id != id || pd.bseq != seq {
		b.mu.Unlock()
		return false, false
	}
	pd.bseq = 0
	b.sent--
	if b.eob == b.seq {
		b.eob = 0 // the batch of one's commit did not leave either
	}
	b.seq--
	b.failBatch(fmt.Errorf("publish to %s: %w", m.Subject, err))
	b.mu.Unlock()
	return false, true
}

// reply appends the reply subject of batch sequence seq; b.mu is held.
func (b *Batch) reply(dst []byte, seq uint64, op string) []byte {
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
// b.mu is held. commitIfFailed then asks the server for the count it
// stored.
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
	b.sendMu.Lock()
	b.mu.Lock()
	if (b.state != batchOpen && b.state != batchEnding) || b.eob != 0 {
		b.mu.Unlock()
		b.sendMu.Unlock()
		return
	}
	if b.seq == 0 {
		// Nothing of this batch reached the server: no answer comes.
		b.finish(0)
		b.mu.Unlock()
		b.sendMu.Unlock()
		b.afterFinish()
		return
	}
	if b.state == batchOpen {
		b.state = batchEnding
		b.endBy = time.Now().Add(b.cfg.AckTimeout)
	}
	b.eob = b.seq + 1
	id := b.id
	reply := string(b.reply(nil, b.eob, opCommitEOB))
	subject := b.subject
	b.mu.Unlock()
	err := b.nc.PublishMsg(&nats.Msg{Subject: subject, Reply: reply})
	b.sendMu.Unlock()
	if err == nil {
		return
	}
	b.mu.Lock()
	if b.id == id && b.state == batchEnding {
		b.failBatch(fmt.Errorf("commit batch: %w", err))
		b.finishUnanswered()
	}
	b.mu.Unlock()
	b.afterFinish()
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
	parts := strings.Split(rest, ".")
	if len(parts) != 5 {
		return "", 0, false
	}
	seq, err := strconv.ParseUint(parts[3], 10, 64)
	if err != nil {
		return "", 0, false
	}
	return parts[0], seq, true
}

func (b *Batch) onReply(msg *nats.Msg) {
	id, seq, ok := b.parseReplySubject(msg.Subject)
	if !ok {
		return
	}
	var r batchReply
	noResponders := len(msg.Data) == 0 && msg.Header.Get("Status") == "503"
	if !noResponders {
		if err := json.Unmarshal(msg.Data, &r); err != nil {
			r = batchReply{Type: "err", Seq: seq, Error: &jetstream.APIError{Description: "unreadable answer: " + err.Error()}}
		}
	}
	b.mu.Lock()
	if id != b.id || (b.state != batchOpen && b.state != batchEnding) {
		b.mu.Unlock()
		return // an earlier batch's late answer
	}
	switch {
	case noResponders:
		b.failBatch(&PublishError{Subject: b.subjectAt(seq), Class: "no_responders", Err: ErrTransient})
		// Nothing reached a stream: no final answer comes.
		b.finish(b.acked)
	case r.Type == "ack" && r.Seq > b.seq:
		// Never confirm what was not sent: this answer is not about
		// this batch's messages.
		b.failBatch(fmt.Errorf("%w: batch ack for %d of %d sent", ErrTransient, r.Seq, b.seq))
	case r.Type == "ack":
		b.ack(r.Seq)
	case r.Type == "gap":
		b.failBatch(fmt.Errorf("%w: batch gap at %d", ErrTransient, r.Seq))
	case r.Type == "err":
		b.failBatch(b.apiFailure(r.Seq, r.Error))
	case r.Error != nil:
		if r.Error.ErrorCode == errCodeBatchDisabled {
			b.mu.Unlock()
			b.close(fmt.Errorf("%w: stream %s: set allow_batched on it, or publish per key (nats.batch_publish: off)", ErrBatchDisabled, b.stream))
			return
		}
		b.failBatch(b.apiFailure(seq, r.Error))
		if seq == 1 || seq == b.eob || r.Error.ErrorCode == errCodeBatchUnknown || r.Error.ErrorCode == errCodeNotLeader {
			// The server dropped the batch (its first message failed, or
			// it is unknown here): no final answer comes.
			b.finish(b.acked)
		}
	case (r.Batch != "" || r.Stream != "") && r.Stream != b.stream:
		// Not the stream's answer: nothing is known to be stored.
		b.log.Warn("bad batch ack: the answer names another stream; failing the batch (is something other than JetStream answering on the subjects?)",
			zap.String("want_stream", b.stream), zap.String("acked_by_stream", r.Stream), zap.String("batch", r.Batch))
		b.failBatch(&PublishError{Subject: b.subjectAt(seq), Class: "bad_ack", Err: fmt.Errorf("%w: batch answer from stream %q, want %q", ErrTransient, r.Stream, b.stream)})
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
		b.mu.Unlock()
		b.close(fmt.Errorf("%w: the server answered a batch message with a plain ack (fast-ingest batches need nats-server 2.14 or later)", ErrBatchDisabled))
		return
	default:
		b.failBatch(fmt.Errorf("%w: unexpected batch answer %q", ErrTransient, msg.Data))
	}
	b.mu.Unlock()
	b.afterFinish()
	b.commitIfFailed()
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

// subjectAt returns the subject of the current batch's message seq; b.mu is
// held.
func (b *Batch) subjectAt(seq uint64) string {
	if seq >= 1 && seq <= b.seq {
		if i := b.head + int(seq-b.acked) - 1; i >= b.head && i < len(b.queue) && b.queue[i].bseq == seq {
			return b.queue[i].m.Subject
		}
	}
	return b.stream
}

// ack settles the current batch's messages up to batch sequence n; b.mu is
// held, also while Done runs (Done must not block).
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
		b.settleLocked(pd, Result{Ack: &b.pubAck, Attempts: 1})
	}
	b.queue, b.head = compactFront(b.queue, b.head)
}

// settleLocked frees pd's capacity and calls its Done; b.mu is held.
func (b *Batch) settleLocked(pd *bpending, res Result) {
	b.release(pd.size)
	b.obs.Published(pd.m.Subject, false, time.Since(pd.first))
	if done := pd.m.Done; done != nil {
		done(res)
	}
	if len(b.free) < b.cfg.MaxInFlight {
		*pd = bpending{}
		b.free = append(b.free, pd)
	}
}

// finishUnanswered ends the current batch without its final answer (no
// answer in time, or none to trust), with what flow acks confirmed; b.mu is
// held. Every message it sent beyond that then goes alone through the
// per-key publisher before batching resumes: the server may still hold
// them as proposals not yet committed, and a new batch reaching the same
// leader would skip each as a duplicate "in process" (10158) and count it
// as stored, though the leader may yet lose it. A lone publish of such a
// message is answered with that error instead, and retried until the
// proposal is stored (a duplicate ack) or lost (stored anew).
func (b *Batch) finishUnanswered() {
	b.isoRest = -1
	b.finish(b.acked)
}

// finish ends the current batch with its first n messages stored: the rest
// are sent again; b.mu is held.
func (b *Batch) finish(n uint64) {
	b.ack(n)
	unanswered := b.isoRest < 0
	b.isoRest = 0
	if unanswered && b.sent > 1 {
		// The first goes as iso; these follow it alone.
		b.isoRest = b.sent - 1
	}
	for i := b.head; i < b.head+b.sent; i++ {
		b.queue[i].bseq = 0
	}
	b.sent = 0
	b.id = ""
	if b.failed == nil {
		b.failures = 0
		b.state = batchIdle
		return
	}
	b.failures++
	if b.failures == 1 || b.failures%100 == 0 {
		b.log.Warn("fast-ingest batch failed; its first unconfirmed message goes alone, then batching resumes",
			zap.Int("failures_in_a_row", b.failures), zap.Error(b.failed))
	}
	b.obs.Retried(failureClass(b.failed))
	if b.head == len(b.queue) {
		b.state = batchIdle
		return
	}
	b.isolate()
}

// isolate hands the first queued message to the per-key publisher next;
// b.mu is held.
func (b *Batch) isolate() {
	b.state = batchIsolating
	b.isoSent = false
	pd := b.queue[b.head]
	b.iso = *pd.m
	b.iso.Done = b.isoDone
}

func failureClass(err error) string {
	var pe *PublishError
	if errors.As(err, &pe) {
		return pe.Class
	}
	return "batch"
}

// afterFinish starts what follows a finished batch: the isolated message,
// or the next batch.
func (b *Batch) afterFinish() {
	b.mu.Lock()
	state, isoSent, closed := b.state, b.isoSent, b.closed
	b.mu.Unlock()
	switch {
	case closed != nil:
	case state == batchIsolating && !isoSent:
		b.sendIsolated()
	case state == batchIdle:
		b.pump()
	}
}

// commitIfFailed sends the commit of a failed batch, so that the server
// answers with what it stored.
func (b *Batch) commitIfFailed() {
	b.mu.Lock()
	need := b.state == batchEnding && b.failed != nil && b.eob == 0
	b.mu.Unlock()
	if need {
		b.commit()
	}
}

// sendIsolated hands the first unconfirmed message to the per-key
// publisher; when its window is full, Run tries again.
func (b *Batch) sendIsolated() {
	b.mu.Lock()
	if b.state != batchIsolating || b.isoSent {
		b.mu.Unlock()
		return
	}
	b.isoSent = true
	b.mu.Unlock()
	ok, err := b.keyed.TryPublish(&b.iso)
	if ok && err == nil {
		return
	}
	b.mu.Lock()
	b.isoSent = false
	b.mu.Unlock()
	if err != nil {
		b.close(err)
	}
}

// isolatedSettled is the isolated message's Done.
func (b *Batch) isolatedSettled(res Result) {
	b.mu.Lock()
	pd := b.queue[b.head]
	b.queue[b.head] = nil
	b.head++
	b.queue, b.head = compactFront(b.queue, b.head)
	b.state = batchIdle
	b.isoSent = false
	b.iso = Message{}
	b.settleLocked(pd, res)
	if b.isoRest > 0 && b.head < len(b.queue) && b.closed == nil {
		// The rest of a batch that ended unanswered goes alone too.
		b.isoRest--
		b.isolate()
		b.mu.Unlock()
		b.sendIsolated()
		return
	}
	b.isoRest = 0
	b.mu.Unlock()
	b.pump()
}

// Run commits batches after a lull and handles timeouts until ctx ends.
// It returns the reason the publisher closed, or ctx's error.
func (b *Batch) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		b.flushLoop(ctx)
	}()
	defer wg.Wait()
	return b.ticks(ctx, b.tick)
}

func (b *Batch) tick() error {
	now := time.Now()
	b.mu.Lock()
	if b.closed != nil {
		err := b.closed
		b.mu.Unlock()
		return err
	}
	switch {
	case b.state == batchOpen && b.sent > 0 && now.Sub(b.lastAck) > b.cfg.AckTimeout && now.Sub(b.queue[b.head].first) > b.cfg.AckTimeout:
		b.failBatch(&PublishError{Subject: b.stream, Class: "timeout", Err: fmt.Errorf("%w: no batch ack within %s", ErrTransient, b.cfg.AckTimeout)})
		// Ask for the count; a silent server gets endBy.
	case b.state == batchEnding && now.After(b.endBy):
		b.failBatch(&PublishError{Subject: b.stream, Class: "timeout", Err: fmt.Errorf("%w: no final batch answer", ErrTransient)})
		b.finishUnanswered()
	}
	b.mu.Unlock()
	b.commitIfFailed()
	b.afterFinish()
	return nil
}

// flushLoop commits the current batch once no message was sent for the
// idle interval: the server acknowledges a batch's last messages only then.
func (b *Batch) flushLoop(ctx context.Context) {
	t := time.NewTimer(time.Hour)
	t.Stop()
	defer t.Stop()
	for {
		select {
		case <-b.kick:
		case <-ctx.Done():
			return
		}
		last := b.lastSend.Load()
		for {
			t.Reset(b.idle)
			select {
			case <-t.C:
			case <-ctx.Done():
				return
			}
			now := b.lastSend.Load()
			if now != last {
				last = now
				continue
			}
			b.commitIdle()
			// Sleep until the next send kicks; a send between the commit
			// and the flag did not kick, so look once more.
			b.flushIdle.Store(true)
			if b.lastSend.Load() == last || !b.flushIdle.CompareAndSwap(true, false) {
				break
			}
			last = b.lastSend.Load()
		}
	}
}

// commitIdle commits the open batch if all it holds is sent. Even a batch
// whose messages flow acks all confirmed is committed: the server abandons
// a batch that receives nothing for its max batch timeout (10 s by
// default), and the next message would find it gone ("batch unknown",
// 10208) and fail.
func (b *Batch) commitIdle() {
	b.mu.Lock()
	need := b.state == batchOpen && b.seq > 0 && b.head+b.sent == len(b.queue)
	b.mu.Unlock()
	if need {
		b.commit()
	}
}

// Oldest returns the oldest unsettled message of the batch publisher, and
// false when there is none; Attempts counts the batches that failed in a
// row. It is the one holding the watermark when events are batched.
func (b *Batch) Oldest() (Stuck, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.head == len(b.queue) {
		return Stuck{}, false
	}
	pd := b.queue[b.head]
	return Stuck{Key: pd.m.Key, Subject: pd.m.Subject, Since: pd.first, Attempts: b.failures}, true
}

// Close unsubscribes from acks. Unsettled messages stay unsettled: the
// watermark never passes them, so they are re-sent after a restart.
func (b *Batch) Close() error {
	b.close(ErrClosed)
	return b.sub.Unsubscribe()
}
