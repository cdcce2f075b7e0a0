package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/internal/reconcile"
)

// Reconcile exports the outcome of the last reconciliation
// (outbox_relay_reconcile_*). It implements reconcile.Observer for the
// relay's reconcile loop; the reconcile command sets it once and writes it
// to a node_exporter textfile.
type Reconcile struct {
	missing, unexpected, pending, deadLettered, duplicates, rows *prometheus.GaugeVec
	runs                                                         *prometheus.CounterVec
	lastSuccess, duration                                        prometheus.Gauge
	repaired                                                     *prometheus.CounterVec
}

// NewReconcile registers the reconciliation metrics on reg.
func NewReconcile(reg prometheus.Registerer) *Reconcile {
	labels := []string{"table", "aggregate_type"}
	gv := func(name, help string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, labels)
	}
	m := &Reconcile{
		missing:      gv("outbox_relay_reconcile_missing_events", "Outbox rows in the last reconciled window whose event is in neither the stream nor the dead-letter stream, although the slot confirmed them: lost events (repair with `outbox-relay reconcile --repair`)."),
		unexpected:   gv("outbox_relay_reconcile_unexpected_events", "Events in the stream, in the last reconciled window, whose outbox row is not in the table (deleted, or written by another database)."),
		pending:      gv("outbox_relay_reconcile_pending_events", "Outbox rows not yet in the stream that the slot had not confirmed when the last reconciliation ended (in flight, or the relay is behind)."),
		deadLettered: gv("outbox_relay_reconcile_dead_lettered_events", "Outbox rows in the last reconciled window whose event is only in the dead-letter stream."),
		duplicates:   gv("outbox_relay_reconcile_duplicate_events", "Extra copies of events stored more than once in the stream, in the last reconciled window (a re-publish after the duplicate window)."),
		rows:         gv("outbox_relay_reconcile_rows", "Outbox rows checked by the last reconciliation."),
		runs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_reconcile_runs_total",
			Help: "Reconciliation runs, by result (ok, error).",
		}, []string{"result"}),
		lastSuccess: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_reconcile_last_success_timestamp_seconds",
			Help: "Unix time the last successful reconciliation finished.",
		}),
		duration: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_reconcile_duration_seconds",
			Help: "How long the last successful reconciliation took.",
		}),
		repaired: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_reconcile_repaired_events_total",
			Help: "Events republished by `reconcile --repair`, by result (published, duplicate, held: behind a duplicate of their aggregate, failed).",
		}, []string{"result"}),
	}
	reg.MustRegister(m.missing, m.unexpected, m.pending, m.deadLettered, m.duplicates, m.rows, m.runs, m.lastSuccess, m.duration, m.repaired)
	// Both results exist from the start, so rate() and alerts see a zero.
	m.runs.WithLabelValues("ok")
	m.runs.WithLabelValues("error")
	return m
}

// Reconciled implements reconcile.Observer: the gauges are replaced by the
// report's groups; a failed run only counts.
func (m *Reconcile) Reconciled(rep *reconcile.Report, err error) {
	if err != nil || rep == nil {
		m.runs.WithLabelValues("error").Inc()
		return
	}
	m.runs.WithLabelValues("ok").Inc()
	for _, v := range []*prometheus.GaugeVec{m.missing, m.unexpected, m.pending, m.deadLettered, m.duplicates, m.rows} {
		v.Reset()
	}
	for _, g := range rep.Groups {
		l := prometheus.Labels{"table": g.Table, "aggregate_type": g.AggregateType}
		m.missing.With(l).Set(float64(g.Missing))
		m.unexpected.With(l).Set(float64(g.Unexpected))
		m.pending.With(l).Set(float64(g.Pending))
		m.deadLettered.With(l).Set(float64(g.DeadLettered))
		m.duplicates.With(l).Set(float64(g.Duplicates))
		m.rows.With(l).Set(float64(g.Rows))
	}
	m.lastSuccess.Set(float64(time.Now().UnixNano()) / 1e9)
	m.duration.Set(rep.Duration.Seconds())
}

// Repaired counts the outcome of a repair.
func (m *Reconcile) Repaired(rep *reconcile.RepairReport) {
	if rep == nil {
		return
	}
	m.repaired.WithLabelValues("published").Add(float64(rep.Published))
	m.repaired.WithLabelValues("duplicate").Add(float64(rep.Duplicates))
	m.repaired.WithLabelValues("held").Add(float64(rep.HeldBehindDuplicates))
	m.repaired.WithLabelValues("failed").Add(float64(len(rep.Failed)))
}
