package reconcile

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
)

// Observer receives the outcome of every run of a Loop (metrics).
type Observer interface {
	Reconciled(rep *Report, err error)
}

// LoopConfig configures a Loop.
type LoopConfig struct {
	// Config is what to compare; Since and Until are set per run.
	Config
	// Interval is the time between runs. Each run reads the window's rows
	// and events, so minutes rather than seconds.
	Interval time.Duration
	// Window is how far back each run looks: rows with an occurred-at time
	// in [now-Window, now).
	Window time.Duration
	// Active gates each run; nil runs always. The relay passes its
	// readiness, so that only the instance streaming from the slot
	// reconciles.
	Active func() bool
}

// Loop reconciles a recent window periodically and reports to an Observer,
// so the differences are on the relay's /metrics.
type Loop struct {
	db   DB
	js   jetstream.JetStream
	cfg  LoopConfig
	obs  Observer
	opts []Option
	log  *zap.Logger
}

// NewLoop returns a Loop; Run starts it.
func NewLoop(db DB, js jetstream.JetStream, cfg LoopConfig, obs Observer, opts ...Option) (*Loop, error) {
	if cfg.Interval <= 0 {
		return nil, fmt.Errorf("%w: interval %s must be positive", ErrInvalidConfig, cfg.Interval)
	}
	if cfg.Window <= 0 {
		return nil, fmt.Errorf("%w: window %s must be positive", ErrInvalidConfig, cfg.Window)
	}
	if cfg.ConfirmWait == 0 {
		cfg.ConfirmWait = min(DefaultConfirmWait, cfg.Interval/2)
	}
	o := newOptions(opts)
	return &Loop{db: db, js: js, cfg: cfg, obs: obs, opts: opts, log: o.log.Named("reconcile")}, nil
}

// firstRun bounds the wait before the first run, so the metrics are
// filled soon after a start rather than one interval later.
const firstRun = 2 * time.Second

// Run reconciles until ctx ends, then returns nil: first soon after the
// start (once active), then every Interval. A failed run is logged and
// reported to the Observer; the next one runs on time.
func (l *Loop) Run(ctx context.Context) error {
	wait := min(l.cfg.Interval, firstRun)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
		if l.cfg.Active != nil && !l.cfg.Active() {
			// A standby: look again soon, it may take over.
			wait = min(l.cfg.Interval, firstRun)
			continue
		}
		start := time.Now()
		l.once(ctx)
		wait = max(l.cfg.Interval-time.Since(start), 0)
	}
}

func (l *Loop) once(ctx context.Context) {
	cfg := l.cfg.Config
	cfg.Until = time.Now()
	cfg.Since = cfg.Until.Add(-l.cfg.Window)
	// A hung run must not stop the loop for good.
	rctx, cancel := context.WithTimeout(ctx, max(l.cfg.Interval, 5*time.Minute))
	defer cancel()
	rep, err := Run(rctx, l.db, l.js, cfg, l.opts...)
	if ctx.Err() != nil {
		return // shutting down: not a failed run
	}
	l.obs.Reconciled(rep, err)
	switch {
	case err != nil:
		l.log.Warn("reconcile failed", zap.Error(err))
	case rep.Total.Missing > 0 || rep.Total.Unexpected > 0:
		l.log.Warn("reconcile found differences; run `outbox-relay reconcile` for the list",
			zap.Int("missing", rep.Total.Missing), zap.Int("unexpected", rep.Total.Unexpected),
			zap.Int("dead_lettered", rep.Total.DeadLettered), zap.Int("rows", rep.Total.Rows),
			zap.Time("since", rep.Since), zap.Time("until", rep.Until))
	default:
		l.log.Debug("reconciled", zap.Int("rows", rep.Total.Rows), zap.Int("pending", rep.Total.Pending), zap.Duration("took", rep.Duration))
	}
}
