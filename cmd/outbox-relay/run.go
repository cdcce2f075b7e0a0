package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/internal/reconcile"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
)

func newRunCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "run",
		Short: "Stream the outbox to JetStream until SIGINT/SIGTERM",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			g.logWarnings = true
			cfg, err := g.load()
			if err != nil {
				return err
			}
			log, err := newLogger(cfg.Log)
			if err != nil {
				return err
			}
			defer func() { _ = log.Sync() }()
			for _, w := range cfg.Warnings {
				log.Warn("configuration: " + w)
			}
			ctx, stop := signalContext()
			defer stop()
			return run(ctx, cfg, log)
		},
	}
}

func run(ctx context.Context, cfg config.Config, log *zap.Logger) error {
	log.Info("starting", zap.String("version", version), zap.String("slot", cfg.Postgres.Slot), zap.String("stream", cfg.NATS.Stream), zap.Strings("tables", cfg.Tables()))
	// The relay and the NATS connection come after the HTTP server: while
	// a server is still unreachable at start, /healthz answers 200 and
	// /readyz 503, and the gauges read as idle.
	var (
		ready atomic.Bool
		rlp   atomic.Pointer[relay.Relay]
		ncp   atomic.Pointer[nats.Conn]
	)
	connected := func() bool {
		nc := ncp.Load()
		return nc != nil && nc.IsConnected()
	}
	streaming := func() bool { return ready.Load() && connected() }
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	obs := &standbyObserver{Relay: metrics.NewRelay(reg, relayGauges(&rlp, streaming))}
	traceOpts, flushSpans, err := setupTracing(ctx, cfg.Tracing, log)
	if err != nil {
		return err
	}
	defer flushSpans()
	standingBy := func() bool { return connected() && obs.recent(standbyFresh) }

	g, gctx := errgroup.WithContext(ctx)
	if cfg.HTTP.Listen != "" {
		if err := serveHTTP(gctx, g, cfg.HTTP, httpHandler(reg, cfg.HTTP.Pprof, streaming, standingBy, notReadyReason(&rlp, connected)), log); err != nil {
			return err
		}
	}
	g.Go(func() error {
		err := startAndRun(gctx, cfg, log, obs, reg, &rlp, &ncp, &ready, traceOpts...)
		if err == nil || gctx.Err() != nil && errors.Is(err, gctx.Err()) {
			// Done, or stopped while still waiting for a server: stop the
			// HTTP server too.
			return context.Canceled
		}
		log.Error("relay stopped", zap.Error(err))
		if cfg.HTTP.Listen != "" && cfg.HTTP.LingerOnError > 0 && lingerHelps(err) {
			// Stay observable before exiting: /metrics shows why (a lost
			// slot in outbox_relay_slot_wal_status) and /readyz is 503, so
			// alerts fire even while an orchestrator restarts the process.
			log.Info("serving metrics before exiting", zap.Duration("linger", cfg.HTTP.LingerOnError))
			select {
			case <-time.After(cfg.HTTP.LingerOnError):
			case <-gctx.Done():
			}
		}
		return err
	})
	err = g.Wait()
	if nc := ncp.Load(); nc != nil {
		nc.Close()
	}
	if errors.Is(err, context.Canceled) && ctx.Err() != nil {
		return nil
	}
	return err
}

// relayGauges reads the relay's in-memory figures, as idle values before
// the relay exists.
func relayGauges(rlp *atomic.Pointer[relay.Relay], streaming func() bool) metrics.Gauges {
	return metrics.Gauges{
		InFlight: func() float64 {
			if rl := rlp.Load(); rl != nil {
				return float64(rl.InFlight())
			}
			return 0
		},
		ConfirmedLSN: func() float64 {
			if rl := rlp.Load(); rl != nil {
				return float64(rl.Tracker().Confirmed())
			}
			return 0
		},
		OldestAge: func() float64 {
			if rl := rlp.Load(); rl != nil {
				if t := rl.Tracker().Oldest(); !t.IsZero() {
					return time.Since(t).Seconds()
				}
			}
			return 0
		},
		Ready: func() float64 {
			if streaming() {
				return 1
			}
			return 0
		},
		StreamDurable: func() float64 {
			if rl := rlp.Load(); rl != nil {
				return float64(rl.StreamDurable())
			}
			return -1
		},
		UnsettledTxs: func() float64 {
			if rl := rlp.Load(); rl != nil {
				txs, _ := rl.Tracker().Unsettled()
				return float64(txs)
			}
			return 0
		},
		UnsettledWALBytes: func() float64 {
			if rl := rlp.Load(); rl != nil {
				_, b := rl.Tracker().Unsettled()
				return float64(b)
			}
			return 0
		},
		IntakePaused:            relayFlag(rlp, (*relay.Relay).IntakePaused),
		PublicationWrong:        relayFlag(rlp, func(rl *relay.Relay) bool { return rl.PublicationProblem() != nil }),
		StreamWrong:             relayFlag(rlp, func(rl *relay.Relay) bool { return rl.StreamProblem() != nil }),
		PublicationCheckFailing: relayFlag(rlp, func(rl *relay.Relay) bool { return rl.PublicationCheckFailure() != nil }),
		BackfillIncomplete:      relayFlag(rlp, (*relay.Relay).BackfillIncomplete),
		TraceHeadersDropped: func() float64 {
			if rl := rlp.Load(); rl != nil {
				return float64(rl.TraceHeadersDropped())
			}
			return 0
		},
		Stall: func() metrics.Stall {
			rl := rlp.Load()
			if rl == nil {
				return metrics.Stall{}
			}
			st := rl.WatermarkStall()
			return metrics.Stall{Seconds: st.For.Seconds(), Key: st.Blocker.Key, Subject: st.Blocker.Subject}
		},
	}
}

// notReadyReason says why /readyz answers 503: the relay's reason, or what
// it waits for before it exists.
func notReadyReason(rlp *atomic.Pointer[relay.Relay], connected func() bool) func() string {
	return func() string {
		rl := rlp.Load()
		switch {
		case rl == nil:
			return "starting (waiting for NATS and PostgreSQL)"
		case !connected():
			return "not connected to NATS"
		}
		if why := rl.NotReadyReason(); why != "" {
			return why
		}
		return "not streaming"
	}
}

// relayFlag reads a yes/no of the relay as 1 or 0; 0 before the relay exists.
func relayFlag(rlp *atomic.Pointer[relay.Relay], f func(*relay.Relay) bool) func() float64 {
	return func() float64 {
		if rl := rlp.Load(); rl != nil && f(rl) {
			return 1
		}
		return 0
	}
}

// serveHTTP listens on c.Listen and serves h in g until ctx ends.
func serveHTTP(ctx context.Context, g *errgroup.Group, c config.HTTP, h http.Handler, log *zap.Logger) error {
	ln, err := net.Listen("tcp", c.Listen)
	if err != nil {
		return fmt.Errorf("http.listen %s: %w (another process, or a second relay on this host, uses the address: give each instance its own, e.g. --http-listen 127.0.0.1:9188)", c.Listen, err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	log.Info("http listening", zap.String("addr", ln.Addr().String()))
	g.Go(func() error {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	})
	g.Go(func() error {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		return srv.Shutdown(sctx)
	})
	return nil
}

// startAndRun waits for NATS and PostgreSQL (servers that are down at start
// are waited for, with backoff; refusals that need an operator end it at
// once), builds the relay and streams until ctx ends.
func startAndRun(ctx context.Context, cfg config.Config, log *zap.Logger, obs relay.Observer, reg prometheus.Registerer,
	rlp *atomic.Pointer[relay.Relay], ncp *atomic.Pointer[nats.Conn], ready *atomic.Bool, opts ...relay.Option) (err error) {
	// The pollers and the reconcile loop share a small pool, apart from
	// the replication connection; it connects on first use.
	pool, err := sqlPool(ctx, cfg.Postgres.URL, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	// The slot's gauges need PostgreSQL only: polled from the start, not
	// after NATS answered (slow on a loaded machine, or down), so that a
	// lost slot shows on /metrics while the relay still waits for the
	// broker, and while it lingers on its refusal.
	slots := metrics.NewSlotPoller(reg, pool, cfg.Postgres.Slot, cfg.Metrics.PollInterval, log.Named("metrics"))
	sctx, stopSlots := context.WithCancel(ctx)
	slotsDone := make(chan struct{})
	go func() {
		defer close(slotsDone)
		_ = slots.Run(sctx)
	}()
	defer func() {
		stopSlots()
		<-slotsDone
		if err != nil && ctx.Err() == nil {
			// The relay stops on a refusal (a lost slot among them) and
			// run lingers to show why on /metrics: the gauges must show
			// the slot as it is now. A refusal can come before the first
			// poll finished (stopSlots cancelled it: a loaded machine, in
			// TestSlotInvalidatedStatus), or after the last poll saw the
			// slot still whole.
			_ = slots.Poll(ctx)
		}
	}()
	attempts := &natsAttempts{}
	nc, err := dialNATS(cfg.NATS, log.Named("nats"), "outbox-relay "+cfg.Postgres.Slot, attempts)
	if err != nil {
		return err
	}
	ncp.Store(nc)
	if err := waitNATS(ctx, nc, attempts, cfg.NATS.URL, 0, log); err != nil {
		return err
	}
	var mon *monitors // set before the relay runs, which is when readiness changes
	readiness := func(streaming bool) {
		ready.Store(streaming)
		if streaming {
			mon.refresh()
		}
	}
	rl, err := relay.New(cfg.Relay(), nc, append([]relay.Option{relay.WithLogger(log), relay.WithObserver(obs), relay.WithReadiness(readiness)}, opts...)...)
	if err != nil {
		return err
	}
	rlp.Store(rl)
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	mon, err = newMonitors(reg, pool, js, slots, cfg, ready.Load, log)
	if err != nil {
		return err
	}
	g, gctx := errgroup.WithContext(ctx)
	mon.start(gctx, g)
	g.Go(func() error {
		err := setupAndRun(gctx, cfg, nc, rl, log)
		if err == nil {
			return context.Canceled // stop the monitors
		}
		return err
	})
	err = g.Wait()
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

// setupAndRun creates what is missing (auto_setup), or checks that it
// exists, and streams until ctx ends; it returns an error only for
// conditions that need an operator. A PostgreSQL server that cannot be
// reached yet is waited for.
func setupAndRun(ctx context.Context, cfg config.Config, nc *nats.Conn, rl *relay.Relay, log *zap.Logger) error {
	// Without auto_setup the relay checks the publication and the slot
	// itself, naming the fix; this only tells a server that is not there
	// yet (waited for) from one that refuses us (an error at once).
	prepare := func() error {
		_, err := replication.Status(ctx, cfg.Postgres.URL, cfg.Postgres.Slot)
		return err
	}
	if cfg.Postgres.AutoSetup {
		prepare = func() error { return autoSetup(ctx, cfg, nc, log) }
	}
	if err := retryStartup(ctx, log, prepare); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		if cfg.Postgres.AutoSetup {
			return fmt.Errorf("setup: %w", causeFirst{err})
		}
		return causeFirst{err}
	}
	return rl.Run(ctx)
}

// autoSetup creates what is missing before streaming: with backfill, a new
// slot comes from an exported snapshot and the rows already waiting are
// published first.
func autoSetup(ctx context.Context, cfg config.Config, nc *nats.Conn, log *zap.Logger) error {
	// PostgreSQL before anything is created, as setup does.
	if err := replication.Preflight(ctx, cfg.Replication()); err != nil {
		return err
	}
	if err := refuseSlotLostInFailover(ctx, cfg, nc); err != nil {
		return err
	}
	// The streams first, as setup does: a stream that does not fit the
	// configuration must stop us before a slot retains WAL. Their
	// warnings are the relay's to log when it starts streaming.
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	events, dlq := cfg.Streams()
	for _, spec := range []provision.StreamSpec{events, dlq} {
		if _, err := provision.EnsureStream(ctx, js, spec, cfg.NATS.CreateStreams); err != nil {
			return err
		}
	}
	if cfg.Postgres.Backfill {
		rep, err := backfill(ctx, cfg, nc, log, os.Stderr)
		if err != nil {
			return err
		}
		if rep.SlotCreated {
			log.Info("setup: created slot with snapshot and backfilled the outbox", zap.String("slot", cfg.Postgres.Slot), zap.Stringer("consistent_point", rep.ConsistentPoint), zap.Int("rows", rep.Rows), zap.Int("dead_lettered", rep.DeadLettered), zap.Int("already_streamed", rep.AlreadyStreamed), zap.Int("expired", rep.Expired))
		}
	}
	rep, err := replication.Setup(ctx, cfg.Replication())
	if err != nil {
		return err
	}
	for _, a := range rep.Actions {
		log.Info("setup: " + a)
	}
	return nil
}

// standbyFresh is how recent a standby's last try for the slot must be for
// it to count as a healthy standby: it tries every 2 s at most.
const standbyFresh = 10 * time.Second

// standbyObserver remembers when this instance last found the slot held by
// another one.
type standbyObserver struct {
	*metrics.Relay
	last atomic.Int64 // unix nanoseconds
}

// StandingBy implements relay.Observer.
func (o *standbyObserver) StandingBy() {
	o.last.Store(time.Now().UnixNano())
	o.Relay.StandingBy()
}

func (o *standbyObserver) recent(d time.Duration) bool {
	t := o.last.Load()
	return t != 0 && time.Since(time.Unix(0, t)) < d
}

// httpHandler serves /metrics, /healthz and /readyz. /readyz answers 200
// while this instance streams; /readyz?standby=ok also while it is a
// healthy standby (NATS connected, PostgreSQL answering that another
// instance holds the slot), the rule for orchestrators that roll one
// instance at a time (deploy/helm).
func httpHandler(reg *prometheus.Registry, withPprof bool, ready, standingBy func() bool, reason func() string) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		switch {
		case ready():
			_, _ = w.Write([]byte("ready\n"))
		case r.URL.Query().Get("standby") == "ok" && standingBy():
			_, _ = w.Write([]byte("standing by\n"))
		default:
			http.Error(w, "not ready: "+reason(), http.StatusServiceUnavailable)
		}
	})
	if withPprof {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	return mux
}

// monitors are the relay's metrics besides the pipeline's own: the slot and
// the streams polled on an interval, and the optional reconcile loop.
type monitors struct {
	slots     *metrics.SlotPoller // run by startAndRun, before NATS is waited for
	failover  *metrics.FailoverPoller
	streams   *metrics.StreamPoller
	reconcile *metrics.Reconcile
	loop      *reconcile.Loop // nil when reconcile.interval is 0
}

// newMonitors registers the monitors' metrics on reg (the slot poller's
// were registered by its maker); start runs them.
func newMonitors(reg prometheus.Registerer, pool *pgxpool.Pool, js jetstream.JetStream, slots *metrics.SlotPoller, cfg config.Config, active func() bool, log *zap.Logger) (*monitors, error) {
	mlog := log.Named("metrics")
	m := &monitors{
		slots:     slots,
		failover:  metrics.NewFailoverPoller(reg, cfg.Postgres.URL, cfg.Postgres.Slot, cfg.Metrics.PollInterval, mlog),
		streams:   metrics.NewStreamPoller(reg, js, cfg.NATS.Stream, cfg.NATS.DeadLetterStream, cfg.Metrics.PollInterval, mlog),
		reconcile: metrics.NewReconcile(reg),
	}
	if cfg.Reconcile.Interval > 0 {
		loop, err := reconcile.NewLoop(pool, js, reconcile.LoopConfig{
			Config:   reconcileConfig(cfg),
			Interval: cfg.Reconcile.Interval,
			Window:   cfg.Reconcile.Window,
			Active:   active,
		}, m.reconcile, reconcile.WithLogger(log))
		if err != nil {
			return nil, err
		}
		m.loop = loop
	}
	return m, nil
}

// refresh polls the slot and the streams now: streaming just began, and
// the gauges still show the state from before.
func (m *monitors) refresh() {
	m.slots.Refresh()
	m.streams.Refresh()
}

// start runs the monitors in g until ctx ends. They never fail: a failed
// poll is counted and logged, and must not stop the relay.
func (m *monitors) start(ctx context.Context, g *errgroup.Group) {
	g.Go(func() error { return m.failover.Run(ctx) })
	g.Go(func() error { return m.streams.Run(ctx) })
	if m.loop != nil {
		g.Go(func() error { return m.loop.Run(ctx) })
	}
}
