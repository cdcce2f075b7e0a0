package metrics

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// StreamSnapshot is one poll of a stream's state.
type StreamSnapshot struct {
	Stream   string    `json:"stream"`
	Exists   bool      `json:"exists"`
	Messages uint64    `json:"messages"`
	LastSeq  uint64    `json:"last_seq"`
	FirstAt  time.Time `json:"first_at,omitzero"` // storage time of the oldest message
}

// OldestAge is the age of the stream's oldest message at now; 0 when empty.
func (s StreamSnapshot) OldestAge(now time.Time) time.Duration {
	if s.Messages == 0 || s.FirstAt.IsZero() {
		return 0
	}
	return max(now.Sub(s.FirstAt), 0)
}

// PollStream reads a stream's state; a missing stream is not an error.
func PollStream(ctx context.Context, js jetstream.JetStream, name string) (StreamSnapshot, error) {
	s := StreamSnapshot{Stream: name}
	st, err := js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return s, nil
	}
	if err != nil {
		return s, fmt.Errorf("stream %s: %w", name, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return s, fmt.Errorf("stream %s info: %w", name, err)
	}
	s.Exists = true
	s.Messages, s.LastSeq = info.State.Msgs, info.State.LastSeq
	if info.State.Msgs > 0 {
		s.FirstAt = info.State.FirstTime
	}
	return s, nil
}

// StreamPoller polls the event and dead-letter streams on an interval and
// exports their size and the age of the oldest dead letter
// (outbox_relay_stream_messages, outbox_relay_dead_letters,
// outbox_relay_dead_letter_oldest_age_seconds, all labelled by stream).
// The age is computed at scrape time from the oldest record's storage time,
// so it grows between polls as it does in reality.
type StreamPoller struct {
	js              jetstream.JetStream
	events, dlq     string
	interval        time.Duration
	log             *zap.Logger
	refresh         chan struct{} // Refresh's request for a poll now
	mu              sync.Mutex
	lastEv, lastDLQ *StreamSnapshot
	errors          prometheus.Counter
	msgs, dead, age *prometheus.Desc
	now             func() time.Time
}

// NewStreamPoller registers the stream metrics on reg. Run polls.
func NewStreamPoller(reg prometheus.Registerer, js jetstream.JetStream, events, deadLetters string, interval time.Duration, log *zap.Logger) *StreamPoller {
	if log == nil {
		log = zap.NewNop()
	}
	p := &StreamPoller{
		js: js, events: events, dlq: deadLetters, interval: interval, log: log, now: time.Now, refresh: make(chan struct{}, 1),
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_stream_poll_errors_total",
			Help: "Failed polls of the event and dead-letter streams' state.",
		}),
		msgs: prometheus.NewDesc("outbox_relay_stream_messages", "Messages stored in the event stream.", []string{"stream"}, nil),
		dead: prometheus.NewDesc("outbox_relay_dead_letters", "Records in the relay's dead-letter stream (rows the relay could not publish), waiting for an operator.", []string{"stream"}, nil),
		age:  prometheus.NewDesc("outbox_relay_dead_letter_oldest_age_seconds", "Age of the oldest record in the relay's dead-letter stream; 0 when it is empty.", []string{"stream"}, nil),
	}
	reg.MustRegister(p)
	return p
}

// Describe implements prometheus.Collector.
func (p *StreamPoller) Describe(ch chan<- *prometheus.Desc) {
	p.errors.Describe(ch)
	ch <- p.msgs
	ch <- p.dead
	ch <- p.age
}

// Collect implements prometheus.Collector.
func (p *StreamPoller) Collect(ch chan<- prometheus.Metric) {
	p.errors.Collect(ch)
	p.mu.Lock()
	ev, dlq := p.lastEv, p.lastDLQ
	p.mu.Unlock()
	if ev != nil && ev.Exists {
		ch <- prometheus.MustNewConstMetric(p.msgs, prometheus.GaugeValue, float64(ev.Messages), ev.Stream)
	}
	if dlq != nil {
		// A dead-letter stream that does not exist yet holds no records.
		ch <- prometheus.MustNewConstMetric(p.dead, prometheus.GaugeValue, float64(dlq.Messages), dlq.Stream)
		ch <- prometheus.MustNewConstMetric(p.age, prometheus.GaugeValue, dlq.OldestAge(p.now()).Seconds(), dlq.Stream)
	}
}

// Poll polls both streams once.
func (p *StreamPoller) Poll(ctx context.Context) error {
	qctx, cancel := context.WithTimeout(ctx, max(p.interval, 5*time.Second))
	defer cancel()
	ev, err1 := PollStream(qctx, p.js, p.events)
	dlq, err2 := PollStream(qctx, p.js, p.dlq)
	p.mu.Lock()
	if err1 == nil {
		p.lastEv = &ev
	}
	if err2 == nil {
		p.lastDLQ = &dlq
	}
	p.mu.Unlock()
	if err := errors.Join(err1, err2); err != nil {
		p.errors.Inc()
		return err
	}
	return nil
}

// Run polls every interval until ctx ends, then returns nil; failures are
// counted and logged, never returned.
func (p *StreamPoller) Run(ctx context.Context) error {
	return pollLoop(ctx, p.interval, p.refresh, p.log, "poll streams", p.Poll)
}

// Refresh asks Run for a poll now, without waiting for it (see
// SlotPoller.Refresh).
func (p *StreamPoller) Refresh() { requestPoll(p.refresh) }
