package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.uber.org/zap"
	"go.yaml.in/yaml/v3"

	"github.com/outbox-relay/outbox-relay/consumer"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// recorder registers collectors and remembers the metric names they
// describe: a vector with no series yet is not in a Gather, but it is
// exported as soon as it has one.
type recorder struct {
	*prometheus.Registry
	names map[string]bool
}

var fqNameRE = regexp.MustCompile(`fqName: "([^"]+)"`)

func (r *recorder) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc)
	go func() { c.Describe(ch); close(ch) }()
	for d := range ch {
		if m := fqNameRE.FindStringSubmatch(d.String()); m != nil {
			r.names[m[1]] = true
		}
	}
	return r.Registry.Register(c)
}

func (r *recorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

// noDB and noJS stand in for dependencies consumer.New stores but does not
// use before Run.
type noDB struct{ consumer.DB }
type noJS struct{ jetstream.JetStream }

// exportedNames registers what `run` registers, and a consumer's metrics,
// and returns every metric name.
func exportedNames(t *testing.T) map[string]bool {
	t.Helper()
	rec := &recorder{Registry: prometheus.NewRegistry(), names: map[string]bool{}}
	rec.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	zero := func() float64 { return 0 }
	metrics.NewRelay(rec, metrics.Gauges{InFlight: zero, ConfirmedLSN: zero, OldestAge: zero, Ready: zero, StreamDurable: zero,
		UnsettledTxs: zero, UnsettledWALBytes: zero, IntakePaused: zero, BackfillIncomplete: zero, PublicationWrong: zero, PublicationCheckFailing: zero, StreamWrong: zero, TraceHeadersDropped: zero, Stall: func() metrics.Stall { return metrics.Stall{} }})
	cfg := config.Default()
	cfg.Reconcile.Interval = time.Minute
	if _, err := newMonitors(rec, nil, nil, cfg, func() bool { return true }, zap.NewNop()); err != nil {
		t.Fatal(err)
	}
	h := consumer.HandlerFunc(func(context.Context, pgx.Tx, *consumer.Message) error { return nil })
	if _, err := consumer.New(noDB{}, noJS{}, consumer.Config{Name: "c", Stream: "S"}, h, consumer.WithRegisterer(rec)); err != nil {
		t.Fatal(err)
	}
	// Histograms are queried through their series.
	out := map[string]bool{}
	for n := range rec.names {
		out[n] = true
		for _, s := range []string{"_bucket", "_sum", "_count"} {
			out[n+s] = true
		}
	}
	return out
}

// The expressions of the dashboard and of the alerts reference only
// metrics the relay or the consumer library export; every alert has a
// summary and a runbook that exists in docs/operations.md.
func TestDashboardAndAlertsReferenceExportedMetrics(t *testing.T) {
	root := testenv.RepoRoot(t)
	exported := exportedNames(t)
	used := map[string][]string{} // metric -> where

	// Dashboard.
	b, err := os.ReadFile(filepath.Join(root, "deploy", "grafana", "outbox-relay.json"))
	if err != nil {
		t.Fatal(err)
	}
	var dash map[string]any
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("dashboard JSON: %v", err)
	}
	var exprs []string
	walkJSON(dash, func(key string, v string) {
		switch key {
		case "expr":
			exprs = append(exprs, v)
		case "definition":
			if m := labelValuesRE.FindStringSubmatch(v); m != nil {
				used[m[1]] = append(used[m[1]], "dashboard variable")
			}
		}
	})
	if len(exprs) < 20 {
		t.Fatalf("dashboard has %d expressions", len(exprs))
	}
	for _, e := range exprs {
		names := metricNames(e)
		if len(names) == 0 {
			t.Errorf("dashboard expression %q references no metric", e)
		}
		for _, n := range names {
			used[n] = append(used[n], "dashboard: "+e)
		}
	}

	// Alerts.
	b, err = os.ReadFile(filepath.Join(root, "deploy", "prometheus", "alerts.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var rules struct {
		Groups []struct {
			Name  string `yaml:"name"`
			Rules []struct {
				Alert       string            `yaml:"alert"`
				Expr        string            `yaml:"expr"`
				For         string            `yaml:"for"`
				Labels      map[string]string `yaml:"labels"`
				Annotations map[string]string `yaml:"annotations"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	dec := yaml.NewDecoder(strings.NewReader(string(b)))
	dec.KnownFields(true)
	if err := dec.Decode(&rules); err != nil {
		t.Fatalf("alerts.yml: %v", err)
	}
	doc, err := os.ReadFile(filepath.Join(root, "docs", "operations.md"))
	if err != nil {
		t.Fatal(err)
	}
	anchors := markdownAnchors(string(doc))
	alerts := map[string]bool{}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			alerts[r.Alert] = true
			if r.Alert == "" || r.Expr == "" {
				t.Errorf("group %s: a rule without alert name or expression", g.Name)
			}
			if r.Labels["severity"] == "" || r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
				t.Errorf("alert %s: needs labels.severity, annotations.summary and annotations.description", r.Alert)
			}
			const prefix = "https://github.com/outbox-relay/outbox-relay/blob/main/docs/operations.md#"
			url := r.Annotations["runbook_url"]
			if !strings.HasPrefix(url, prefix) || !anchors[strings.TrimPrefix(url, prefix)] {
				t.Errorf("alert %s: runbook_url %q does not name a heading of docs/operations.md", r.Alert, url)
			}
			names := metricNames(r.Expr)
			if len(names) == 0 {
				t.Errorf("alert %s: expression %q references no metric", r.Alert, r.Expr)
			}
			for _, n := range names {
				used[n] = append(used[n], "alert "+r.Alert)
			}
		}
	}
	for _, want := range []string{"OutboxOldestUnpublishedEventOld", "OutboxSlotRetainedWALHigh", "OutboxSlotInactive", "OutboxSlotLost",
		"OutboxRelayDeadLettersGrowing", "OutboxRelayDeadLetterOld", "OutboxConsumerDeadLettersGrowing", "OutboxConsumerDeadLetterOld",
		"OutboxConsumerVersionGaps", "OutboxReconcileMissingEvents"} {
		if !alerts[want] {
			t.Errorf("alerts.yml has no %s alert", want)
		}
	}

	var missing []string
	for n, where := range used {
		if !exported[n] {
			missing = append(missing, n+" (used by "+where[0]+")")
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Fatalf("referenced but not exported:\n  %s", strings.Join(missing, "\n  "))
	}

	// Every metric docs/operations.md documents exists, and every exported
	// outbox metric is documented.
	docNames := map[string]bool{}
	for _, m := range docMetricRE.FindAllStringSubmatch(string(doc), -1) {
		docNames[m[1]] = true
	}
	for n := range exported {
		if (strings.HasPrefix(n, "outbox_relay_") || strings.HasPrefix(n, "outbox_consumer_")) && !isSeries(n) && !docNames[n] {
			t.Errorf("%s is exported but docs/operations.md does not document it", n)
		}
	}
	for n := range docNames {
		if !exported[n] {
			t.Errorf("docs/operations.md documents %s, which is not exported", n)
		}
	}
}

var (
	labelValuesRE = regexp.MustCompile(`label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)`)
	// A metric documented in a table row: | `name` | or | `name{labels}` |.
	docMetricRE = regexp.MustCompile("(?m)^\\| `((?:outbox_relay|outbox_consumer)_[a-z0-9_]+)")
)

func isSeries(n string) bool {
	return strings.HasSuffix(n, "_bucket") || strings.HasSuffix(n, "_sum") || strings.HasSuffix(n, "_count")
}

func walkJSON(v any, fn func(key, value string)) {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			if s, ok := e.(string); ok {
				fn(k, s)
			} else {
				walkJSON(e, fn)
			}
		}
	case []any:
		for _, e := range x {
			walkJSON(e, fn)
		}
	}
}

// markdownAnchors returns GitHub's anchors of the headings of a Markdown
// document: lower case, spaces to '-', punctuation other than '-' and '_'
// dropped.
func markdownAnchors(doc string) map[string]bool {
	out := map[string]bool{}
	for _, line := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(line, "#") {
			continue
		}
		h := strings.TrimSpace(strings.TrimLeft(line, "#"))
		var b strings.Builder
		for _, r := range strings.ToLower(h) {
			switch {
			case r == ' ':
				b.WriteByte('-')
			case r == '-' || r == '_' || (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9'):
				b.WriteRune(r)
			}
		}
		out[b.String()] = true
	}
	return out
}

// promqlKeywords are identifiers that are not metric names.
var promqlKeywords = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
	"and": true, "or": true, "unless": true, "bool": true, "offset": true, "inf": true, "nan": true,
}

// promqlAggregations may be followed by a by/without clause before their
// parenthesis.
var promqlAggregations = map[string]bool{
	"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true, "stdvar": true,
	"count": true, "count_values": true, "bottomk": true, "topk": true, "quantile": true, "limitk": true, "limit_ratio": true,
}

// metricNames returns the metric names a PromQL expression selects: the
// identifiers that are not functions, keywords, label names (inside {} or
// a by/without/on/ignoring/group_x list) or part of strings and durations.
// Grafana variables ($x, ${x}) are dropped.
func metricNames(expr string) []string {
	var out []string
	seen := map[string]bool{}
	s := expr
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c == '"' || c == '\'' || c == '`':
			// A string: skip to its closing quote.
			j := i + 1
			for j < len(s) && s[j] != c {
				if s[j] == '\\' {
					j++
				}
				j++
			}
			i = j + 1
		case c == '{' || c == '[':
			// Label matchers and ranges hold no metric names.
			closing := byte('}')
			if c == '[' {
				closing = ']'
			}
			j := i + 1
			for j < len(s) && s[j] != closing {
				if s[j] == '"' {
					j++
					for j < len(s) && s[j] != '"' {
						if s[j] == '\\' {
							j++
						}
						j++
					}
				}
				j++
			}
			i = j + 1
		case c == '$':
			j := i + 1
			if j < len(s) && s[j] == '{' {
				for j < len(s) && s[j] != '}' {
					j++
				}
				j++
			} else {
				for j < len(s) && isIdent(s[j]) {
					j++
				}
			}
			i = j
		case c >= '0' && c <= '9' || c == '.':
			// Numbers and durations (5m, 1e9, 0x1f).
			j := i
			for j < len(s) && (isIdent(s[j]) || s[j] == '.') {
				j++
			}
			i = j
		case isIdentStart(c):
			j := i
			for j < len(s) && isIdent(s[j]) {
				j++
			}
			word := s[i:j]
			k := j
			for k < len(s) && (s[k] == ' ' || s[k] == '\t' || s[k] == '\n') {
				k++
			}
			switch {
			case promqlKeywords[strings.ToLower(word)]:
				if k < len(s) && s[k] == '(' && word != "and" && word != "or" && word != "unless" {
					// A label list: skip it.
					for k < len(s) && s[k] != ')' {
						k++
					}
					j = k + 1
				}
			case k < len(s) && s[k] == '(' || promqlAggregations[word]:
				// A function call or aggregation; its arguments are
				// scanned next.
			default:
				if !seen[word] {
					seen[word] = true
					out = append(out, word)
				}
			}
			i = j
		default:
			i++
		}
	}
	return out
}

func isIdentStart(c byte) bool {
	return c == '_' || c == ':' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
}

func isIdent(c byte) bool { return isIdentStart(c) || (c >= '0' && c <= '9') }

func TestMetricNames(t *testing.T) {
	for _, c := range []struct {
		expr string
		want string
	}{
		{`max(outbox_relay_ready{instance=~"$instance"}) < 1`, "outbox_relay_ready"},
		{`histogram_quantile(0.99, sum by (consumer, le) (rate(outbox_consumer_consume_latency_seconds_bucket{consumer=~"$consumer"}[$__rate_interval]))) > 60`, "outbox_consumer_consume_latency_seconds_bucket"},
		{`max(outbox_relay_slot_exists) == 1 and max(outbox_relay_slot_active) == 0`, "outbox_relay_slot_exists outbox_relay_slot_active"},
		{`sum(increase(a_total{result="error", x="}{"}[1h])) > 2 or (max(b) > 0 and time() - max(b) > 6 * 3600)`, "a_total b"},
		{`rate(x[5m] offset 1h) / on (instance) group_left (job) y`, "x y"},
		{`absent(outbox_relay_ready)`, "outbox_relay_ready"},
		{`max(outbox_relay_slot_retained_wal_bytes) > 10 * 1024 * 1e3`, "outbox_relay_slot_retained_wal_bytes"},
		{`time() - max(z > 0)`, "z"},
		{`sum without (instance) (rate(w_total[5m]))`, "w_total"},
		{`max by (status) (outbox_relay_slot_wal_status{instance=~"$instance"}) == 1`, "outbox_relay_slot_wal_status"},
	} {
		if got := strings.Join(metricNames(c.expr), " "); got != c.want {
			t.Errorf("metricNames(%q) = %q, want %q", c.expr, got, c.want)
		}
	}
}
