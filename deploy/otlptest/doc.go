// Package otlptest checks that the relay's and the consumer library's
// spans reach a real OTLP receiver — the OpenTelemetry Collector's
// otlpreceiver, over gRPC and over HTTP — through the exporter the
// binaries build from the OTEL_* variables (internal/telemetry), and form
// one trace from the writer's transaction to the consumer's.
//
// It is a module of its own so that the Collector's dependencies stay out
// of the relay's go.mod; `make test` runs it (test-deploy).
package otlptest
