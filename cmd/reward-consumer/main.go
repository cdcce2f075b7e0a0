// Command reward-consumer is the seed lesson's reward service: it consumes
// RegistrationConfirmed events from the relay's JetStream stream with the
// idempotent consumer library and credits points to the registration's
// player through apply_reward_event, once per event however often the event
// is delivered.
//
// Its database needs sql/consumer.sql and sql/reward.sql. Each flag falls
// back to an environment variable:
//
//	--postgres-url  REWARD_CONSUMER_POSTGRES_URL  the reward database (required)
//	--nats-url      REWARD_CONSUMER_NATS_URL      default nats://127.0.0.1:4222
//	--stream        REWARD_CONSUMER_STREAM        default OUTBOX
//	--consumer      REWARD_CONSUMER_NAME          durable consumer name, default reward-consumer
//	--filter-subject REWARD_CONSUMER_FILTER_SUBJECT  e.g. outbox.registration.>; default the whole stream
//	--points        REWARD_CONSUMER_POINTS        points per confirmed registration, default 10
//	--owner         REWARD_CONSUMER_OWNER         owner of the dead letters, default rewards-team
//	--metrics-listen REWARD_CONSUMER_METRICS_LISTEN  address for /metrics; empty disables
//	--batch-size    most messages a worker applies in one transaction, default 64
//	--log-level     REWARD_CONSUMER_LOG_LEVEL     debug, info, warn or error; default info
//	--log-format    REWARD_CONSUMER_LOG_FORMAT    json (default) or console
//	--group-partitions REWARD_CONSUMER_GROUP_PARTITIONS  run as a member of the consumer
//	                 group --consumer over a stream partitioned into this many
//	                 partitions (nats.partitions of the relay); 0 (default): a
//	                 single consumer
//	--group-member  REWARD_CONSUMER_GROUP_MEMBER  this process's member id in the
//	                 group; default <host>-<pid>-<random>
//	--retry-max     longest retry backoff (default 30s); a dead member's
//	                 partitions move after --ack-wait + --retry-max + 3s
//
// Three copies with the same --consumer and --group-partitions share the
// stream: each partition is consumed by one of them at a time, and the
// others take a dead copy's partitions over (docs/consumer.md "Consumer
// groups").
//
// Traces: with OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_TRACES_EXPORTER=otlp)
// set, each message's transaction is a span exported over OTLP (HTTP, or
// gRPC with OTEL_EXPORTER_OTLP_PROTOCOL=grpc), a child of the trace context
// the event carries; without them, no spans.
//
// REWARD_CONSUMER_TEST_CRASH_AFTER_COMMIT, for fault tests only, names a
// file: after the first transaction commits, the process writes the event
// id there and hangs before acknowledging, waiting to be killed.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"

	"github.com/outbox-relay/outbox-relay/consumer"
	"github.com/outbox-relay/outbox-relay/internal/logging"
	"github.com/outbox-relay/outbox-relay/internal/reward"
	"github.com/outbox-relay/outbox-relay/internal/telemetry"
)

const envPrefix = "REWARD_CONSUMER_"

type options struct {
	postgresURL   string
	natsURL       string
	stream        string
	name          string
	filterSubject string
	points        int
	ledger        string
	owner         string
	workers       int
	batchSize     int
	ackWait       time.Duration
	retryMax      time.Duration
	metricsListen string
	logLevel      string
	logFormat     string
	// Consumer group (docs/consumer.md "Consumer groups").
	groupPartitions int
	groupMember     string
}

func main() {
	err := run()
	switch {
	case errors.Is(err, flag.ErrHelp):
		// --help printed the usage: asking for it is no failure.
	case err != nil:
		fmt.Fprintln(os.Stderr, "reward-consumer:", err)
		os.Exit(1)
	}
}

func env(name, def string) string {
	if v, ok := os.LookupEnv(envPrefix + name); ok {
		return v
	}
	return def
}

func parseFlags() (options, error) {
	var o options
	points, err := strconv.Atoi(env("POINTS", "10"))
	if err != nil {
		return o, fmt.Errorf("%sPOINTS: %w", envPrefix, err)
	}
	fs := flag.NewFlagSet("reward-consumer", flag.ContinueOnError)
	fs.StringVar(&o.postgresURL, "postgres-url", env("POSTGRES_URL", ""), "PostgreSQL URL of the reward database (sql/consumer.sql and sql/reward.sql applied)")
	fs.StringVar(&o.natsURL, "nats-url", env("NATS_URL", nats.DefaultURL), "NATS server URL")
	fs.StringVar(&o.stream, "stream", env("STREAM", "OUTBOX"), "JetStream stream the relay publishes to")
	fs.StringVar(&o.name, "consumer", env("NAME", "reward-consumer"), "durable consumer name; also the consumer key of the dedup rows")
	fs.StringVar(&o.filterSubject, "filter-subject", env("FILTER_SUBJECT", ""), "consume only this subject filter (default: the whole stream)")
	fs.IntVar(&o.points, "points", points, "points credited per confirmed registration")
	fs.StringVar(&o.ledger, "ledger", env("LEDGER", "reward_account"), "apply_reward_event's consumer key (names the effect, see README)")
	fs.StringVar(&o.owner, "owner", env("OWNER", "rewards-team"), "who owns this consumer's dead letters")
	fs.IntVar(&o.workers, "workers", consumer.DefaultWorkers, "parallel workers (keyed by aggregate)")
	fs.IntVar(&o.batchSize, "batch-size", consumer.DefaultBatchSize, "most messages a worker applies in one transaction (1: one transaction per message)")
	fs.DurationVar(&o.ackWait, "ack-wait", consumer.DefaultAckWait, "JetStream ack wait of the durable consumer")
	fs.DurationVar(&o.retryMax, "retry-max", consumer.DefaultRetryMax, "longest retry backoff; in a group, a dead member's partitions move after ack-wait + retry-max + 3s")
	fs.StringVar(&o.metricsListen, "metrics-listen", env("METRICS_LISTEN", ""), "address serving /metrics (e.g. 127.0.0.1:9464); empty disables")
	fs.StringVar(&o.logLevel, "log-level", env("LOG_LEVEL", "info"), "debug, info, warn or error")
	fs.StringVar(&o.logFormat, "log-format", env("LOG_FORMAT", logging.FormatJSON), "json or console")
	groupPartitions, err := strconv.Atoi(env("GROUP_PARTITIONS", "0"))
	if err != nil {
		return o, fmt.Errorf("%sGROUP_PARTITIONS: %w", envPrefix, err)
	}
	fs.IntVar(&o.groupPartitions, "group-partitions", groupPartitions, "run as a member of consumer group --consumer over a stream partitioned into this many partitions (the relay's nats.partitions); 0: a single consumer")
	fs.StringVar(&o.groupMember, "group-member", env("GROUP_MEMBER", ""), "this process's member id in the group (default <host>-<pid>-<random>)")
	if err := fs.Parse(os.Args[1:]); err != nil {
		return o, err
	}
	switch {
	case o.postgresURL == "":
		return o, fmt.Errorf("set --postgres-url or %sPOSTGRES_URL to the reward database", envPrefix)
	case o.groupPartitions < 0:
		return o, fmt.Errorf("--group-partitions %d: want 0 (no group) or the stream's partition count", o.groupPartitions)
	case o.groupPartitions > 0 && o.filterSubject != "":
		return o, errors.New("--filter-subject cannot be combined with --group-partitions: each partition's durable filters its own partition")
	case o.batchSize < 1:
		return o, fmt.Errorf("--batch-size %d: want 1 (one transaction per message) or more (up to that many messages in one transaction; default %d)", o.batchSize, consumer.DefaultBatchSize)
	case o.points < 1 || o.points > math.MaxInt32:
		return o, fmt.Errorf("--points %d: want 1 to %d (apply_reward_event takes a positive integer)", o.points, math.MaxInt32)
	}
	return o, nil
}

func run() error {
	o, err := parseFlags()
	if err != nil {
		return err
	}
	log, err := logging.New(o.logLevel, o.logFormat)
	if err != nil {
		return fmt.Errorf("--log-level/--log-format: %w", err)
	}
	defer func() { _ = log.Sync() }()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	pcfg, err := pgxpool.ParseConfig(o.postgresURL)
	if err != nil {
		return fmt.Errorf("--postgres-url: %w", err)
	}
	// One connection per worker plus the replay and gauge loops.
	pcfg.MaxConns = int32(o.workers + 2)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return fmt.Errorf("connect to postgres: %w", err)
	}
	defer pool.Close()
	nc, err := nats.Connect(o.natsURL, nats.Name("reward-consumer"), nats.MaxReconnects(-1))
	if err != nil {
		return fmt.Errorf("connect to nats: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	cfg := consumer.Config{
		Name:      o.name,
		Stream:    o.stream,
		Owner:     o.owner,
		Workers:   o.workers,
		BatchSize: o.batchSize,
		AckWait:   o.ackWait,
		RetryMax:  o.retryMax,
		// Registrations change without emitting an event (creation), and
		// this consumer takes one event type: versions skip legitimately,
		// so version checking is off; the event id and the ledger dedup.
		EventTypes: []string{reward.EventType},
	}
	if o.filterSubject != "" {
		cfg.FilterSubjects = []string{o.filterSubject}
	}
	if o.groupPartitions > 0 {
		cfg.Group = &consumer.GroupConfig{Partitions: o.groupPartitions, Member: o.groupMember}
	}
	opts := []consumer.Option{consumer.WithLogger(log), consumer.WithRegisterer(reg)}
	// Spans when the OTEL_* variables name an exporter (README, "Tracing").
	tr, err := telemetry.Setup(ctx, os.Getenv, "reward-consumer")
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := tr.Shutdown(sctx); err != nil {
			log.Warn("flush trace spans", zap.Error(err))
		}
	}()
	if tr.Provider != nil {
		log.Info("tracing on", zap.String("exporter", tr.Exporter))
		opts = append(opts, consumer.WithTracerProvider(tr.Provider))
	}
	if path := os.Getenv(envPrefix + "TEST_CRASH_AFTER_COMMIT"); path != "" {
		opts = append(opts, consumer.WithAfterCommit(crashAfterCommit(path)))
	}
	c, err := consumer.New(pool, js, cfg, &reward.Handler{Ledger: o.ledger, Points: int32(o.points)}, opts...)
	if err != nil {
		return err
	}

	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return c.Run(gctx) })
	if o.metricsListen != "" {
		srv := &http.Server{Addr: o.metricsListen, Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{}), ReadHeaderTimeout: 5 * time.Second}
		g.Go(func() error {
			if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("metrics server: %w", err)
			}
			return nil
		})
		g.Go(func() error {
			<-gctx.Done()
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			return srv.Shutdown(sctx)
		})
	}
	err = g.Wait()
	if ctx.Err() != nil && errors.Is(err, context.Canceled) {
		// Told to stop (SIGTERM, Ctrl-C) before the consumer had set up
		// (Run says so with ctx's error): stopping is what was asked for.
		log.Info("stopped before the consumer started", zap.Error(err))
		return nil
	}
	return err
}

// crashAfterCommit simulates a crash between commit and ack: it reports the
// committed event in path and blocks the worker forever, so that the test
// can kill the process before the ack is sent.
func crashAfterCommit(path string) func(*consumer.Message) {
	return func(m *consumer.Message) {
		_ = os.WriteFile(path, []byte(m.ID), 0o600)
		select {}
	}
}
