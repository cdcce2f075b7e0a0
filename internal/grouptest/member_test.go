package grouptest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/consumer"
)

// Environment of a member process (the test binary re-executed).
const (
	envMember     = "GROUPTEST_MEMBER"
	envPostgres   = "GROUPTEST_POSTGRES_URL"
	envNATS       = "GROUPTEST_NATS_URL"
	envStream     = "GROUPTEST_STREAM"
	envPartitions = "GROUPTEST_PARTITIONS"
	envName       = "GROUPTEST_NAME"
	envPinnedTTL  = "GROUPTEST_PINNED_TTL" // optional, a time.Duration
	envNoVersion  = "GROUPTEST_NO_VERSION_CHECK"
	// envLogDir, when set (by whoever runs the tests), names a directory
	// where each member's output is written as well.
	envLogDir = "GROUPTEST_LOG_DIR"
	// envDefaults: the member runs with the library's default AckWait,
	// HandlerTimeout, RetryBase, RetryMax and Group.MemberTTL.
	envDefaults = "GROUPTEST_DEFAULTS"
)

// memberTTL is the members' Group.MemberTTL.
const memberTTL = 3 * time.Second

// memberMain runs one group member until SIGTERM: its handler records each
// application in the applied table, whose serial column is the order of
// application.
func memberMain() int {
	if err := runMember(); err != nil {
		fmt.Fprintln(os.Stderr, "member:", err)
		return 1
	}
	return 0
}

type recordHandler struct{ name string }

func (h recordHandler) Handle(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	_, err := tx.Exec(ctx, `INSERT INTO applied (consumer, event_id, aggregate_id, version, member, subject, seq, deliveries, stored) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`,
		h.name, m.ID, m.AggregateID, m.AggregateVersion, os.Getenv(envMember), m.Subject, int64(m.StreamSeq), int64(m.Deliveries), m.Stored)
	return err
}

func runMember() error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	partitions, err := strconv.Atoi(os.Getenv(envPartitions))
	if err != nil {
		return err
	}
	log, err := zap.NewDevelopment()
	if err != nil {
		return err
	}
	pcfg, err := pgxpool.ParseConfig(os.Getenv(envPostgres))
	if err != nil {
		return err
	}
	const workers = 4
	pcfg.MaxConns = workers + 2
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	nc, err := nats.Connect(os.Getenv(envNATS), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	name := os.Getenv(envName)
	cfg := consumer.Config{
		Name:           name,
		Stream:         os.Getenv(envStream),
		Workers:        workers,
		AckWait:        3 * time.Second,
		HandlerTimeout: 1500 * time.Millisecond,
		RetryBase:      50 * time.Millisecond,
		RetryMax:       time.Second,
		VersionCheck:   true,
		InitialVersion: 1,
		StatsInterval:  time.Second,
		Group: &consumer.GroupConfig{
			Partitions: partitions,
			Member:     os.Getenv(envMember),
			MemberTTL:  memberTTL,
		},
	}
	if os.Getenv(envNoVersion) == "1" {
		// Order then rests on the hand-off and the pin alone.
		cfg.VersionCheck, cfg.InitialVersion = false, 0
	}
	if os.Getenv(envDefaults) == "1" {
		cfg.AckWait, cfg.HandlerTimeout, cfg.RetryBase, cfg.RetryMax, cfg.Group.MemberTTL = 0, 0, 0, 0, 0
	}
	if v := os.Getenv(envPinnedTTL); v != "" {
		if cfg.Group.PinnedTTL, err = time.ParseDuration(v); err != nil {
			return err
		}
	}
	c, err := consumer.New(pool, js, cfg, recordHandler{name: name}, consumer.WithLogger(log.Named(os.Getenv(envMember))))
	if err != nil {
		return err
	}
	err = c.Run(ctx)
	if ctx.Err() != nil && errors.Is(err, context.Canceled) {
		// SIGTERM before the first assignment (Run says so with ctx's
		// error): as cmd/reward-consumer, a stop that was asked for.
		return nil
	}
	return err
}
