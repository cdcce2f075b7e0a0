package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/router"
)

// Relay holds the relay's metrics and implements relay.Observer.
type Relay struct {
	published      prometheus.Counter
	duplicates     prometheus.Counter
	deadLettered   *prometheus.CounterVec
	retries        *prometheus.CounterVec
	reconnects     prometheus.Counter
	standbyRetries prometheus.Counter
	publishLatency prometheus.Histogram
}

// deadLetterClasses are the reason classes of outbox_relay_dead_lettered_total:
// the router's, and the publisher's for broker rejections.
var deadLetterClasses = []string{
	router.ClassMissingColumn, router.ClassNullField, router.ClassInvalidField,
	router.ClassSubjectTooLong, router.ClassTooLarge, router.ClassHeaderTooLarge, router.ClassUnknownTable,
	router.ClassRejectedByBroker, publisher.ClassStreamMismatch, publisher.ClassNoStream,
}

// Gauges are read at scrape time.
type Gauges struct {
	InFlight     func() float64
	ConfirmedLSN func() float64
	OldestAge    func() float64
	Ready        func() float64
	// StreamDurable is 1 when the event stream's acks survive a server
	// crash (file storage, ≥ 3 replicas), 0 when not, -1 before the check.
	StreamDurable func() float64
	// UnsettledTxs and UnsettledWALBytes are the tail behind the
	// watermark; IntakePaused is 1 while the relay stopped reading the WAL
	// because the tail reached its bound.
	UnsettledTxs      func() float64
	UnsettledWALBytes func() float64
	IntakePaused      func() float64
	// Stall returns how long the watermark has stood still with messages
	// unsettled (0 when it moves) and, once the relay has named it, the
	// message holding it.
	Stall func() Stall
	// BackfillIncomplete is 1 when the relay found the slot's backfill
	// interrupted and refuses to stream from it.
	BackfillIncomplete func() float64
	// PublicationWrong is 1 when the last publication check found a table
	// missing or a wrong setting.
	PublicationWrong func() float64
	// PublicationCheckFailing is 1 while the publication check cannot run.
	PublicationCheckFailing func() float64
	// StreamWrong is 1 when the last check of the streams while running
	// found one changed so that it breaks the contract.
	StreamWrong func() float64
	// TraceHeadersDropped counts trace context values left off their
	// events because no header could carry them (the events are relayed).
	TraceHeadersDropped func() float64
}

// Stall is the watermark standing still behind one message.
type Stall struct {
	Seconds float64
	// Key is the blocking message's ordering key (aggregate type, NUL,
	// aggregate id; empty for a dead-letter record) and Subject its
	// subject; both empty until the relay names the blocker.
	Key, Subject string
}

// NewRelay registers the relay's metrics on reg.
func NewRelay(reg prometheus.Registerer, g Gauges) *Relay {
	m := &Relay{
		published: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_events_published_total",
			Help: "Events acknowledged by JetStream (duplicates included).",
		}),
		duplicates: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_publish_duplicates_total",
			Help: "Publishes JetStream acknowledged as duplicates of a stored event (Nats-Msg-Id within the duplicate window).",
		}),
		deadLettered: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_dead_lettered_total",
			Help: "Rows written to the dead-letter stream, by reason class.",
		}, []string{"reason"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_publish_retries_total",
			Help: "Publish attempts that failed and were retried, by failure class.",
		}, []string{"class"}),
		reconnects: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_replication_restarts_total",
			Help: "Restarts of the replication session after it failed or was interrupted (a standby's retries are counted apart).",
		}),
		standbyRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_standby_retries_total",
			Help: "Attempts of a standby instance to take the slot while another instance streams from it.",
		}),
		publishLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "outbox_relay_publish_latency_seconds",
			Help:    "Time from the transaction's commit to the JetStream ack of its event.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 18),
		}),
	}
	reg.MustRegister(m.published, m.duplicates, m.deadLettered, m.retries, m.reconnects, m.standbyRetries, m.publishLatency)
	// A labelled counter has no series until its first increment, and
	// increase() over a series that appears at 1 reads 0: the alerts on
	// these counters would miss the first dead letter. Start the known
	// classes at 0.
	for _, c := range deadLetterClasses {
		m.deadLettered.WithLabelValues(c)
	}
	for _, c := range publisher.RetryClasses {
		m.retries.WithLabelValues(c)
	}
	gauge := func(name, help string, f func() float64) {
		if f != nil {
			reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, f))
		}
	}
	gauge("outbox_relay_in_flight_messages", "Messages handed to the publisher and not yet acknowledged.", g.InFlight)
	gauge("outbox_relay_confirmed_lsn", "Highest LSN whose transactions are all acknowledged (the slot's next confirmed position), as a number.", g.ConfirmedLSN)
	gauge("outbox_relay_oldest_unacked_age_seconds", "Age, from its commit, of the oldest transaction with events not yet acknowledged by JetStream; 0 when none.", g.OldestAge)
	gauge("outbox_relay_ready", "1 while the relay streams from the slot with the broker connected.", g.Ready)
	gauge("outbox_relay_unsettled_transactions", "Transactions read from the WAL and not yet confirmable: published behind a message not yet acknowledged.", g.UnsettledTxs)
	gauge("outbox_relay_unsettled_wal_bytes", "WAL bytes from the confirmed position to the newest transaction read: what a restart decodes and re-sends.", g.UnsettledWALBytes)
	gauge("outbox_relay_intake_paused", "1 while the relay stopped reading the WAL because the unsettled transactions or WAL bytes reached nats.max_unsettled_transactions or nats.max_unsettled_wal_bytes.", g.IntakePaused)
	gauge("outbox_relay_backfill_incomplete", "1 when the slot's backfill was interrupted: the relay refuses to stream from the slot until `outbox-relay setup` backfills again.", g.BackfillIncomplete)
	gauge("outbox_relay_publication_wrong", "1 when the publication lacks a configured table, publishes updates or deletes, sends a partitioned table by partition or filters rows: the relay is not ready; its log names the ALTER PUBLICATION to run.", g.PublicationWrong)
	gauge("outbox_relay_publication_check_failing", "1 while the publication check cannot run (the database unreachable for the check's connection, a timeout): the relay confirms nothing newer than the last successful check and is not ready; its log line `could not check the publication` has the cause.", g.PublicationCheckFailing)
	gauge("outbox_relay_stream_wrong", "1 when the last check of the event and dead-letter streams while running (every postgres.publication_check_interval, the check run at start) found one gone or edited so that it breaks the contract, e.g. its subjects no longer covering the subject template: the relay is not ready; its log line names the problem.", g.StreamWrong)
	if g.TraceHeadersDropped != nil {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "outbox_relay_trace_headers_dropped_total",
			Help: "Trace context values (traceparent, tracestate) left off their events because no header can carry them: a line break, over 512 bytes, blank. The events are relayed without them."},
			g.TraceHeadersDropped))
	}
	if g.Stall != nil {
		reg.MustRegister(stallCollector(g.Stall))
	}
	gauge("outbox_relay_stream_durable", "1 when the event stream's acknowledgements survive a server crash (file storage, at least 3 replicas), 0 when not, -1 before the relay checked.", g.StreamDurable)
	return m
}

// Published implements publisher.Observer.
func (m *Relay) Published(_ string, duplicate bool, _ time.Duration) {
	if duplicate {
		m.duplicates.Inc()
	}
}

// Retried implements publisher.Observer.
func (m *Relay) Retried(class string) { m.retries.WithLabelValues(class).Inc() }

// DeadLettered implements publisher.Observer (broker rejections).
func (m *Relay) DeadLettered(class string) { m.deadLettered.WithLabelValues(class).Inc() }

// Unroutable implements relay.Observer (router rejections).
func (m *Relay) Unroutable(class string) { m.deadLettered.WithLabelValues(class).Inc() }

// Settled implements relay.Observer.
func (m *Relay) Settled(res publisher.Result, commitTime time.Time) {
	if res.DeadLettered {
		return
	}
	m.published.Inc()
	if !commitTime.IsZero() {
		m.publishLatency.Observe(time.Since(commitTime).Seconds())
	}
}

// Reconnected implements relay.Observer.
func (m *Relay) Reconnected() { m.reconnects.Inc() }

// StandingBy implements relay.Observer.
func (m *Relay) StandingBy() { m.standbyRetries.Inc() }
