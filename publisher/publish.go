package publisher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
)

// Message is one message to publish.
type Message struct {
	Subject string
	Header  nats.Header
	Data    []byte
	// Key orders messages: at most one message per non-empty key is
	// unacknowledged at any time, and messages of one key are stored in
	// the order they were handed to Publish.
	Key string
	// DeadLetter builds the dead-letter record for a message the broker
	// rejects permanently. Without it a rejection is retried like a
	// transient failure, so nothing is ever dropped.
	DeadLetter func(reason error) *Message
	// Done is called once, from a publisher goroutine, when the message
	// (or its dead-letter record) is acknowledged. It must not block.
	Done func(Result)
}

// Result is the outcome of a settled message.
type Result struct {
	Ack *jetstream.PubAck
	// DeadLettered is set when the broker rejected the message and its
	// dead-letter record was stored instead; Reason says why.
	DeadLettered bool
	Reason       error
	// Attempts counts publish attempts, retries included.
	Attempts int
}

// Config configures a Publisher.
type Config struct {
	// MaxInFlight bounds unacknowledged plus queued messages. Default 4096.
	MaxInFlight int
	// MaxInFlightBytes bounds their total size. Default 64 MiB. A single
	// message larger than this is still sent, alone.
	MaxInFlightBytes int
	// AckTimeout is how long to wait for an ack before retrying. Default 5s.
	AckTimeout time.Duration
	// RetryMin and RetryMax bound the exponential retry backoff. Defaults
	// 50ms and 5s.
	RetryMin, RetryMax time.Duration
}

func (c *Config) setDefaults() error {
	if c.MaxInFlight == 0 {
		c.MaxInFlight = 4096
	}
	if c.MaxInFlightBytes == 0 {
		c.MaxInFlightBytes = 64 << 20
	}
	if c.AckTimeout == 0 {
		c.AckTimeout = 5 * time.Second
	}
	if c.RetryMin == 0 {
		c.RetryMin = 50 * time.Millisecond
	}
	if c.RetryMax == 0 {
		c.RetryMax = 5 * time.Second
	}
	switch {
	case c.MaxInFlight < 1:
		return fmt.Errorf("%w: max_in_flight %d must be at least 1", ErrInvalidConfig, c.MaxInFlight)
	case c.MaxInFlightBytes < 1:
		return fmt.Errorf("%w: max_in_flight_bytes %d must be at least 1", ErrInvalidConfig, c.MaxInFlightBytes)
	case c.AckTimeout < 10*time.Millisecond:
		return fmt.Errorf("%w: ack_timeout %s is too short", ErrInvalidConfig, c.AckTimeout)
	case c.RetryMin <= 0 || c.RetryMax < c.RetryMin:
		return fmt.Errorf("%w: retry backoff %s..%s is not a range", ErrInvalidConfig, c.RetryMin, c.RetryMax)
	}
	return nil
}

// Observer receives publisher events, for metrics. Methods are called from
// publisher goroutines and must not block.
type Observer interface {
	Published(subject string, duplicate bool, latency time.Duration)
	Retried(class string)
	DeadLettered(class string)
}

type nopObserver struct{}

func (nopObserver) Published(string, bool, time.Duration) {}
func (nopObserver) Retried(string)                        {}
func (nopObserver) DeadLettered(string)                   {}

// Option configures a Publisher.
type Option func(*Publisher)

// WithLogger sets the logger (default: no logging).
func WithLogger(l *zap.Logger) Option { return func(p *Publisher) { p.log = l } }

// WithObserver sets the metrics observer.
func WithObserver(o Observer) Option { return func(p *Publisher) { p.obs = o } }

// WithStreamLookup sets how the publisher asks whether any stream is bound
// to a subject after repeated "no responders" answers (default: the
// JetStream API of the connection). The function returns ErrNoStream when
// none is.
func WithStreamLookup(f func(ctx context.Context, subject string) error) Option {
	return func(p *Publisher) { p.lookup = f }
}

// pending is one message on its way: in flight, waiting to retry, or queued
// behind its key.
type pending struct {
	m        *Message
	cur      *Message // m, or its dead-letter record
	reason   error    // set once dead-lettering
	size     int
	token    string
	deadline time.Time
	retryAt  time.Time
	attempts int
	noResp   int // consecutive no-responders answers
	first    time.Time
}

type keyState struct {
	queue []*pending
}

// Publisher publishes messages with a bounded window, keeping per-key order.
type Publisher struct {
	cfg    Config
	nc     *nats.Conn
	log    *zap.Logger
	obs    Observer
	lookup func(ctx context.Context, subject string) error

	prefix string // reply subject prefix
	sub    *nats.Subscription

	mu       sync.Mutex
	count    int // messages holding window capacity
	bytes    int
	seq      uint64
	inflight map[string]*pending
	keys     map[string]*keyState
	retries  []*pending
	checking map[*pending]bool // no-stream look-ups in progress
	closed   error
	space    chan struct{} // signalled when capacity frees up
	lookups  sync.WaitGroup
}

// New returns a publisher on nc. Run must be running for timeouts and
// retries to happen.
func New(nc *nats.Conn, cfg Config, opts ...Option) (*Publisher, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	p := &Publisher{
		cfg:      cfg,
		nc:       nc,
		log:      zap.NewNop(),
		obs:      nopObserver{},
		inflight: map[string]*pending{},
		keys:     map[string]*keyState{},
		checking: map[*pending]bool{},
		space:    make(chan struct{}, 1),
	}
	for _, o := range opts {
		o(p)
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
	// prefix finds the message. No goroutine or channel per message.
	p.prefix = nc.NewRespInbox()
	if i := lastDot(p.prefix); i >= 0 {
		p.prefix = p.prefix[:i+1]
	}
	sub, err := nc.Subscribe(p.prefix+"*", p.onReply)
	if err != nil {
		return nil, fmt.Errorf("subscribe to acks: %w", err)
	}
	// Acks must never be dropped as a slow consumer: the window already
	// bounds how many can be outstanding.
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		return nil, err
	}
	p.sub = sub
	return p, nil
}

func lastDot(s string) int {
	for i := len(s) - 1; i >= 0; i-- {
		if s[i] == '.' {
			return i
		}
	}
	return -1
}

func msgSize(m *Message) int {
	n := len(m.Subject) + len(m.Data) + 64
	for k, vs := range m.Header {
		for _, v := range vs {
			n += len(k) + len(v) + 4
		}
	}
	return n
}

// TryPublish publishes m if the window has room and reports whether it
// did. Messages of one key must be handed over in order.
func (p *Publisher) TryPublish(m *Message) (bool, error) {
	size := msgSize(m)
	p.mu.Lock()
	if p.closed != nil {
		p.mu.Unlock()
		return false, p.closed
	}
	if p.count > 0 && (p.count+1 > p.cfg.MaxInFlight || p.bytes+size > p.cfg.MaxInFlightBytes) {
		p.mu.Unlock()
		return false, nil
	}
	p.count++
	p.bytes += size
	pd := &pending{m: m, cur: m, size: size, first: time.Now()}
	if m.Key != "" {
		if ks, busy := p.keys[m.Key]; busy {
			ks.queue = append(ks.queue, pd)
			p.mu.Unlock()
			return true, nil
		}
		p.keys[m.Key] = &keyState{}
	}
	p.mu.Unlock()
	p.send(pd)
	return true, nil
}

// WaitSpace blocks until some window capacity frees up or ctx ends.
func (p *Publisher) WaitSpace(ctx context.Context) error {
	select {
	case <-p.space:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Publish publishes m, waiting for window capacity.
func (p *Publisher) Publish(ctx context.Context, m *Message) error {
	for {
		ok, err := p.TryPublish(m)
		if err != nil || ok {
			return err
		}
		if err := p.WaitSpace(ctx); err != nil {
			return err
		}
	}
}

// InFlight returns the number of messages holding window capacity.
func (p *Publisher) InFlight() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.count
}

// send starts one attempt of pd.
func (p *Publisher) send(pd *pending) {
	p.mu.Lock()
	p.seq++
	pd.token = strconv.FormatUint(p.seq, 36)
	pd.attempts++
	pd.deadline = time.Now().Add(p.cfg.AckTimeout)
	pd.retryAt = time.Time{}
	p.inflight[pd.token] = pd
	p.mu.Unlock()

	m := pd.cur
	err := p.nc.PublishMsg(&nats.Msg{Subject: m.Subject, Reply: p.prefix + pd.token, Header: m.Header, Data: m.Data})
	if err == nil {
		return
	}
	p.mu.Lock()
	delete(p.inflight, pd.token)
	p.mu.Unlock()
	switch {
	case errors.Is(err, nats.ErrMaxPayload):
		p.fail(pd, &PublishError{Subject: m.Subject, Class: "too_large", Err: fmt.Errorf("%w: %v", ErrRejected, err)})
	case errors.Is(err, nats.ErrConnectionClosed):
		p.close(fmt.Errorf("%w: nats connection closed", ErrClosed))
	default:
		// Reconnect buffer full, connection draining: retry later.
		p.fail(pd, &PublishError{Subject: m.Subject, Class: "connection", Err: fmt.Errorf("%w: %v", ErrTransient, err)})
	}
}

type pubAckResponse struct {
	jetstream.PubAck
	Error *jetstream.APIError `json:"error,omitempty"`
}

func (p *Publisher) onReply(msg *nats.Msg) {
	token := msg.Subject[len(p.prefix):]
	p.mu.Lock()
	pd, ok := p.inflight[token]
	if ok {
		delete(p.inflight, token)
	}
	p.mu.Unlock()
	if !ok {
		return // a late answer to an attempt that already timed out
	}
	subject := pd.cur.Subject
	if len(msg.Data) == 0 && msg.Header.Get("Status") == "503" {
		pd.noResp++
		p.fail(pd, &PublishError{Subject: subject, Class: "no_responders", Err: ErrTransient})
		return
	}
	var resp pubAckResponse
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
		p.fail(pd, &PublishError{Subject: subject, Class: "bad_ack", Err: fmt.Errorf("%w: %v", ErrTransient, err)})
		return
	}
	if resp.Error != nil {
		p.fail(pd, classifyAPIError(subject, resp.Error))
		return
	}
	if resp.Stream == "" {
		p.fail(pd, &PublishError{Subject: subject, Class: "bad_ack", Err: fmt.Errorf("%w: ack without stream", ErrTransient)})
		return
	}
	ack := resp.PubAck
	p.obs.Published(subject, ack.Duplicate, time.Since(pd.first))
	p.settle(pd, Result{Ack: &ack, DeadLettered: pd.reason != nil, Reason: pd.reason, Attempts: pd.attempts})
}

// fail handles a failed attempt: dead-letter a permanent rejection, retry
// anything else after a backoff.
func (p *Publisher) fail(pd *pending, perr *PublishError) {
	if errors.Is(perr, ErrRejected) && pd.reason == nil && pd.m.DeadLetter != nil {
		pd.reason = perr
		pd.cur = pd.m.DeadLetter(perr)
		pd.noResp = 0
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
	p.mu.Lock()
	pd.retryAt = time.Now().Add(backoff)
	p.retries = append(p.retries, pd)
	p.mu.Unlock()
}

func (p *Publisher) backoff(attempts int) time.Duration {
	d := p.cfg.RetryMin
	for i := 1; i < attempts && d < p.cfg.RetryMax; i++ {
		d *= 2
	}
	if d > p.cfg.RetryMax {
		d = p.cfg.RetryMax
	}
	// ±25% jitter, so many relays retrying after one outage do not stampede.
	return d*3/4 + time.Duration(rand.Int64N(int64(d/2)+1))
}

// settle completes pd, frees its capacity and sends the next message of its
// key.
func (p *Publisher) settle(pd *pending, res Result) {
	if pd.m.Done != nil {
		pd.m.Done(res)
	}
	var next *pending
	p.mu.Lock()
	p.count--
	p.bytes -= pd.size
	if k := pd.m.Key; k != "" {
		ks := p.keys[k]
		if len(ks.queue) > 0 {
			next = ks.queue[0]
			ks.queue[0] = nil
			ks.queue = ks.queue[1:]
		} else {
			delete(p.keys, k)
		}
	}
	p.mu.Unlock()
	select {
	case p.space <- struct{}{}:
	default:
	}
	if next != nil {
		p.send(next)
	}
}

// Run handles ack timeouts and retries until ctx ends. It returns the
// reason the publisher closed, or ctx's error.
func (p *Publisher) Run(ctx context.Context) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	defer p.lookups.Wait()
	for {
		select {
		case <-ctx.Done():
			p.mu.Lock()
			err := p.closed
			p.mu.Unlock()
			if err != nil {
				return err
			}
			return ctx.Err()
		case <-tick.C:
		}
		if err := p.tick(ctx); err != nil {
			return err
		}
	}
}

// noStreamCheckAfter is how many consecutive "no responders" answers make
// the publisher ask whether any stream is bound to the subject at all.
const noStreamCheckAfter = 3

func (p *Publisher) tick(ctx context.Context) error {
	now := time.Now()
	var due, timedOut []*pending
	p.mu.Lock()
	if p.closed != nil {
		err := p.closed
		p.mu.Unlock()
		return err
	}
	for token, pd := range p.inflight {
		if now.After(pd.deadline) {
			delete(p.inflight, token)
			timedOut = append(timedOut, pd)
		}
	}
	keep := p.retries[:0]
	for _, pd := range p.retries {
		switch {
		case p.checking[pd]:
			keep = append(keep, pd)
		case !now.Before(pd.retryAt):
			due = append(due, pd)
		default:
			keep = append(keep, pd)
		}
	}
	clear(p.retries[len(keep):])
	p.retries = keep
	p.mu.Unlock()

	for _, pd := range timedOut {
		p.fail(pd, &PublishError{Subject: pd.cur.Subject, Class: "timeout", Err: fmt.Errorf("%w: no ack within %s", ErrTransient, p.cfg.AckTimeout)})
	}
	for _, pd := range due {
		if pd.noResp >= noStreamCheckAfter && pd.reason == nil && pd.m.DeadLetter != nil {
			p.checkNoStream(ctx, pd)
			continue
		}
		p.send(pd)
	}
	return nil
}

// checkNoStream asks, off the tick goroutine, whether a subject that keeps
// getting "no responders" is bound to any stream. A leader election also
// answers "no responders" for a while, so only the API's word that no
// stream matches makes the message a permanent rejection.
func (p *Publisher) checkNoStream(ctx context.Context, pd *pending) {
	p.mu.Lock()
	p.checking[pd] = true
	p.mu.Unlock()
	p.lookups.Add(1)
	go func() {
		defer p.lookups.Done()
		lctx, cancel := context.WithTimeout(ctx, p.cfg.AckTimeout)
		err := p.lookup(lctx, pd.cur.Subject)
		cancel()
		p.mu.Lock()
		delete(p.checking, pd)
		p.mu.Unlock()
		if errors.Is(err, ErrNoStream) {
			p.fail(pd, &PublishError{Subject: pd.cur.Subject, Class: "no_stream", Err: fmt.Errorf("%w: %w", ErrRejected, ErrNoStream)})
			return
		}
		pd.noResp = 0
		if ctx.Err() == nil {
			p.send(pd)
		}
	}()
}

func (p *Publisher) close(err error) {
	p.mu.Lock()
	if p.closed == nil {
		p.closed = err
	}
	p.mu.Unlock()
	select {
	case p.space <- struct{}{}:
	default:
	}
}

// Drain waits until every message handed over is settled or ctx ends.
func (p *Publisher) Drain(ctx context.Context) error {
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for {
		p.mu.Lock()
		n, closed := p.count, p.closed
		p.mu.Unlock()
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

// Close unsubscribes from acks. Unsettled messages stay unsettled: the
// watermark never passes them, so they are re-sent after a restart.
func (p *Publisher) Close() error {
	p.close(ErrClosed)
	return p.sub.Unsubscribe()
}
