package telemetry

import (
	"context"
	"errors"
	"testing"
)

func TestSetup(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  map[string]string
		want string // Exporter, or "error"
	}{
		{"nothing set", nil, "none"},
		{"only a service name", map[string]string{"OTEL_SERVICE_NAME": "x"}, "none"},
		{"endpoint", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, "otlp http/protobuf"},
		{"traces endpoint", map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, "otlp http/protobuf"},
		{"grpc", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "otlp grpc"},
		{"traces protocol wins", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
			"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, "otlp grpc"},
		{"exporter otlp without endpoint", map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, "otlp http/protobuf"},
		{"exporter none", map[string]string{"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, "none"},
		{"sdk disabled", map[string]string{"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, "none"},
		{"console refused", map[string]string{"OTEL_TRACES_EXPORTER": "console"}, "error"},
		{"http/json refused", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for k, v := range tc.env {
				t.Setenv(k, v) // the exporters read their own settings
			}
			tr, err := Setup(context.Background(), func(k string) string { return tc.env[k] }, "test")
			if tc.want == "error" {
				if !errors.Is(err, ErrInvalid) {
					t.Fatalf("Setup = %v, want ErrInvalid", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tr.Shutdown(context.Background()) }()
			if tr.Exporter != tc.want || (tr.Provider == nil) != (tc.want == "none") {
				t.Fatalf("exporter %q provider %v, want %q", tr.Exporter, tr.Provider, tc.want)
			}
		})
	}
}
