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
	nc, err := connectNATS(cfg.NATS, log.Named("nats"), "outbox-relay "+cfg.Postgres.Slot)
	if err != nil {
		return err
	}
	defer nc.Close()
	var ready atomic.Bool
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	var rl *relay.Relay
	obs := metrics.NewRelay(reg, metrics.Gauges{
		InFlight:     func() float64 { return float64(rl.InFlight()) },
		ConfirmedLSN: func() float64 { return float64(rl.Tracker().Confirmed()) },
		OldestAge: func() float64 {
			if t := rl.Tracker().Oldest(); !t.IsZero() {
				return time.Since(t).Seconds()
			}
			return 0
		},
		Ready: func() float64 {
			if ready.Load() && nc.IsConnected() {
				return 1
			}
			return 0
		},
		StreamDurable: func() float64 { return float64(rl.StreamDurable()) },
		UnsettledTxs: func() float64 {
			txs, _ := rl.Tracker().Unsettled()
			return float64(txs)
		},
		UnsettledWALBytes: func() float64 {
			_, b := rl.Tracker().Unsettled()
			return float64(b)
		},
		IntakePaused: func() float64 {
			if rl.IntakePaused() {
				return 1
			}
			return 0
		},
		PublicationWrong: func() float64 {
			if rl.PublicationProblem() != nil {
				return 1
			}
			return 0
		},
		BackfillIncomplete: func() float64 {
			if rl.BackfillIncomplete() {
				return 1
			}
			return 0
		},
		Stall: func() metrics.Stall {
			st := rl.WatermarkStall()
			return metrics.Stall{Seconds: st.For.Seconds(), Key: st.Blocker.Key, Subject: st.Blocker.Subject}
		},
	})
	rl, err = relay.New(cfg.Relay(), nc, relay.WithLogger(log), relay.WithObserver(obs), relay.WithReadiness(ready.Store))
	if err != nil {
		return err
	}
	// The pollers and the reconcile loop share a small pool, apart from
	// the replication connection; it connects on first use.
	pool, err := sqlPool(ctx, cfg.Postgres.URL, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	mon, err := newMonitors(reg, pool, js, cfg, ready.Load, log)
	if err != nil {
		return err
	}

	g, gctx := errgroup.WithContext(ctx)
	mon.start(gctx, g)
	if cfg.HTTP.Listen != "" {
		srv := &http.Server{Handler: httpHandler(reg, cfg.HTTP.Pprof, func() bool { return ready.Load() && nc.IsConnected() }), ReadHeaderTimeout: 5 * time.Second}
		ln, err := net.Listen("tcp", cfg.HTTP.Listen)
		if err != nil {
			return err
		}
		log.Info("http listening", zap.String("addr", ln.Addr().String()))
		g.Go(func() error {
			if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			return nil
		})
		g.Go(func() error {
			<-gctx.Done()
			sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			return srv.Shutdown(sctx)
		})
	}
	g.Go(func() error {
		err := setupAndRun(gctx, cfg, nc, rl, log)
		if err == nil {
			// Stop the HTTP server too when the relay returns on shutdown.
			return context.Canceled
		}
		log.Error("relay stopped", zap.Error(err))
		if cfg.HTTP.Listen != "" && cfg.HTTP.LingerOnError > 0 {
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
	if errors.Is(err, context.Canceled) && ctx.Err() != nil {
		return nil
	}
	return err
}

// setupAndRun creates what is missing (auto_setup) and streams until ctx
// ends; it returns an error only for conditions that need an operator.
func setupAndRun(ctx context.Context, cfg config.Config, nc *nats.Conn, rl *relay.Relay, log *zap.Logger) error {
	if cfg.Postgres.AutoSetup {
		if err := autoSetup(ctx, cfg, nc, log); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("setup: %w", err)
		}
	}
	return rl.Run(ctx)
}

// autoSetup creates what is missing before streaming: with backfill, a new
// slot comes from an exported snapshot and the rows already waiting are
// published first.
func autoSetup(ctx context.Context, cfg config.Config, nc *nats.Conn, log *zap.Logger) error {
	if cfg.Postgres.Backfill {
		rep, err := backfill(ctx, cfg, nc, log, os.Stderr)
		if err != nil {
			return err
		}
		if rep.SlotCreated {
			log.Info("setup: created slot with snapshot and backfilled the outbox", zap.String("slot", cfg.Postgres.Slot), zap.Stringer("consistent_point", rep.ConsistentPoint), zap.Int("rows", rep.Rows), zap.Int("dead_lettered", rep.DeadLettered))
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

func httpHandler(reg *prometheus.Registry, withPprof bool, ready func() bool) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !ready() {
			http.Error(w, "not streaming", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ready\n"))
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
	slots     *metrics.SlotPoller
	streams   *metrics.StreamPoller
	reconcile *metrics.Reconcile
	loop      *reconcile.Loop // nil when reconcile.interval is 0
}

// newMonitors registers the monitors' metrics on reg; start runs them.
func newMonitors(reg prometheus.Registerer, pool *pgxpool.Pool, js jetstream.JetStream, cfg config.Config, active func() bool, log *zap.Logger) (*monitors, error) {
	mlog := log.Named("metrics")
	m := &monitors{
		slots:     metrics.NewSlotPoller(reg, pool, cfg.Postgres.Slot, cfg.Metrics.PollInterval, mlog),
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

// start runs the monitors in g until ctx ends. They never fail: a failed
// poll is counted and logged, and must not stop the relay.
func (m *monitors) start(ctx context.Context, g *errgroup.Group) {
	g.Go(func() error { return m.slots.Run(ctx) })
	g.Go(func() error { return m.streams.Run(ctx) })
	if m.loop != nil {
		g.Go(func() error { return m.loop.Run(ctx) })
	}
}
