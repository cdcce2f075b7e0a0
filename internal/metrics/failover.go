package metrics

import (
	"context"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/replication"
)

// FailoverPoller checks on an interval whether promoting a standby now
// would keep the relay's slot (replication.CheckFailover) and exports the
// verdict as outbox_relay_failover_at_risk. It logs a warning when a
// failover becomes unsafe or its reasons change, and says when it is safe
// again: a failover slot that is not synchronised, or a primary without
// synchronized_standby_slots, fails only at the promotion, when it is too
// late.
type FailoverPoller struct {
	url, slot string
	interval  time.Duration
	log       *zap.Logger

	mu   sync.Mutex
	last *replication.FailoverReport

	errors                       prometheus.Counter
	atRisk, standbys, unverified *prometheus.Desc
}

// NewFailoverPoller registers the failover metrics on reg. Run polls. url
// is the relay's postgres.url: its primary is checked, and every standby it
// lists (a multi-host URL) has its copy of the slot inspected.
func NewFailoverPoller(reg prometheus.Registerer, url, slot string, interval time.Duration, log *zap.Logger) *FailoverPoller {
	if log == nil {
		log = zap.NewNop()
	}
	p := &FailoverPoller{
		url: url, slot: slot, interval: interval, log: log,
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_failover_check_errors_total",
			Help: "Failed checks of failover readiness.",
		}),
		atRisk:     prometheus.NewDesc("outbox_relay_failover_at_risk", "1 when promoting a standby now would lose the relay's slot or keep events in the stream that the new primary lacks (the log and `outbox-relay status` say why); 0 when a failover is safe or no standby exists.", nil, nil),
		standbys:   prometheus.NewDesc("outbox_relay_failover_standbys", "Physical standbys of the primary (physical slots or streaming walsenders).", nil, nil),
		unverified: prometheus.NewDesc("outbox_relay_failover_unverified", "1 when postgres.url lists no standby, so the standbys' copies of the slot could not be checked.", nil, nil),
	}
	reg.MustRegister(p)
	return p
}

// Describe implements prometheus.Collector.
func (p *FailoverPoller) Describe(ch chan<- *prometheus.Desc) {
	p.errors.Describe(ch)
	ch <- p.atRisk
	ch <- p.standbys
	ch <- p.unverified
}

// Collect implements prometheus.Collector.
func (p *FailoverPoller) Collect(ch chan<- prometheus.Metric) {
	p.errors.Collect(ch)
	p.mu.Lock()
	r := p.last
	p.mu.Unlock()
	if r == nil {
		return
	}
	ch <- prometheus.MustNewConstMetric(p.atRisk, prometheus.GaugeValue, b2f(r.AtRisk()))
	ch <- prometheus.MustNewConstMetric(p.standbys, prometheus.GaugeValue, float64(r.Standbys))
	ch <- prometheus.MustNewConstMetric(p.unverified, prometheus.GaugeValue, b2f(r.Unverified != ""))
}

// Last returns the last successful check, or false before the first.
func (p *FailoverPoller) Last() (replication.FailoverReport, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.last == nil {
		return replication.FailoverReport{}, false
	}
	return *p.last, true
}

// Poll checks once and logs a change of verdict.
func (p *FailoverPoller) Poll(ctx context.Context) error {
	qctx, cancel := context.WithTimeout(ctx, max(p.interval, 10*time.Second))
	defer cancel()
	r, err := replication.CheckFailover(qctx, p.url, p.slot)
	if err != nil {
		p.errors.Inc()
		return err
	}
	p.mu.Lock()
	prev := p.last
	p.last = &r
	p.mu.Unlock()
	was := ""
	if prev != nil {
		was = strings.Join(prev.Problems, "\n")
	}
	now := strings.Join(r.Problems, "\n")
	switch {
	case now != "" && now != was:
		p.log.Warn("a failover now would lose the replication slot", zap.String("slot", p.slot), zap.Int("standbys", r.Standbys), zap.Strings("problems", r.Problems))
	case now == "" && was != "":
		p.log.Info("failover readiness restored: the standbys keep the replication slot", zap.String("slot", p.slot))
	}
	if r.Unverified != "" && (prev == nil || prev.Unverified == "") {
		p.log.Info("failover readiness of the standbys not checked", zap.String("reason", r.Unverified))
	}
	return nil
}

// Run polls every interval until ctx ends, then returns nil. Failed checks
// are counted and logged, never returned.
func (p *FailoverPoller) Run(ctx context.Context) error {
	return pollLoop(ctx, p.interval, nil, p.log, "check failover readiness", p.Poll)
}
