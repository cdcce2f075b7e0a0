package main

import (
	"context"
	"os"

	"github.com/nats-io/nats.go"
	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/dlq"
)

// newDLQCmd mounts the dead-letter tooling: consumers' dead letters in
// their databases (--consumer-db, env OUTBOX_RELAY_DLQ_CONSUMER_DB) and,
// with --relay, the relay's dead-letter stream from the relay's
// configuration.
func newDLQCmd(g *globals) *cobra.Command {
	return dlq.NewCommand(dlq.Deps{
		User:                os.Getenv("USER"),
		ConsumerDatabaseURL: os.Getenv("OUTBOX_RELAY_DLQ_CONSUMER_DB"),
		ConnectNATS: func(ctx context.Context) (*nats.Conn, error) {
			// The relay's dead letters need only the NATS keys: postgres.url
			// and tables may be left out (no -c at all, say).
			cfg, err := g.loadOnly("nats.")
			if err != nil {
				return nil, err
			}
			return connectNATS(cfg.NATS, zap.NewNop(), "outbox-relay dlq")
		},
		RelayTarget: func() (dlq.RelayTarget, error) {
			cfg, err := g.loadOnly("nats.")
			if err != nil {
				return dlq.RelayTarget{}, err
			}
			return dlq.RelayTarget{Stream: cfg.NATS.DeadLetterStream, AuditReplicas: cfg.NATS.Replicas}, nil
		},
	})
}
