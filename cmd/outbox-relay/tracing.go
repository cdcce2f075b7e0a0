package main

import (
	"context"
	"os"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/telemetry"
	"github.com/outbox-relay/outbox-relay/relay"
)

// setupTracing builds the exporter the OTEL_* variables describe and
// returns the relay options that turn relay spans on (tracing.relay_spans),
// and what flushes the spans at exit.
func setupTracing(ctx context.Context, cfg config.Tracing, log *zap.Logger) ([]relay.Option, func(), error) {
	tr, err := telemetry.Setup(ctx, os.Getenv, "outbox-relay")
	if err != nil {
		return nil, nil, err
	}
	shutdown := func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := tr.Shutdown(sctx); err != nil {
			log.Warn("flush trace spans", zap.Error(err))
		}
	}
	switch {
	case !cfg.RelaySpans:
		return nil, shutdown, nil
	case tr.Provider == nil:
		log.Warn("tracing.relay_spans is on but no trace exporter is configured: set OTEL_EXPORTER_OTLP_ENDPOINT (and OTEL_EXPORTER_OTLP_PROTOCOL grpc or http/protobuf)")
		return nil, shutdown, nil
	}
	log.Info("relay spans on", zap.String("exporter", tr.Exporter))
	return []relay.Option{relay.WithTracerProvider(tr.Provider)}, shutdown, nil
}
