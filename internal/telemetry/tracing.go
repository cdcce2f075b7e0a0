// Package telemetry builds the binaries' OpenTelemetry TracerProvider from
// the standard OTEL_* environment variables (the cmd layer passes their
// lookup in, so no package reads the environment on its own):
// https://opentelemetry.io/docs/specs/otel/configuration/sdk-environment-variables/
// and https://opentelemetry.io/docs/specs/otel/protocol/exporter/.
//
// The libraries (relay, consumer) take a trace.TracerProvider and default
// to none; this package decides which one a binary passes:
//
//   - no exporter (nil provider) when OTEL_SDK_DISABLED=true, when
//     OTEL_TRACES_EXPORTER=none, or when OTEL_TRACES_EXPORTER is unset and
//     no OTLP endpoint (OTEL_EXPORTER_OTLP_ENDPOINT or
//     OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set: an unconfigured binary
//     never tries to reach a collector;
//   - otherwise an OTLP exporter over HTTP (http/protobuf, the default) or
//     gRPC, chosen by OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or
//     OTEL_EXPORTER_OTLP_PROTOCOL, behind a batch span processor.
//
// The exporters read their own OTEL_EXPORTER_OTLP_* settings (endpoint,
// headers, TLS, timeout, compression), the SDK OTEL_TRACES_SAMPLER and
// OTEL_BSP_*, and the resource OTEL_SERVICE_NAME and
// OTEL_RESOURCE_ATTRIBUTES.
package telemetry

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// ErrInvalid is wrapped by every configuration error.
var ErrInvalid = errors.New("invalid OpenTelemetry configuration")

// Tracing is a configured TracerProvider.
type Tracing struct {
	// Provider is nil when no exporter is configured: pass nothing to the
	// libraries then.
	Provider trace.TracerProvider
	// Exporter describes the exporter for a log line, e.g. "otlp grpc";
	// "none" without one.
	Exporter string
	sdk      *sdktrace.TracerProvider
}

// Shutdown flushes the spans still buffered and stops the exporter; ctx
// bounds the wait.
func (t *Tracing) Shutdown(ctx context.Context) error {
	if t.sdk == nil {
		return nil
	}
	return t.sdk.Shutdown(ctx)
}

// Setup builds the TracerProvider described by the OTEL_* variables that
// getenv returns (os.Getenv in a binary). service is the default
// service.name (OTEL_SERVICE_NAME overrides it).
func Setup(ctx context.Context, getenv func(string) string, service string) (*Tracing, error) {
	none := &Tracing{Exporter: "none"}
	if strings.EqualFold(strings.TrimSpace(getenv("OTEL_SDK_DISABLED")), "true") {
		return none, nil
	}
	switch exp := strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER")); exp {
	case "none":
		return none, nil
	case "":
		if getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" && getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" {
			return none, nil
		}
	case "otlp":
	default:
		return nil, fmt.Errorf("%w: OTEL_TRACES_EXPORTER=%q: this binary exports traces with otlp only (or none)", ErrInvalid, exp)
	}
	protocol := strings.TrimSpace(getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"))
	if protocol == "" {
		protocol = strings.TrimSpace(getenv("OTEL_EXPORTER_OTLP_PROTOCOL"))
	}
	var (
		exporter sdktrace.SpanExporter
		err      error
	)
	switch protocol {
	case "", "http/protobuf":
		protocol = "http/protobuf"
		exporter, err = otlptracehttp.New(ctx)
	case "grpc":
		exporter, err = otlptracegrpc.New(ctx)
	default:
		return nil, fmt.Errorf("%w: OTEL_EXPORTER_OTLP_PROTOCOL=%q: use grpc or http/protobuf", ErrInvalid, protocol)
	}
	if err != nil {
		return nil, fmt.Errorf("otlp %s trace exporter: %w", protocol, err)
	}
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", service)),
		resource.WithTelemetrySDK(),
		resource.WithFromEnv(), // OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES: last, so they win
	)
	if err != nil {
		_ = exporter.Shutdown(ctx)
		return nil, fmt.Errorf("%w: OTEL_RESOURCE_ATTRIBUTES: %w", ErrInvalid, err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithResource(res))
	return &Tracing{Provider: tp, Exporter: "otlp " + protocol, sdk: tp}, nil
}
