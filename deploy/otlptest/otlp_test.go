package otlptest

import (
	"context"
	"net"
	"os"
	"strconv"
	"testing"
	"time"

	"go.opentelemetry.io/collector/component/componenttest"
	"go.opentelemetry.io/collector/consumer/consumertest"
	"go.opentelemetry.io/collector/pdata/ptrace"
	"go.opentelemetry.io/collector/receiver/otlpreceiver"
	"go.opentelemetry.io/collector/receiver/receivertest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-relay/outbox-relay/internal/telemetry"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/tracingtest"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

// freePort returns a loopback port nothing listens on now.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// startReceiver runs the Collector's OTLP receiver on loopback, gRPC and
// HTTP, delivering into a sink; it stops when the test ends.
func startReceiver(t *testing.T) (sink *consumertest.TracesSink, grpcPort, httpPort int) {
	t.Helper()
	grpcPort, httpPort = freePort(t), freePort(t)
	f := otlpreceiver.NewFactory()
	cfg := f.CreateDefaultConfig().(*otlpreceiver.Config)
	cfg.Protocols.GRPC.GetOrInsertDefault().NetAddr.Endpoint = "127.0.0.1:" + strconv.Itoa(grpcPort)
	cfg.Protocols.HTTP.GetOrInsertDefault().ServerConfig.NetAddr.Endpoint = "127.0.0.1:" + strconv.Itoa(httpPort)
	sink = new(consumertest.TracesSink)
	r, err := f.CreateTraces(context.Background(), receivertest.NewNopSettings(f.Type()), cfg, sink)
	testenv.Must(t, err, "create the OTLP receiver")
	testenv.Must(t, r.Start(context.Background(), componenttest.NewNopHost()), "start the OTLP receiver")
	t.Cleanup(func() { _ = r.Shutdown(context.Background()) })
	return sink, grpcPort, httpPort
}

// received flattens what the receiver got, checking each span's resource
// names the service.
func received(t *testing.T, all []ptrace.Traces, service string) []tracingtest.Span {
	t.Helper()
	var spans []tracingtest.Span
	for _, td := range all {
		for _, rs := range td.ResourceSpans().All() {
			if v, ok := rs.Resource().Attributes().Get("service.name"); !ok || v.AsString() != service {
				t.Errorf("resource service.name %v, want %s (OTEL_SERVICE_NAME)", v.AsString(), service)
			}
			for _, ss := range rs.ScopeSpans().All() {
				for _, s := range ss.Spans().All() {
					attrs := map[string]string{}
					for k, v := range s.Attributes().All() {
						attrs[k] = v.AsString()
					}
					var links []tracingtest.Link
					for _, l := range s.Links().All() {
						links = append(links, tracingtest.Link{TraceID: trace.TraceID(l.TraceID()), SpanID: trace.SpanID(l.SpanID())})
					}
					spans = append(spans, tracingtest.Span{
						Name: s.Name(), Kind: trace.SpanKind(s.Kind()), // both number kinds as OTLP does
						TraceID: trace.TraceID(s.TraceID()), SpanID: trace.SpanID(s.SpanID()), ParentSpanID: trace.SpanID(s.ParentSpanID()),
						Attributes: attrs, Links: links,
					})
				}
			}
		}
	}
	return spans
}

// TestTraceOverOTLP exports the writer's, the relay's and the consumer's
// spans with the exporter OTEL_EXPORTER_OTLP_ENDPOINT and
// OTEL_EXPORTER_OTLP_PROTOCOL choose, to a real OTLP receiver, and reads
// back one trace (writer → consumer) and the relay's batch span linked
// to it.
func TestTraceOverOTLP(t *testing.T) {
	sink, grpcPort, httpPort := startReceiver(t)
	for _, tc := range []struct {
		protocol string
		port     int
	}{{"grpc", grpcPort}, {"http/protobuf", httpPort}} {
		t.Run(tc.protocol, func(t *testing.T) {
			sink.Reset()
			t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:"+strconv.Itoa(tc.port))
			t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", tc.protocol)
			t.Setenv("OTEL_SERVICE_NAME", "otlptest")
			t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
			tr, err := telemetry.Setup(t.Context(), os.Getenv, "outbox-relay")
			testenv.Must(t, err, "telemetry setup")
			if tr.Exporter != "otlp "+tc.protocol || tr.Provider == nil {
				t.Fatalf("exporter %q, want otlp %s", tr.Exporter, tc.protocol)
			}
			t.Cleanup(func() { _ = tr.Shutdown(context.Background()) })
			res := tracingtest.Run(t, tr.Provider, true)
			// The consumer's span ends after its ack; the batch span
			// processor exports every 50 ms (OTEL_BSP_SCHEDULE_DELAY).
			var spans []tracingtest.Span
			ok := testenv.WaitFor(30*time.Second, func() bool {
				spans = received(t, sink.AllTraces(), "otlptest")
				return len(spans) >= 3
			})
			if !ok {
				t.Fatalf("the receiver got %d spans, want 3", len(spans))
			}
			if msg := tracingtest.Check(res, spans, true); msg != "" {
				t.Fatal(msg)
			}
		})
	}
}
