package consumer

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/consumer/internal/observe"
)

// Outcomes counted by outbox_consumer_messages_processed_total.
const (
	outcomeApplied      = "applied"
	outcomeDuplicate    = "duplicate"
	outcomeRejected     = "rejected"
	outcomeSkipped      = "skipped"
	outcomeRetried      = "retried"
	outcomeDeferred     = "deferred"
	outcomeDeadLettered = "dead_lettered"
)

// Reasons counted by outbox_consumer_resumes_total.
const (
	resumeStart = "start"
	resumeGap   = "gap"
	resumeEnded = "ended"
	// resumeAdopted counts resets made by someone else that a feed took
	// over, and resumeRecheck a shared feed's resets to learn whether it is
	// alone on the durable again (feed.go).
	resumeAdopted = "adopted"
	resumeRecheck = "recheck"
)

// metricVecs are the collectors, shared by every consumer registered with the
// same Registerer.
type metricVecs struct {
	processed    *prometheus.CounterVec
	idempotency  *prometheus.CounterVec
	gaps         *prometheus.CounterVec
	conflicts    *prometheus.CounterVec
	retries      *prometheus.CounterVec
	deadLettered *prometheus.CounterVec
	replayed     *prometheus.CounterVec
	latency      *prometheus.HistogramVec
	handle       *prometheus.HistogramVec
	batchSize    *prometheus.HistogramVec
	batchTx      *prometheus.HistogramVec
	openDLQ      *prometheus.GaugeVec
	oldestDLQ    *prometheus.GaugeVec
	resumes      *prometheus.CounterVec
	silences     *prometheus.CounterVec
}

// metrics are one consumer's series.
type metrics struct {
	vecs      *metricVecs
	name      string
	owner     string
	idem      prometheus.Counter
	gap       prometheus.Counter
	conflict  prometheus.Counter
	latency   prometheus.Observer
	handle    prometheus.Observer
	batchSize prometheus.Observer
	batchTx   prometheus.Observer
	openDLQ   prometheus.Gauge
	oldest    prometheus.Gauge
	// resumes counts the feed's resets to the ack floor (feed.go), by why.
	resumes map[string]prometheus.Counter
	// silences counts pulls that heard nothing for two heartbeats (feed.go).
	silences prometheus.Counter
	// outcomes are the processed counters, looked up once: one of them
	// counts every message.
	outcomes map[string]prometheus.Counter
}

func newMetrics(reg prometheus.Registerer, name, owner string) (*metrics, error) {
	v := newMetricVecs()
	if err := v.register(reg); err != nil {
		return nil, fmt.Errorf("register consumer metrics: %w", err)
	}
	return v.series(name, owner), nil
}

// newMetricVecs makes the collectors, not registered yet.
func newMetricVecs() *metricVecs {
	v := newCounterVecs()
	v.latency = histogramVec("outbox_consumer_consume_latency_seconds",
		"Time from the outbox transaction's commit (Outbox-Commit-Time) to the consumer's commit of the applied event.",
		prometheus.ExponentialBuckets(0.005, 2, 16))
	v.handle = histogramVec("outbox_consumer_transaction_duration_seconds",
		"Duration of one message's transaction: dedup insert, version check, handler and commit.",
		prometheus.ExponentialBuckets(0.0005, 2, 16))
	v.batchSize = histogramVec("outbox_consumer_batch_size",
		"Messages a worker took together for one batch transaction (Config.BatchSize > 1); a lone message goes through the per-message transaction and is not counted here.",
		[]float64{2, 4, 8, 16, 32, 64, 128, 256, 512})
	v.batchTx = histogramVec("outbox_consumer_batch_transaction_duration_seconds",
		"Duration of one batch transaction: dedup statement, version checks, handlers and commit (each retry of a batch without a failed message counts once).",
		prometheus.ExponentialBuckets(0.0005, 2, 16))
	v.openDLQ = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "outbox_consumer_dead_letters_open",
		Help: "Dead letters waiting for an operator (open or replaying), refreshed periodically.",
	}, []string{"consumer", "owner"})
	v.oldestDLQ = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "outbox_consumer_dead_letter_oldest_age_seconds",
		Help: "Age of the oldest dead letter waiting for an operator; 0 when there is none.",
	}, []string{"consumer", "owner"})
	return v
}

func histogramVec(name, help string, buckets []float64) *prometheus.HistogramVec {
	return prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets}, []string{"consumer"})
}

// newCounterVecs makes the counter collectors.
func newCounterVecs() *metricVecs {
	l := []string{"consumer"}
	return &metricVecs{
		processed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_consumer_messages_processed_total",
			Help: "Messages handled, by outcome: applied, duplicate (idempotency hit), rejected (business rejection), skipped (event type not wanted), retried, deferred (version gap), dead_lettered.",
		}, []string{"consumer", "outcome"}),
		idempotency: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_consumer_idempotency_hits_total",
			Help: "Redelivered events recognised as already consumed and acknowledged without applying them again.",
		}, l),
		gaps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_consumer_version_gaps_total",
			Help: "Times an event arrived before an earlier version of its aggregate (deferred, or dead-lettered after the gap wait).",
		}, l),
		conflicts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_consumer_conflicts_total",
			Help: "Events whose id or aggregate version was already consumed with other content; dead-lettered.",
		}, l),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_consumer_retries_total",
			Help: "Failed attempts that will be retried, by failure class (transient, unknown).",
		}, []string{"consumer", "class"}),
		deadLettered: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_consumer_dead_lettered_total",
			Help: "Messages written to the consumer's dead-letter table, by failure class and the owner who must act.",
		}, []string{"consumer", "owner", "class"}),
		replayed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_consumer_replayed_total",
			Help: "Dead letters replayed on an operator's request, by result: applied, duplicate, rejected, failed (back to open).",
		}, []string{"consumer", "result"}),
		resumes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_consumer_resumes_total",
			Help: "Times a durable or partition was reset to its ack floor to be delivered again in stream order, by reason: start (a run or a takeover), gap (deliveries missed, e.g. lost with a pull that ended), ended (the pull subscription ended).",
		}, []string{"consumer", "reason"}),
		silences: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_consumer_pull_silences_total",
			Help: "Pulls of a durable or partition that received neither a delivery nor a heartbeat for two heartbeat intervals: asked afresh when the server answers (it held no request of ours), ended and resumed from the ack floor when it does not (the link or NATS down).",
		}, []string{"consumer"}),
	}
}

// register registers the collectors with reg, adopting those another
// consumer registered there before.
func (v *metricVecs) register(reg prometheus.Registerer) error {
	var err error
	v.processed, err = register(reg, v.processed)
	if err == nil {
		v.idempotency, err = register(reg, v.idempotency)
	}
	if err == nil {
		v.gaps, err = register(reg, v.gaps)
	}
	if err == nil {
		v.conflicts, err = register(reg, v.conflicts)
	}
	if err == nil {
		v.retries, err = register(reg, v.retries)
	}
	if err == nil {
		v.deadLettered, err = register(reg, v.deadLettered)
	}
	if err == nil {
		v.replayed, err = register(reg, v.replayed)
	}
	if err == nil {
		v.latency, err = register(reg, v.latency)
	}
	if err == nil {
		v.handle, err = register(reg, v.handle)
	}
	if err == nil {
		v.batchSize, err = register(reg, v.batchSize)
	}
	if err == nil {
		v.batchTx, err = register(reg, v.batchTx)
	}
	if err == nil {
		v.openDLQ, err = register(reg, v.openDLQ)
	}
	if err == nil {
		v.oldestDLQ, err = register(reg, v.oldestDLQ)
	}
	if err == nil {
		v.resumes, err = register(reg, v.resumes)
	}
	if err == nil {
		v.silences, err = register(reg, v.silences)
	}
	return err
}

// series are one consumer's series of the collectors.
func (v *metricVecs) series(name, owner string) *metrics {
	// The labelled counters the alerts use start at 0 for every class, so
	// increase() sees the first retry or dead letter (a series that
	// appears at 1 has no increase).
	for _, c := range []Class{ClassTransient, ClassUnknown} {
		v.retries.WithLabelValues(name, string(c))
	}
	for _, c := range []Class{ClassTransient, ClassPermanent, ClassUnknown, ClassConflict, ClassGap} {
		v.deadLettered.WithLabelValues(name, owner, string(c))
	}
	outcomes := map[string]prometheus.Counter{}
	for _, o := range []string{outcomeApplied, outcomeDuplicate, outcomeRejected, outcomeSkipped, outcomeRetried, outcomeDeferred, outcomeDeadLettered} {
		outcomes[o] = v.processed.WithLabelValues(name, o)
	}
	resumes := map[string]prometheus.Counter{}
	for _, r := range []string{resumeStart, resumeGap, resumeEnded, resumeAdopted, resumeRecheck} {
		resumes[r] = v.resumes.WithLabelValues(name, r)
	}
	return &metrics{
		resumes:   resumes,
		silences:  v.silences.WithLabelValues(name),
		outcomes:  outcomes,
		vecs:      v,
		name:      name,
		owner:     owner,
		idem:      v.idempotency.WithLabelValues(name),
		gap:       v.gaps.WithLabelValues(name),
		conflict:  v.conflicts.WithLabelValues(name),
		latency:   v.latency.WithLabelValues(name),
		handle:    v.handle.WithLabelValues(name),
		batchSize: v.batchSize.WithLabelValues(name),
		batchTx:   v.batchTx.WithLabelValues(name),
		openDLQ:   v.openDLQ.WithLabelValues(name, owner),
		oldest:    v.oldestDLQ.WithLabelValues(name, owner),
	}
}

// register is observe.Register.
func register[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	return observe.Register(reg, c)
}

func (m *metrics) processed(outcome string) {
	if c, ok := m.outcomes[outcome]; ok {
		c.Inc()
		return
	}
	m.vecs.processed.WithLabelValues(m.name, outcome).Inc()
}

func (m *metrics) retried(c Class) {
	m.vecs.retries.WithLabelValues(m.name, string(c)).Inc()
	m.processed(outcomeRetried)
}

func (m *metrics) deadLettered(c Class) {
	m.vecs.deadLettered.WithLabelValues(m.name, m.owner, string(c)).Inc()
	m.processed(outcomeDeadLettered)
}

func (m *metrics) replayResult(result string) {
	m.vecs.replayed.WithLabelValues(m.name, result).Inc()
}
