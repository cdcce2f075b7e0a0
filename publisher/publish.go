package publisher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/backoff"
)

// Message is one message to publish.
type Message struct {
	Subject string
	// Header holds the message's headers, each name once. The publisher
	// encodes them through a nats.Header of its own, reused from message
	// to message: the slice stays the caller's, and is only read.
	Header contract.Headers
	Data   []byte
	// HeaderLen, when not zero, is the encoded size of Header (the router
	// knows it); the publisher otherwise adds it up to size the window.
	HeaderLen int
	// Key orders messages: at most one message per non-empty key is
	// unacknowledged at any time, and messages of one key are stored in
	// the order they were handed to Publish.
	Key string
	// Owner, when set, hears what becomes of the message: Settled, and
	// DeadLetter when it is also a DeadLetterer. An interface, not two
	// func fields, so that a producer whose per-message state is a
	// pointer hands over a message without allocating closures.
	Owner Owner
}

// Owner is told when a message is settled.
type Owner interface {
	// Settled is called once, on the Run goroutine of the publisher the
	// message was handed to, when the message (or its dead-letter
	// record) is acknowledged. It must not block.
	Settled(Result)
}

// DeadLetterer is an Owner whose message has a dead-letter record. A
// message whose Owner is not one has none: a permanent rejection is
// retried like a transient failure, so nothing is ever dropped.
type DeadLetterer interface {
	Owner
	// DeadLetter builds the dead-letter record of a message the broker
	// rejects permanently, on the publisher's Run goroutine.
	DeadLetter(reason error) *Message
}

// OwnerFuncs is an Owner made of functions, for callers with no
// per-message type of their own (tests, tools): Done is called as
// Owner.Settled. With DeadLetter set, use DeadLetterFuncs instead.
type OwnerFuncs struct {
	Done func(Result)
}

// Settled calls f.Done, when set.
func (f OwnerFuncs) Settled(r Result) {
	if f.Done != nil {
		f.Done(r)
	}
}

// DeadLetterFuncs is a DeadLetterer made of functions: Done as
// Owner.Settled, Record as DeadLetterer.DeadLetter (it must be set).
type DeadLetterFuncs struct {
	Done   func(Result)
	Record func(reason error) *Message
}

// Settled calls f.Done, when set.
func (f DeadLetterFuncs) Settled(r Result) { OwnerFuncs{f.Done}.Settled(r) }

// DeadLetter returns f.Record(reason).
func (f DeadLetterFuncs) DeadLetter(reason error) *Message { return f.Record(reason) }

// deadLetterer returns m's DeadLetterer, nil when m has no dead-letter
// record.
func deadLetterer(m *Message) DeadLetterer {
	d, _ := m.Owner.(DeadLetterer)
	return d
}

// settled tells m's Owner, if any, that m is settled.
func settled(m *Message, res Result) {
	if m.Owner != nil {
		m.Owner.Settled(res)
	}
}

// Result is the outcome of a settled message.
type Result struct {
	// Ack is a copy of the broker's acknowledgement: Done may keep it.
	Ack jetstream.PubAck
	// DeadLettered is set when the broker rejected the message and its
	// dead-letter record was stored instead; Reason says why.
	DeadLettered bool
	Reason       error
	// Attempts counts publish attempts, retries included.
	Attempts int
}

// pending is one message on its way: in flight, waiting to retry, or queued
// behind its key. Only Run touches it.
type pending struct {
	m      *Message
	cur    *Message // m, or its dead-letter record
	reason error    // set once dead-lettering
	size   int
	seq    uint64    // the current attempt's reply token
	sent   time.Time // when the current attempt was sent
	// late holds this message's attempts that timed out (the first and
	// the latest ones, maxLateTokens in all): a stored-answer to one of
	// them still settles the message (answerLate).
	late     []attemptRef
	retryAt  time.Time
	attempts int
	noResp   int // consecutive no-responders answers
	first    time.Time
	// ack is the broker's answer, which Result points to: it lives here so
	// that an ack allocates nothing.
	ack jetstream.PubAck
}

// attemptRef is an attempt: its reply token and when it was sent. Every
// attempt waits the same ackWait, so in send order the expired attempts
// are a prefix and the ack-timeout scan never looks at the whole window.
type attemptRef struct {
	seq  uint64
	sent time.Time
}

type keyState struct {
	queue []*pending
}

// ackReply is a decoded answer to one attempt, handed from the ack
// subscription to Run.
type ackReply struct {
	seq          uint64
	noResponders bool
	ack          jetstream.PubAck
	api          *jetstream.APIError // JetStream refused the message
	bad          error               // not an ack: unreadable, or without a stream
}

// lookupResult is a finished no-stream look-up, handed to Run.
type lookupResult struct {
	pd  *pending
	err error
}

// Publisher publishes messages with a bounded window, keeping per-key order.
//
// Its Run goroutine owns every message on its way (in flight, waiting to
// retry, queued behind its key), sends every attempt and calls every Done;
// producers, the ack subscription and the no-stream look-ups hand it events
// over bounded channels. Only the window's capacity is shared, under its
// own lock.
type Publisher struct {
	cfg    Config
	nc     *nats.Conn
	log    *zap.Logger
	obs    Observer
	lookup func(ctx context.Context, subject string) error
	expect func(subject string) string

	prefix string // reply subject prefix
	sub    *nats.Subscription

	window

	// Hand-over to Run. in holds admitted messages only, so it never
	// fills (its capacity is MaxInFlight); replies and looked block their
	// sender while Run catches up.
	in      chan admitted
	replies chan ackReply
	looked  chan lookupResult
	oldestQ chan stuckQuery
	stopped chan struct{} // closed when Run returns

	// Owned by Run.
	seq      uint64
	inflight map[uint64]*pending // by reply token
	late     map[uint64]*pending // timed-out attempts' reply tokens (pending.late)
	attempts []attemptRef        // in send order, from attHead
	ackWait  ackWait             // how long an attempt waits for its answer
	slowLog  bool                // a slow spell of ackWait is logged and not over
	slowSeen time.Time           // when ackWait was last twice AckTimeout or more
	// reconnects is the connection's reconnect count when Run last looked;
	// attempts sent before connSince went out on an earlier connection.
	reconnects uint64
	connSince  time.Time
	attHead    int
	keys       map[string]*keyState
	freeKeys   []*keyState // recycled, so a key's first message allocates none
	free       []*pending  // settled, for reuse: a pending is the size of a row
	retries    []*pending
	checking   map[*pending]bool // no-stream look-ups in progress
	wire       wireHeader        // every attempt's nats.Header
	lookups    sync.WaitGroup

	stream string // interned stream name of the acks, the ack subscription's alone
}

// replyQueue bounds the decoded answers waiting for Run.
const replyQueue = 1024

// New returns a publisher on nc. Run must be running for messages to be
// sent.
func New(nc *nats.Conn, cfg Config, opts ...Option) (*Publisher, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	o, err := applyOptions(opts)
	if err != nil {
		return nil, err
	}
	p := &Publisher{
		cfg:        cfg,
		nc:         nc,
		log:        o.log,
		obs:        o.obs,
		lookup:     o.lookup,
		expect:     o.expect,
		window:     newWindow(cfg),
		in:         make(chan admitted, cfg.MaxInFlight),
		replies:    make(chan ackReply, replyQueue),
		looked:     make(chan lookupResult),
		oldestQ:    make(chan stuckQuery),
		stopped:    make(chan struct{}),
		inflight:   map[uint64]*pending{},
		late:       map[uint64]*pending{},
		keys:       map[string]*keyState{},
		checking:   map[*pending]bool{},
		ackWait:    newAckWait(cfg.AckTimeout),
		reconnects: nc.Stats().Reconnects,
	}
	if p.lookup == nil {
		js, err := jetstream.New(nc)
		if err != nil {
			return nil, fmt.Errorf("jetstream context: %w", err)
		}
		p.lookup = func(ctx context.Context, subject string) error {
			_, err := js.StreamNameBySubject(ctx, subject)
			if errors.Is(err, jetstream.ErrStreamNotFound) {
				return ErrNoStream
			}
			return err
		}
	}
	// One wildcard subscription receives every ack; the token after the
	// prefix finds the message. No goroutine or channel per message. The
	// prefix must be ours alone: NATS sends a "no responders" status to just
	// one subscription matching the reply subject, and nats.go's request
	// mux already listens on NewRespInbox's prefix once any request ran on
	// the connection; sharing it would hide every "no responders" from us.
	if p.prefix, p.sub, err = subscribeAcks(nc, "*", p.onReply); err != nil {
		return nil, err
	}
	return p, nil
}

// subscribeAcks subscribes handler to a fresh inbox prefix followed by
// wildcard, and returns the prefix (with its trailing dot).
func subscribeAcks(nc *nats.Conn, wildcard string, handler nats.MsgHandler) (string, *nats.Subscription, error) {
	prefix := nc.NewInbox() + "."
	sub, err := nc.Subscribe(prefix+wildcard, handler)
	if err != nil {
		return "", nil, fmt.Errorf("subscribe to acks: %w", err)
	}
	// Acks must never be dropped as a slow consumer: the window already
	// bounds how many can be outstanding.
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		return "", nil, err
	}
	return prefix, sub, nil
}

func msgSize(m *Message) int {
	n := len(m.Subject) + len(m.Data) + 64
	if m.HeaderLen > 0 {
		return n + m.HeaderLen
	}
	return n + headerLen(m.Header)
}

// TryPublish hands m to Run if the window has room and reports whether it
// did. Messages of one key must be handed over in order.
func (p *Publisher) TryPublish(m *Message) (bool, error) {
	size := msgSize(m)
	if ok, err := p.admit(size); !ok {
		return false, err
	}
	p.in <- admitted{m: m, size: size, first: time.Now()}
	return true, nil
}

// spaceRecheck is how often Publish tries again without a signal.
const spaceRecheck = 100 * time.Millisecond

// Publish publishes m, waiting for window capacity. It is safe for
// concurrent use; messages of one key must still come from one goroutine.
func (p *Publisher) Publish(ctx context.Context, m *Message) error {
	var t *time.Timer
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	for {
		ok, err := p.TryPublish(m)
		if err != nil || ok {
			return err
		}
		if t == nil {
			t = time.NewTimer(spaceRecheck)
		} else {
			t.Reset(spaceRecheck)
		}
		select {
		case <-p.space:
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Run sends, times out and retries messages until ctx ends or the
// publisher closes. It returns the reason the publisher closed, or ctx's
// error. It may be called once.
func (p *Publisher) Run(ctx context.Context) error {
	defer close(p.stopped)
	lctx, cancel := context.WithCancel(ctx)
	defer p.lookups.Wait()
	defer cancel()
	check := newCheckTimer()
	defer check.stop()
	for {
		select {
		case a := <-p.in:
			p.accept(a)
		case r := <-p.replies:
			p.answer(r)
		case l := <-p.looked:
			p.lookedUp(l)
		case q := <-p.oldestQ:
			s, ok := p.oldest()
			q <- stuckAnswer{s, ok}
		case <-check.C():
			check.fired()
			p.tick(lctx)
		case <-p.done:
			return p.stopErr(ctx)
		case <-ctx.Done():
			return p.stopErr(ctx)
		}
		p.takeReady()
		check.arm(p.nextCheck())
	}
}

// nextCheck returns when tick has something to look at: the oldest
// attempt's ack deadline or the first retry's time, zero when nothing is
// in flight or waiting.
func (p *Publisher) nextCheck() time.Time {
	var at time.Time
	if p.attHead < len(p.attempts) {
		wait := p.ackWait.wait()
		at = p.attempts[p.attHead].sent.Add(wait)
		if wait > p.cfg.AckTimeout {
			// A reconnect is looked for at least every AckTimeout: the
			// attempts it lost are not answered, whatever the wait.
			if soon := time.Now().Add(p.cfg.AckTimeout); soon.Before(at) {
				at = soon
			}
		}
	}
	for _, pd := range p.retries {
		if !p.checking[pd] && (at.IsZero() || pd.retryAt.Before(at)) {
			at = pd.retryAt
		}
	}
	return at
}

// readyBurst bounds how many messages and answers Run takes in a row
// before it looks at its timer and queries again.
const readyBurst = 256

// takeReady handles the messages and answers already waiting: under load
// Run then goes through its full select (and parks) once per burst, not
// once per event.
func (p *Publisher) takeReady() {
	for range readyBurst {
		select {
		case a := <-p.in:
			p.accept(a)
		case r := <-p.replies:
			p.answer(r)
		default:
			return
		}
	}
}

// accept starts a handed-over message, or queues it behind its key.
func (p *Publisher) accept(a admitted) {
	pd := p.newPending()
	pd.m, pd.cur, pd.size, pd.first = a.m, a.m, a.size, a.first
	if k := a.m.Key; k != "" {
		if ks, busy := p.keys[k]; busy {
			ks.queue = append(ks.queue, pd)
			return
		}
		var ks *keyState
		if n := len(p.freeKeys); n > 0 {
			ks = p.freeKeys[n-1]
			p.freeKeys = p.freeKeys[:n-1]
		} else {
			ks = &keyState{}
		}
		p.keys[k] = ks
	}
	p.send(pd)
}

// newPending returns a recycled or new pending.
func (p *Publisher) newPending() *pending {
	if n := len(p.free); n > 0 {
		pd := p.free[n-1]
		p.free[n-1] = nil
		p.free = p.free[:n-1]
		return pd
	}
	return &pending{}
}

// send starts one attempt of pd.
func (p *Publisher) send(pd *pending) {
	p.seq++
	seq := p.seq
	pd.seq, pd.sent = seq, time.Now()
	pd.attempts++
	pd.retryAt = time.Time{}
	p.inflight[seq] = pd
	p.attempts = append(p.attempts, attemptRef{seq: seq, sent: pd.sent})

	m := pd.cur
	var buf [96]byte
	reply := strconv.AppendUint(append(buf[:0], p.prefix...), seq, 36)
	msg := nats.Msg{Subject: m.Subject, Reply: string(reply), Header: p.wire.fill(m.Header), Data: m.Data}
	err := p.nc.PublishMsg(&msg)
	p.wire.release()
	if err == nil {
		return
	}
	delete(p.inflight, seq)
	switch {
	case errors.Is(err, nats.ErrMaxPayload):
		p.fail(pd, &PublishError{Subject: m.Subject, Class: ClassTooLarge, Err: fmt.Errorf("%w: %v", ErrRejected, err)})
	case errors.Is(err, nats.ErrConnectionClosed):
		p.close(fmt.Errorf("%w: nats connection closed", ErrClosed))
	default:
		// Reconnect buffer full, connection draining: retry later.
		p.fail(pd, &PublishError{Subject: m.Subject, Class: ClassConnection, Err: fmt.Errorf("%w: %v", ErrTransient, err)})
	}
}

type pubAckResponse struct {
	jetstream.PubAck
	Error *jetstream.APIError `json:"error,omitempty"`
}

// onReply decodes an answer on the ack subscription's goroutine and hands
// it to Run.
func (p *Publisher) onReply(msg *nats.Msg) {
	seq, err := strconv.ParseUint(msg.Subject[len(p.prefix):], 36, 64)
	if err != nil {
		return // not an answer to this publisher
	}
	select {
	case p.replies <- decodeAck(seq, msg, &p.stream):
	case <-p.done:
	}
}

// decodeAck reads JetStream's answer to attempt seq; stream interns the
// stream name.
func decodeAck(seq uint64, msg *nats.Msg, stream *string) ackReply {
	r := ackReply{seq: seq}
	if len(msg.Data) == 0 && msg.Header.Get("Status") == "503" {
		r.noResponders = true
		return r
	}
	if !parsePubAck(msg.Data, &r.ack, stream) {
		var resp pubAckResponse
		if err := json.Unmarshal(msg.Data, &resp); err != nil {
			r.bad = err
			return r
		}
		if resp.Error != nil {
			r.api = resp.Error
			return r
		}
		r.ack = resp.PubAck
	}
	if r.ack.Stream == "" {
		r.bad = errors.New("ack without stream")
	}
	return r
}

// answer settles or fails the attempt r answers.
func (p *Publisher) answer(r ackReply) {
	pd, ok := p.inflight[r.seq]
	if !ok {
		p.answerLate(r)
		return
	}
	delete(p.inflight, r.seq)
	p.trimAttempts()
	subject := pd.cur.Subject
	switch {
	case r.noResponders:
		pd.noResp++
		p.fail(pd, &PublishError{Subject: subject, Class: ClassNoResponders, Err: ErrTransient})
		return
	case r.bad != nil:
		p.fail(pd, &PublishError{Subject: subject, Class: ClassBadAck, Err: fmt.Errorf("%w: %v", ErrTransient, r.bad)})
		return
	case r.api != nil:
		p.fail(pd, classifyAPIError(subject, r.api))
		return
	}
	p.answered(pd.sent)
	pd.ack = r.ack
	if want, ok := p.expectedStream(subject, pd.ack.Stream); !ok {
		p.log.Warn("bad ack: the answer names another stream than the one meant to store the message; retrying (is something other than JetStream answering on the subject?)",
			zap.String("subject", subject), zap.String("want_stream", want), zap.String("acked_by_stream", pd.ack.Stream),
			zap.Uint64("acked_seq", pd.ack.Sequence), zap.String("acked_domain", pd.ack.Domain), zap.Int("attempts", pd.attempts))
		p.fail(pd, &PublishError{Subject: subject, Class: ClassBadAck, Err: fmt.Errorf("%w: ack from stream %q, want %q", ErrTransient, pd.ack.Stream, want)})
		return
	}
	p.stored(pd)
}

// expectedStream reports whether stream is the one meant to store subject
// (true when the publisher was not told), and that one.
func (p *Publisher) expectedStream(subject, stream string) (want string, ok bool) {
	if p.expect == nil {
		return "", true
	}
	want = p.expect(subject)
	return want, want == "" || stream == want
}

// stored settles pd, whose ack (pd.ack) says the stream holds it.
func (p *Publisher) stored(pd *pending) {
	p.obs.Published(pd.cur.Subject, pd.ack.Duplicate, time.Since(pd.first))
	p.settle(pd, Result{Ack: pd.ack, DeadLettered: pd.reason != nil, Reason: pd.reason, Attempts: pd.attempts})
}

// maxLateTokens bounds the timed-out attempts a message keeps listening
// for, so the late map holds at most MaxInFlight × maxLateTokens tokens.
const maxLateTokens = 4

// timedOut keeps listening for the answer to pd's attempt a, whose ack
// timed out: when every answer takes longer than the wait (a loaded
// broker, a slow link), only a late answer can ever settle the message,
// and ignoring them would retry it for ever. The first timed-out attempt
// is kept for as long as the message is unsettled, and the latest ones
// beside it: a broker answering from a backlog answers in arrival order,
// so the first attempt is answered first. Dropping it for later attempts
// (as before) lost every answer once the backlog took longer than a few
// attempts, and the message was re-sent for ever.
func (p *Publisher) timedOut(pd *pending, a attemptRef) {
	if len(pd.late) == maxLateTokens {
		delete(p.late, pd.late[1].seq)
		pd.late = append(pd.late[:1], pd.late[2:]...)
	}
	pd.late = append(pd.late, a)
	p.late[a.seq] = pd
}

// forgetLate stops listening for pd's timed-out attempts.
func (p *Publisher) forgetLate(pd *pending) {
	for _, a := range pd.late {
		delete(p.late, a.seq)
	}
	pd.late = pd.late[:0]
}

// answered takes the round trip of an attempt sent at sent into the wait
// for answers (ackWait). A slow spell is logged once when the wait first
// reaches twice AckTimeout, and its end once the wait has stayed below
// that for slowQuiet: a broker at the edge would otherwise log both every
// few seconds.
func (p *Publisher) answered(sent time.Time) {
	if sent.Before(p.connSince) {
		return // its round trip holds the reconnect's outage, not the broker's
	}
	now := time.Now()
	p.ackWait.sample(now.Sub(sent))
	wait := p.ackWait.wait()
	if wait >= 2*p.cfg.AckTimeout {
		p.slowSeen = now
		if !p.slowLog {
			p.slowLog = true
			p.log.Warn("JetStream answers later than ack_timeout: waiting longer for each answer before re-sending, so that re-sends do not add to the server's backlog",
				zap.Duration("ack_timeout", p.cfg.AckTimeout), zap.Duration("wait", wait))
		}
		return
	}
	if p.slowLog && now.Sub(p.slowSeen) >= slowQuiet {
		p.slowLog = false
		p.log.Info("JetStream answers in time again", zap.Duration("ack_timeout", p.cfg.AckTimeout), zap.Duration("wait", wait), zap.Duration("quiet_for", slowQuiet))
	}
}

// slowQuiet is how long the wait for answers stays below twice AckTimeout
// before the end of a slow spell is logged.
const slowQuiet = time.Minute

// answerLate settles a message on a late answer to one of its timed-out
// attempts, when that answer says the message is stored: every attempt
// carries the same message id, so the stream holds it once whichever
// attempt it kept, and the message's successor (sent only once it settles)
// is stored after it. Failures of a superseded attempt mean nothing: the
// current attempt's answer or timeout decides. A message waiting for a
// no-stream look-up waits for it.
func (p *Publisher) answerLate(r ackReply) {
	pd, ok := p.late[r.seq]
	if !ok {
		return
	}
	for _, a := range pd.late {
		if a.seq == r.seq {
			p.answered(a.sent)
			break
		}
	}
	if r.noResponders || r.bad != nil || r.api != nil || p.checking[pd] {
		return
	}
	if _, ok := p.expectedStream(pd.cur.Subject, r.ack.Stream); !ok {
		return
	}
	delete(p.inflight, pd.seq)
	p.dropRetry(pd)
	pd.ack = r.ack
	p.stored(pd)
}

// trimAttempts drops answered attempts from the front of the ack-timeout
// scan, so that it holds no more than the attempts since the oldest
// unanswered one, and its front is the next deadline.
func (p *Publisher) trimAttempts() {
	for p.attHead < len(p.attempts) {
		if _, ok := p.inflight[p.attempts[p.attHead].seq]; ok {
			break
		}
		p.attHead++
	}
	p.attempts, p.attHead = compactFront(p.attempts, p.attHead)
}

// dropRetry removes pd from the retries waiting for their backoff.
func (p *Publisher) dropRetry(pd *pending) {
	for i, q := range p.retries {
		if q == pd {
			copy(p.retries[i:], p.retries[i+1:])
			p.retries[len(p.retries)-1] = nil
			p.retries = p.retries[:len(p.retries)-1]
			return
		}
	}
}

// fail handles a failed attempt: dead-letter a permanent rejection, retry
// anything else after a backoff.
func (p *Publisher) fail(pd *pending, perr *PublishError) {
	if dl := deadLetterer(pd.m); errors.Is(perr, ErrRejected) && pd.reason == nil && dl != nil {
		pd.reason = perr
		pd.cur = dl.DeadLetter(perr)
		p.forgetLate(pd) // their answers would be for the message, not its record
		pd.noResp = 0
		// Count the dead-letter record's attempts afresh, so its first
		// failure (a missing dead-letter stream) is logged at once.
		pd.attempts = 0
		p.obs.DeadLettered(perr.Class)
		p.log.Warn("dead-lettering message", zap.String("subject", perr.Subject), zap.Error(perr))
		p.send(pd)
		return
	}
	p.obs.Retried(perr.Class)
	backoff := p.backoff(pd.attempts)
	if pd.attempts == 1 || pd.attempts%10 == 0 {
		p.log.Warn("publish failed, retrying", zap.String("subject", perr.Subject), zap.Int("attempt", pd.attempts), zap.Duration("backoff", backoff), zap.Error(perr))
	}
	pd.retryAt = time.Now().Add(backoff)
	p.retries = append(p.retries, pd)
}

func (p *Publisher) backoff(attempts int) time.Duration {
	return backoff.Jitter(backoff.Step(p.cfg.RetryMin, p.cfg.RetryMax, attempts))
}

// settle completes pd: Done, its capacity back, the next message of its
// key sent. Every attempt of pd was sent on this goroutine, so none is
// still inside PublishMsg.
func (p *Publisher) settle(pd *pending, res Result) {
	key := pd.m.Key
	p.forgetLate(pd)
	settled(pd.m, res)
	p.release(pd.size)
	// Nothing refers to pd any more: its attempt left inflight when the
	// ack came, a settled message is never in retries or checking, and
	// the ack-timeout scan holds only reply tokens.
	if len(p.free) < p.cfg.MaxInFlight {
		*pd = pending{}
		p.free = append(p.free, pd)
	}
	if key == "" {
		return
	}
	ks := p.keys[key]
	if len(ks.queue) > 0 {
		next := ks.queue[0]
		ks.queue[0] = nil
		ks.queue = ks.queue[1:]
		p.send(next)
		return
	}
	delete(p.keys, key)
	// Recycle the state; never more than the window holds keys.
	if len(p.freeKeys) < p.cfg.MaxInFlight && cap(ks.queue) <= maxKeptQueue {
		ks.queue = ks.queue[:0]
		p.freeKeys = append(p.freeKeys, ks)
	}
}

// maxKeptQueue is the largest per-key queue capacity kept for reuse.
const maxKeptQueue = 64

// noStreamCheckAfter is how many consecutive "no responders" answers make
// the publisher ask whether any stream is bound to the subject at all.
const noStreamCheckAfter = 3

// tick fails the attempts whose ack is overdue and resends the retries
// that are due.
func (p *Publisher) tick(ctx context.Context) {
	now := time.Now()
	wait := p.ackWait.wait()
	reconnected := false
	if n := p.nc.Stats().Reconnects; n != p.reconnects {
		// The attempts unanswered now went out on a connection that is
		// gone: those still in its buffer or on their way are lost, and
		// the round trips learnt there say nothing about the new one.
		p.reconnects, p.connSince, reconnected = n, now, true
		p.ackWait = newAckWait(p.cfg.AckTimeout)
	}
	var why error // made for the first attempt that expires
	// Attempts answered since the last look are dropped from the front;
	// the first unanswered one that has not expired ends the scan.
	for p.attHead < len(p.attempts) {
		a := p.attempts[p.attHead]
		if pd, ok := p.inflight[a.seq]; ok {
			if !reconnected && now.Sub(a.sent) <= wait {
				break
			}
			delete(p.inflight, a.seq)
			p.timedOut(pd, a)
			switch {
			case why != nil:
			case reconnected:
				why = fmt.Errorf("%w: sent before the connection to the broker was re-established", ErrTransient)
			default:
				why = fmt.Errorf("%w: no ack within %s", ErrTransient, wait)
			}
			p.fail(pd, &PublishError{Subject: pd.cur.Subject, Class: ClassTimeout, Err: why})
		}
		p.attHead++
	}
	p.attempts, p.attHead = compactFront(p.attempts, p.attHead)
	var due []*pending
	keep := p.retries[:0]
	for _, pd := range p.retries {
		if !p.checking[pd] && !now.Before(pd.retryAt) {
			due = append(due, pd)
		} else {
			keep = append(keep, pd)
		}
	}
	clear(p.retries[len(keep):])
	p.retries = keep
	for _, pd := range due {
		if pd.noResp >= noStreamCheckAfter && pd.reason == nil && deadLetterer(pd.m) != nil {
			p.checkNoStream(ctx, pd)
			continue
		}
		p.send(pd)
	}
}

// checkNoStream asks, off the Run goroutine, whether a subject that keeps
// getting "no responders" is bound to any stream. A leader election also
// answers "no responders" for a while, so only the API's word that no
// stream matches makes the message a permanent rejection.
func (p *Publisher) checkNoStream(ctx context.Context, pd *pending) {
	p.checking[pd] = true
	subject := pd.cur.Subject
	p.lookups.Add(1)
	go func() {
		defer p.lookups.Done()
		lctx, cancel := context.WithTimeout(ctx, p.cfg.AckTimeout)
		err := p.lookup(lctx, subject)
		cancel()
		select {
		case p.looked <- lookupResult{pd: pd, err: err}:
		case <-ctx.Done():
		}
	}()
}

// lookedUp acts on a finished no-stream look-up.
func (p *Publisher) lookedUp(l lookupResult) {
	pd := l.pd
	delete(p.checking, pd)
	if errors.Is(l.err, ErrNoStream) {
		p.fail(pd, &PublishError{Subject: pd.cur.Subject, Class: ClassNoStream, Err: fmt.Errorf("%w: %w", ErrRejected, ErrNoStream)})
		return
	}
	if l.err != nil {
		// Typically the configured stream itself is gone: an outage to
		// wait out, never a reason to dead-letter.
		p.log.Warn("publish keeps failing with no responders", zap.String("subject", pd.cur.Subject), zap.Int("attempt", pd.attempts), zap.Error(l.err))
	}
	pd.noResp = 0
	p.send(pd)
}

// Stuck describes the oldest unsettled message of a publisher: with
// messages handed over in commit order, it is the one holding the
// watermark.
type Stuck struct {
	Key      string // the message's ordering key, "" for a dead-letter record
	Subject  string // the subject of its current attempt
	Since    time.Time
	Attempts int
}

// Oldest returns the oldest message in flight or waiting to retry, and
// false when there is none or Run has returned. Run walks the window (at
// most MaxInFlight messages) to answer: call it on a timer, not per
// message.
func (p *Publisher) Oldest() (Stuck, bool) { return askOldest(p.oldestQ, p.stopped) }

// oldest is Oldest on the Run goroutine.
func (p *Publisher) oldest() (Stuck, bool) {
	var old *pending
	consider := func(pd *pending) {
		if old == nil || pd.first.Before(old.first) {
			old = pd
		}
	}
	for _, pd := range p.inflight {
		consider(pd)
	}
	for _, pd := range p.retries {
		consider(pd)
	}
	for pd := range p.checking {
		consider(pd)
	}
	if old == nil {
		return Stuck{}, false
	}
	return Stuck{Key: old.m.Key, Subject: old.cur.Subject, Since: old.first, Attempts: old.attempts}, true
}

// Close stops Run and unsubscribes from acks. Unsettled messages stay
// unsettled: the watermark never passes them, so they are re-sent after a
// restart.
func (p *Publisher) Close() error {
	p.close(ErrClosed)
	return p.sub.Unsubscribe()
}
