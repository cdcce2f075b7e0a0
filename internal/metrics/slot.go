package metrics

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/replication"
)

// WALStatuses are the values of pg_replication_slots.wal_status, each a
// series of outbox_relay_slot_wal_status.
var WALStatuses = []string{"reserved", "extended", "unreserved", "lost"}

// Querier runs one query; *pgxpool.Pool implements it.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// SlotSnapshot is one poll of the relay's row of pg_replication_slots.
type SlotSnapshot struct {
	Exists bool `json:"exists"`
	Active bool `json:"active"`
	// WALStatus is reserved, extended, unreserved or lost.
	WALStatus    string          `json:"wal_status,omitempty"`
	ConfirmedLSN replication.LSN `json:"-"`
	// RetainedBytes is pg_current_wal_lsn() - restart_lsn.
	RetainedBytes int64 `json:"retained_wal_bytes"`
	// LagBytes is pg_current_wal_lsn() - confirmed_flush_lsn.
	LagBytes int64 `json:"lag_bytes"`
	// SafeWALSize is how much more WAL may be written before the slot is
	// lost; nil when max_slot_wal_keep_size is unlimited.
	SafeWALSize *int64    `json:"safe_wal_size_bytes,omitempty"`
	At          time.Time `json:"-"`
}

// PollSlot reads the slot's row of pg_replication_slots.
func PollSlot(ctx context.Context, db Querier, slot string) (SlotSnapshot, error) {
	var s SlotSnapshot
	var walStatus, confirmed *string
	var retained, lag *int64
	err := db.QueryRow(ctx, `
SELECT active, wal_status, confirmed_flush_lsn::text,
       (`+replication.CurrentLSN+` - restart_lsn)::bigint,
       (`+replication.CurrentLSN+` - confirmed_flush_lsn)::bigint,
       safe_wal_size
FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&s.Active, &walStatus, &confirmed, &retained, &lag, &s.SafeWALSize)
	s.At = time.Now()
	if errors.Is(err, pgx.ErrNoRows) {
		return s, nil
	}
	if err != nil {
		return s, fmt.Errorf("read slot %s: %w", slot, err)
	}
	s.Exists = true
	if walStatus != nil {
		s.WALStatus = *walStatus
	}
	if confirmed != nil {
		s.ConfirmedLSN, _ = replication.ParseLSN(*confirmed)
	}
	if retained != nil {
		s.RetainedBytes = *retained
	}
	if lag != nil {
		s.LagBytes = *lag
	}
	return s, nil
}

// SlotPoller polls the relay's replication slot on an interval and exports
// it (outbox_relay_slot_*). The gauges are absent until the first poll
// succeeds and keep the last good values while polls fail;
// outbox_relay_slot_last_poll_timestamp_seconds says how fresh they are.
type SlotPoller struct {
	db       Querier
	slot     string
	interval time.Duration
	log      *zap.Logger
	refresh  chan struct{} // Refresh's request for a poll now

	mu   sync.Mutex
	last *SlotSnapshot

	errors                                              prometheus.Counter
	exists, active, walStatus, retained, lag, safe, lsn *prometheus.Desc
	lastPoll                                            *prometheus.Desc
}

// NewSlotPoller registers the slot metrics on reg. Run polls.
func NewSlotPoller(reg prometheus.Registerer, db Querier, slot string, interval time.Duration, log *zap.Logger) *SlotPoller {
	if log == nil {
		log = zap.NewNop()
	}
	p := &SlotPoller{
		db: db, slot: slot, interval: interval, log: log, refresh: make(chan struct{}, 1),
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_slot_poll_errors_total",
			Help: "Failed polls of pg_replication_slots.",
		}),
		exists:    prometheus.NewDesc("outbox_relay_slot_exists", "1 when the relay's replication slot exists.", nil, nil),
		active:    prometheus.NewDesc("outbox_relay_slot_active", "1 while a process (this relay or another instance) streams from the slot.", nil, nil),
		walStatus: prometheus.NewDesc("outbox_relay_slot_wal_status", "The slot's wal_status: 1 on the current status's series (reserved, extended, unreserved, lost), 0 on the others. lost means events were lost.", []string{"status"}, nil),
		retained:  prometheus.NewDesc("outbox_relay_slot_retained_wal_bytes", "WAL the slot keeps on the server's disk: pg_current_wal_lsn() - restart_lsn.", nil, nil),
		lag:       prometheus.NewDesc("outbox_relay_slot_lag_bytes", "WAL written after the slot's confirmed position: pg_current_wal_lsn() - confirmed_flush_lsn.", nil, nil),
		safe:      prometheus.NewDesc("outbox_relay_slot_safe_wal_size_bytes", "WAL that may still be written before the slot is invalidated (lost); absent when max_slot_wal_keep_size is unlimited.", nil, nil),
		lsn:       prometheus.NewDesc("outbox_relay_slot_confirmed_flush_lsn", "The slot's confirmed_flush_lsn as a number: what PostgreSQL will not send again.", nil, nil),
		lastPoll:  prometheus.NewDesc("outbox_relay_slot_last_poll_timestamp_seconds", "Unix time of the last successful poll of the slot.", nil, nil),
	}
	reg.MustRegister(p)
	return p
}

// Describe implements prometheus.Collector.
func (p *SlotPoller) Describe(ch chan<- *prometheus.Desc) {
	p.errors.Describe(ch)
	for _, d := range []*prometheus.Desc{p.exists, p.active, p.walStatus, p.retained, p.lag, p.safe, p.lsn, p.lastPoll} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (p *SlotPoller) Collect(ch chan<- prometheus.Metric) {
	p.errors.Collect(ch)
	p.mu.Lock()
	s := p.last
	p.mu.Unlock()
	if s == nil {
		return
	}
	g := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	g(p.lastPoll, float64(s.At.UnixNano())/1e9)
	g(p.exists, b2f(s.Exists))
	g(p.active, b2f(s.Active))
	for _, st := range WALStatuses {
		g(p.walStatus, b2f(s.Exists && s.WALStatus == st), st)
	}
	if !s.Exists {
		return
	}
	g(p.retained, float64(s.RetainedBytes))
	g(p.lag, float64(s.LagBytes))
	g(p.lsn, float64(s.ConfirmedLSN))
	if s.SafeWALSize != nil {
		g(p.safe, float64(*s.SafeWALSize))
	}
}

// Last returns the last successful poll, or false before the first.
func (p *SlotPoller) Last() (SlotSnapshot, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.last == nil {
		return SlotSnapshot{}, false
	}
	return *p.last, true
}

// Poll polls once.
func (p *SlotPoller) Poll(ctx context.Context) error {
	qctx, cancel := context.WithTimeout(ctx, max(p.interval, 5*time.Second))
	defer cancel()
	s, err := PollSlot(qctx, p.db, p.slot)
	if err != nil {
		p.errors.Inc()
		return err
	}
	p.mu.Lock()
	p.last = &s
	p.mu.Unlock()
	return nil
}

// Run polls every interval until ctx ends, then returns nil. Failed polls
// are counted and logged (the first of a series as a warning), never
// returned: monitoring must not stop the relay.
func (p *SlotPoller) Run(ctx context.Context) error {
	return pollLoop(ctx, p.interval, p.refresh, p.log, "poll replication slot", p.Poll)
}

// Refresh asks Run for a poll now, without waiting for it: the relay calls
// it when it starts streaming, so the slot gauges do not read "inactive"
// for up to an interval after start.
func (p *SlotPoller) Refresh() { requestPoll(p.refresh) }

func requestPoll(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default: // a poll is already requested
	}
}

// pollLoop calls poll now, then every interval and on each refresh, until
// ctx ends.
func pollLoop(ctx context.Context, interval time.Duration, refresh <-chan struct{}, log *zap.Logger, what string, poll func(context.Context) error) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	failing := false
	for {
		err := poll(ctx)
		if ctx.Err() != nil {
			return nil
		}
		switch {
		case err != nil && !failing:
			log.Warn(what+" failed; retrying quietly until it succeeds", zap.Error(err))
			failing = true
		case err != nil:
			log.Debug(what+" failed", zap.Error(err))
		case failing:
			log.Info(what + " works again")
			failing = false
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		case <-refresh:
		}
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
