package helmtest

import (
	"bytes"
	"fmt"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

const (
	metricsPort = 9187
	configPath  = "/etc/outbox-relay/config.yaml"
	// The relay's peak RSS in bench/README.md ("Peak RSS"), draining a
	// 2,000,000-event backlog and a 1,000,000-row transaction: the memory
	// request must cover it, or the scheduler packs the node too tight.
	measuredPeakRSS = 41.3e6
	// nats.max_in_flight_bytes's default: the limit must leave room for a
	// full in-flight window above the measured peak.
	defaultMaxInFlightBytes = 64 << 20
)

// The variants the tests render: each is a values file a user could pass.
const (
	monitoringValues = `
serviceMonitor:
  enabled: true
  labels: {release: prometheus}
prometheusRule:
  enabled: true
  labels: {release: prometheus}
`
	existingSecretValues = `
secrets:
  existingSecret: relay-credentials
  postgresUrlKey: url
  natsUserKey: nats-user
  natsPasswordKey: nats-password
config:
  postgres:
    slot: orders_relay
    publication: orders_relay
    status_interval: 500ms
  nats:
    url: nats://nats-0.nats:4222,nats://nats-1.nats:4222,nats://nats-2.nats:4222
    stream: ORDERS
    dead_letter_stream: ORDERS_DLQ
    replicas: 3
    require_durable_stream: true
    max_in_flight: 8192
    stream_subjects: ["orders.>"]
  tables:
    - table: sales.order_events
      subject: orders.{aggregate_type}.{aggregate_id}
      columns:
        occurred_at: created_at
      headers:
        tenant_id: Tenant
  messages:
    - prefix: orders
      subject: orders.{aggregate_type}.{aggregate_id}
  reconcile:
    interval: 10m
    window: 2h
  shutdown_timeout: 20s
terminationGracePeriodSeconds: 45
`
	createdSecretValues = `
secrets:
  create: true
  postgresUrl: postgres://outbox_relay:s3cret@db:5432/app
  natsCredentialsKey: nats.creds
  natsCredentials: "-----BEGIN NATS USER JWT-----"
`
)

func mustRender(t *testing.T, values string) *manifest {
	t.Helper()
	m, err := render(t, values)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestDefaultValues(t *testing.T) {
	m := mustRender(t, "")
	cfg := checkPair(t, m)
	if m.secret != nil || m.serviceMonitor != nil || m.prometheusRule != nil {
		t.Errorf("rendered %v: the defaults create no Secret, ServiceMonitor or PrometheusRule", m.kinds)
	}
	// With no existingSecret, the pods read a Secret named after the
	// release, which the user creates (NOTES.txt and the README say how).
	env := container(t, m).Env
	if len(env) != 1 {
		t.Fatalf("env %+v, want only OUTBOX_RELAY_POSTGRES_URL", env)
	}
	wantSecretRef(t, env, "OUTBOX_RELAY_POSTGRES_URL", "orders-outbox-relay", "postgres-url")
	if dig(cfg, "postgres", "url") != nil {
		t.Errorf("the default configuration sets postgres.url %v: it comes from the Secret", dig(cfg, "postgres", "url"))
	}
	if m.serviceAccount == nil || m.serviceAccount.AutomountServiceAccountToken == nil || *m.serviceAccount.AutomountServiceAccountToken {
		t.Errorf("service account %+v: created, without a token (the relay calls no Kubernetes API)", m.serviceAccount)
	}
}

func TestMonitoring(t *testing.T) {
	m := mustRender(t, monitoringValues)
	checkPair(t, m)

	sm := m.serviceMonitor
	if sm == nil {
		t.Fatalf("no ServiceMonitor among %v", m.kinds)
	}
	if sm.Labels["release"] != "prometheus" {
		t.Errorf("ServiceMonitor labels %v: want the release label Prometheus selects by", sm.Labels)
	}
	sel, err := metav1.LabelSelectorAsSelector(&sm.Spec.Selector)
	if err != nil {
		t.Fatal(err)
	}
	if !sel.Matches(labels.Set(m.service.Labels)) {
		t.Errorf("ServiceMonitor selector %v does not select the Service (labels %v)", sm.Spec.Selector, m.service.Labels)
	}
	if got := sm.Spec.NamespaceSelector.MatchNames; !reflect.DeepEqual(got, []string{namespace}) {
		t.Errorf("ServiceMonitor namespaces %v, want [%s]", got, namespace)
	}
	if len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != m.service.Spec.Ports[0].Name || sm.Spec.Endpoints[0].Path != "/metrics" {
		t.Errorf("ServiceMonitor endpoints %+v: want /metrics on the Service's port %q", sm.Spec.Endpoints, m.service.Spec.Ports[0].Name)
	}

	pr := m.prometheusRule
	if pr == nil {
		t.Fatalf("no PrometheusRule among %v", m.kinds)
	}
	if pr.Labels["release"] != "prometheus" {
		t.Errorf("PrometheusRule labels %v: want the release label", pr.Labels)
	}
	want := alertRules(t, alertsPath)
	if !reflect.DeepEqual(pr.Spec, want) {
		t.Fatalf("PrometheusRule groups differ from %s (make helm-rules refreshes the chart's copy): %s", alertsPath, firstRuleDifference(pr.Spec, want))
	}
	alerts := 0
	for _, g := range pr.Spec.Groups {
		alerts += len(g.Rules)
	}
	t.Logf("PrometheusRule: %d groups, %d rules, equal to %s", len(pr.Spec.Groups), alerts, alertsPath)
}

func TestExistingSecretAndCustomConfig(t *testing.T) {
	m := mustRender(t, existingSecretValues)
	cfg := checkPair(t, m)
	if m.secret != nil {
		t.Errorf("rendered a Secret with existingSecret set")
	}
	env := container(t, m).Env
	wantSecretRef(t, env, "OUTBOX_RELAY_POSTGRES_URL", "relay-credentials", "url")
	wantSecretRef(t, env, "OUTBOX_RELAY_NATS_USER", "relay-credentials", "nats-user")
	wantSecretRef(t, env, "OUTBOX_RELAY_NATS_PASSWORD", "relay-credentials", "nats-password")
	// The user's configuration arrives whole, beside the chart's defaults.
	for _, tc := range []struct {
		path []string
		want any
	}{
		{[]string{"postgres", "slot"}, "orders_relay"},
		{[]string{"nats", "stream"}, "ORDERS"},
		{[]string{"nats", "max_in_flight"}, float64(8192)},
		{[]string{"reconcile", "interval"}, "10m"},
		{[]string{"log", "format"}, "json"},
	} {
		if got := dig(cfg, tc.path...); got != tc.want {
			t.Errorf("config %s = %v, want %v", strings.Join(tc.path, "."), got, tc.want)
		}
	}
	tables, _ := cfg["tables"].([]any)
	if len(tables) != 1 || dig(tables[0].(map[string]any), "headers", "tenant_id") != "Tenant" {
		t.Errorf("config tables %v: want the one table given, with its header", tables)
	}
	if got := *m.deployment.Spec.Template.Spec.TerminationGracePeriodSeconds; got != 45 {
		t.Errorf("terminationGracePeriodSeconds %d, want 45", got)
	}
}

// TestSingleReplica: one replica has no standby, and a budget of one
// available pod would block every drain, so none is rendered.
func TestSingleReplica(t *testing.T) {
	m := mustRender(t, "replicaCount: 1\n")
	if m.pdb != nil {
		t.Errorf("replicaCount 1: rendered a PodDisruptionBudget %+v", m.pdb.Spec)
	}
	if got := *m.deployment.Spec.Replicas; got != 1 {
		t.Errorf("replicas %d, want 1", got)
	}
}

func TestCreatedSecret(t *testing.T) {
	m := mustRender(t, createdSecretValues)
	checkPair(t, m)
	s := m.secret
	if s == nil {
		t.Fatalf("secrets.create: no Secret among %v", m.kinds)
	}
	if s.Name != "orders-outbox-relay" {
		t.Errorf("Secret %q, want orders-outbox-relay", s.Name)
	}
	want := map[string]string{
		"postgres-url": "postgres://outbox_relay:s3cret@db:5432/app",
		"nats.creds":   "-----BEGIN NATS USER JWT-----",
	}
	if !reflect.DeepEqual(s.StringData, want) {
		t.Errorf("Secret data %v, want %v", s.StringData, want)
	}
	c := container(t, m)
	wantSecretRef(t, c.Env, "OUTBOX_RELAY_POSTGRES_URL", s.Name, "postgres-url")
	// The credentials file is mounted from the Secret and named by its key.
	path := envValue(t, c.Env, "OUTBOX_RELAY_NATS_CREDENTIALS_FILE")
	vol := mountedVolume(t, m, path)
	if vol.Secret == nil || vol.Secret.SecretName != s.Name || len(vol.Secret.Items) != 1 || vol.Secret.Items[0].Key != "nats.creds" {
		t.Errorf("%s is mounted from %+v, want key nats.creds of Secret %s", path, vol.VolumeSource, s.Name)
	}
	if m.configMap.Data["config.yaml"] != "" && strings.Contains(m.configMap.Data["config.yaml"], "s3cret") {
		t.Errorf("the ConfigMap holds the password")
	}
}

// TestRefusedValues: values that would give a pair that cannot work fail
// the install with the fix, instead of rendering it.
func TestRefusedValues(t *testing.T) {
	for _, tc := range []struct {
		name, values, want string
	}{
		{"another listen address", "config:\n  http:\n    listen: 127.0.0.1:9187\n", "config.http.listen is set by the chart"},
		{"created and existing secret", "secrets:\n  create: true\n  existingSecret: x\n  postgresUrl: postgres://h/db\n", "secrets.create and secrets.existingSecret are exclusive"},
		{"created secret without a URL", "secrets:\n  create: true\n", "secrets.postgresUrl is empty"},
		{"created secret without a named value", "secrets:\n  create: true\n  postgresUrl: postgres://h/db\n  natsPasswordKey: p\n", "secrets.natsPasswordKey is set, but secrets.natsPassword is empty"},
		{"no PostgreSQL URL key", "secrets:\n  postgresUrlKey: \"\"\n", "secrets.postgresUrlKey is required"},
		{"two NATS authentications", "secrets:\n  natsPasswordKey: p\n  natsCredentialsKey: c\n", "at most one NATS authentication method"},
		// values.schema.json: a misspelt value is refused, not ignored.
		{"misspelt value", "replicas: 3\n", "replicas"},
		{"misspelt secret value", "secrets:\n  existingSecrets: relay\n", "existingSecrets"},
		{"probe path without a slash", "readinessProbe:\n  path: readyz\n", "/readinessProbe/path"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := render(t, tc.values)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
	// The chart's own listen address is accepted when given.
	if _, err := render(t, "config:\n  http:\n    listen: 0.0.0.0:9187\n    pprof: true\n"); err != nil {
		t.Fatal(err)
	}
}

// TestStrictDecodingRefusesUnknownFields: the decoding the other tests rely
// on refuses a field the API type does not have, such as a misspelt or
// misplaced one Kubernetes would drop or refuse.
func TestStrictDecodingRefusesUnknownFields(t *testing.T) {
	for _, doc := range []string{
		"apiVersion: apps/v1\nkind: Deployment\nspec:\n  replica: 2\n",
		"apiVersion: apps/v1\nkind: Deployment\nspec:\n  template:\n    spec:\n      containers:\n        - name: relay\n          readinessProbe:\n            path: /readyz\n",
		"apiVersion: policy/v1\nkind: PodDisruptionBudget\nspec:\n  minAvailable: 1\n  minAvailable: 2\n",
		"apiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\nspec:\n  groups:\n    - name: g\n      rules:\n        - alert: A\n          expr: up\n          severity: critical\n",
		"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: x\n",
	} {
		m := &manifest{kinds: map[string]bool{}}
		if err := m.add(doc); err == nil {
			t.Errorf("accepted:\n%s", doc)
		}
	}
}

// TestRulesCopyMatchesSource: deploy/prometheus/alerts.yml is the one
// source of the alert rules; the chart embeds a copy (Helm reads files
// only inside the chart), which `make helm-rules` refreshes.
func TestRulesCopyMatchesSource(t *testing.T) {
	src, err := os.ReadFile(alertsPath)
	if err != nil {
		t.Fatal(err)
	}
	cp, err := os.ReadFile(chartAlertsPath)
	if err != nil {
		t.Fatalf("%v: run make helm-rules", err)
	}
	if !bytes.Equal(src, cp) {
		t.Fatalf("%s differs from %s: run make helm-rules (the alerts are edited in deploy/prometheus only)", chartAlertsPath, alertsPath)
	}
	// The source itself fits the PrometheusRule type, strictly.
	if spec := alertRules(t, alertsPath); len(spec.Groups) == 0 {
		t.Fatalf("%s: no groups", alertsPath)
	}
}

// TestLint runs Helm's own linter, as `helm lint --strict` would, for the
// defaults and each variant.
func TestLint(t *testing.T) {
	for name, values := range map[string]string{
		"defaults":        "",
		"monitoring":      monitoringValues,
		"existing secret": existingSecretValues,
		"created secret":  createdSecretValues,
	} {
		t.Run(name, func(t *testing.T) {
			vals, err := chartutil.ReadValues([]byte(values))
			if err != nil {
				t.Fatal(err)
			}
			res := lint.All(chartDir, vals.AsMap(), namespace, true)
			for _, msg := range res.Messages {
				if msg.Severity >= support.WarningSev {
					t.Errorf("lint: %v", msg)
				} else {
					t.Logf("lint: %v", msg)
				}
			}
		})
	}
}

// checkPair asserts what every rendering must hold for the HA pair and
// returns the relay configuration the ConfigMap holds.
func checkPair(t *testing.T, m *manifest) map[string]any {
	t.Helper()
	d := m.deployment
	for kind, missing := range map[string]bool{
		"Deployment": d == nil, "ConfigMap": m.configMap == nil,
		"Service": m.service == nil, "PodDisruptionBudget": m.pdb == nil,
	} {
		if missing {
			t.Fatalf("no %s among %v", kind, m.kinds)
		}
	}
	spec := d.Spec.Template.Spec

	// Two replicas, rolled one at a time without ever going below two.
	if d.Spec.Replicas == nil || *d.Spec.Replicas != 2 {
		t.Errorf("replicas %v, want 2 (one streams, one stands by)", d.Spec.Replicas)
	}
	ru := d.Spec.Strategy.RollingUpdate
	if d.Spec.Strategy.Type != appsv1.RollingUpdateDeploymentStrategyType || ru == nil ||
		!reflect.DeepEqual(ru.MaxSurge, ptr(intstr.FromInt32(1))) || !reflect.DeepEqual(ru.MaxUnavailable, ptr(intstr.FromInt32(0))) {
		t.Errorf("strategy %+v, want RollingUpdate with maxSurge 1 and maxUnavailable 0", d.Spec.Strategy)
	}

	// The selectors: Deployment, PDB and Service all pick the pods.
	podLabels := labels.Set(d.Spec.Template.Labels)
	depSel, err := metav1.LabelSelectorAsSelector(d.Spec.Selector)
	if err != nil || !depSel.Matches(podLabels) {
		t.Errorf("Deployment selector %v does not select its pods %v (%v)", d.Spec.Selector, podLabels, err)
	}
	pdbSel, err := metav1.LabelSelectorAsSelector(m.pdb.Spec.Selector)
	if err != nil || !pdbSel.Matches(podLabels) {
		t.Errorf("PDB selector %v does not select the pods %v (%v)", m.pdb.Spec.Selector, podLabels, err)
	}
	if !labels.SelectorFromSet(m.service.Spec.Selector).Matches(podLabels) {
		t.Errorf("Service selector %v does not select the pods %v", m.service.Spec.Selector, podLabels)
	}

	// The PDB keeps one pod through voluntary disruptions, and lets one go.
	if m.pdb.Spec.MinAvailable == nil || *m.pdb.Spec.MinAvailable != intstr.FromInt32(1) || m.pdb.Spec.MaxUnavailable != nil {
		t.Errorf("PDB minAvailable %v maxUnavailable %v, want minAvailable 1", m.pdb.Spec.MinAvailable, m.pdb.Spec.MaxUnavailable)
	}

	c := container(t, m)
	if got := portNamed(t, c, "http-metrics"); got != metricsPort {
		t.Errorf("port http-metrics = %d, want %d", got, metricsPort)
	}
	checkProbe(t, c, "readiness", c.ReadinessProbe, "/readyz?standby=ok")
	checkProbe(t, c, "liveness", c.LivenessProbe, "/healthz")
	if len(m.service.Spec.Ports) != 1 || m.service.Spec.Ports[0].TargetPort != intstr.FromString("http-metrics") {
		t.Errorf("Service ports %+v, want one targeting http-metrics", m.service.Spec.Ports)
	}
	if !m.service.Spec.PublishNotReadyAddresses {
		t.Errorf("Service: the standby (NotReady on /readyz) must be scraped too: publishNotReadyAddresses")
	}

	// The configuration: mounted from the ConfigMap where args point, made
	// of the relay's keys, listening where the probes look.
	if !reflect.DeepEqual(c.Args, []string{"run", "--config", configPath}) {
		t.Errorf("args %q, want run --config %s", c.Args, configPath)
	}
	vol := mountedVolume(t, m, configPath)
	if vol.ConfigMap == nil || vol.ConfigMap.Name != m.configMap.Name {
		t.Fatalf("%s is mounted from %+v, want ConfigMap %s", configPath, vol.VolumeSource, m.configMap.Name)
	}
	raw, ok := m.configMap.Data["config.yaml"]
	if !ok {
		t.Fatalf("ConfigMap data %v: no config.yaml", m.configMap.Data)
	}
	var cfg map[string]any
	if err := yaml.UnmarshalStrict([]byte(raw), &cfg); err != nil {
		t.Fatalf("config.yaml: %v\n%s", err, raw)
	}
	for _, p := range keyProblems("", cfg, fullConfig(t)) {
		t.Errorf("config.yaml: %s", p)
	}
	if got := dig(cfg, "http", "listen"); got != "0.0.0.0:9187" {
		t.Errorf("config http.listen %v, want 0.0.0.0:9187 (the probed port, on every interface)", got)
	}
	if len(cfg["tables"].([]any)) == 0 {
		t.Errorf("config: no tables")
	}
	if d.Spec.Template.Annotations["checksum/config"] == "" {
		t.Errorf("pod template: no checksum/config annotation, so a changed ConfigMap would not roll the pods")
	}

	// Secrets reach the relay from a Secret, never as a literal value; every
	// OUTBOX_RELAY_* variable is a configuration key (the relay refuses a
	// near miss at start).
	keys := map[string]bool{}
	envNames("", fullConfig(t), keys)
	for _, e := range c.Env {
		if strings.HasPrefix(e.Name, envPrefix) && !keys[e.Name] {
			t.Errorf("env %s: not a configuration key's variable", e.Name)
		}
		switch e.Name {
		case "OUTBOX_RELAY_POSTGRES_URL", "OUTBOX_RELAY_NATS_URL", "OUTBOX_RELAY_NATS_USER", "OUTBOX_RELAY_NATS_PASSWORD":
			if e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil || e.Value != "" {
				t.Errorf("env %s = %+v: want a secretKeyRef", e.Name, e)
			}
		}
	}

	// Graceful stop: the relay waits shutdown_timeout for in-flight acks.
	shutdown := 5 * time.Second
	if s, ok := cfg["shutdown_timeout"].(string); ok {
		if shutdown, err = time.ParseDuration(s); err != nil {
			t.Fatal(err)
		}
	}
	if grace := time.Duration(*spec.TerminationGracePeriodSeconds) * time.Second; grace <= shutdown {
		t.Errorf("terminationGracePeriodSeconds %v, want more than shutdown_timeout %v", grace, shutdown)
	}

	// Non-root, read-only root filesystem, nothing to escalate.
	psc, sc := spec.SecurityContext, c.SecurityContext
	if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser == 0 {
		t.Errorf("pod securityContext %+v: want runAsNonRoot and a non-zero runAsUser", psc)
	}
	if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		sc.Capabilities == nil || !reflect.DeepEqual(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("container securityContext %+v: want a read-only root filesystem, no privilege escalation, all capabilities dropped", sc)
	}

	// Requests from the measured RSS; a limit with room for a full window.
	req, lim := c.Resources.Requests[corev1.ResourceMemory], c.Resources.Limits[corev1.ResourceMemory]
	if req.Value() < measuredPeakRSS {
		t.Errorf("memory request %s, below the measured peak RSS %.1f MB", req.String(), measuredPeakRSS/1e6)
	}
	if floor := resource.NewQuantity(int64(measuredPeakRSS)+defaultMaxInFlightBytes, resource.BinarySI); lim.Cmp(*floor) < 0 {
		t.Errorf("memory limit %s, want at least the peak RSS plus a full in-flight window (%s)", lim.String(), floor.String())
	}
	if c.Resources.Requests.Cpu().IsZero() {
		t.Errorf("no CPU request")
	}
	return cfg
}

func checkProbe(t *testing.T, c *corev1.Container, name string, p *corev1.Probe, path string) {
	t.Helper()
	if p == nil || p.HTTPGet == nil {
		t.Errorf("%s probe %+v: want an HTTP GET of %s", name, p, path)
		return
	}
	if p.HTTPGet.Path != path {
		t.Errorf("%s probe path %q, want %q", name, p.HTTPGet.Path, path)
	}
	port := p.HTTPGet.Port
	if port.Type == intstr.String {
		port = intstr.FromInt32(portNamed(t, c, port.StrVal))
	}
	if port.IntVal != metricsPort {
		t.Errorf("%s probe port %v, want the relay's %d", name, p.HTTPGet.Port.String(), metricsPort)
	}
}

func container(t *testing.T, m *manifest) *corev1.Container {
	t.Helper()
	cs := m.deployment.Spec.Template.Spec.Containers
	if len(cs) != 1 || cs[0].Name != "relay" {
		t.Fatalf("containers %+v, want one named relay", cs)
	}
	return &cs[0]
}

func portNamed(t *testing.T, c *corev1.Container, name string) int32 {
	t.Helper()
	for _, p := range c.Ports {
		if p.Name == name {
			return p.ContainerPort
		}
	}
	t.Fatalf("container %s: no port named %s", c.Name, name)
	return 0
}

// mountedVolume returns the pod volume holding path in the relay container.
func mountedVolume(t *testing.T, m *manifest, path string) corev1.Volume {
	t.Helper()
	c := container(t, m)
	for _, vm := range c.VolumeMounts {
		if path == vm.MountPath || strings.HasPrefix(path, strings.TrimSuffix(vm.MountPath, "/")+"/") {
			for _, v := range m.deployment.Spec.Template.Spec.Volumes {
				if v.Name == vm.Name {
					return v
				}
			}
			t.Fatalf("mount %s: no volume %s", vm.MountPath, vm.Name)
		}
	}
	t.Fatalf("nothing is mounted at %s (mounts %+v)", path, c.VolumeMounts)
	return corev1.Volume{}
}

func wantSecretRef(t *testing.T, env []corev1.EnvVar, name, secret, key string) {
	t.Helper()
	for _, e := range env {
		if e.Name == name {
			if e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil || e.ValueFrom.SecretKeyRef.Name != secret || e.ValueFrom.SecretKeyRef.Key != key {
				t.Errorf("env %s = %+v, want key %s of Secret %s", name, e, key, secret)
			}
			return
		}
	}
	t.Errorf("env: no %s", name)
}

func envValue(t *testing.T, env []corev1.EnvVar, name string) string {
	t.Helper()
	for _, e := range env {
		if e.Name == name {
			return e.Value
		}
	}
	t.Fatalf("env: no %s", name)
	return ""
}

// alertRules reads an alert rule file strictly as a PrometheusRule spec.
func alertRules(t *testing.T, path string) monitoringv1.PrometheusRuleSpec {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var spec monitoringv1.PrometheusRuleSpec
	if err := yaml.UnmarshalStrict(data, &spec); err != nil {
		t.Fatalf("%s as a PrometheusRule spec: %v", path, err)
	}
	return spec
}

// firstRuleDifference names the first group or rule where got and want
// differ, with both versions of it.
func firstRuleDifference(got, want monitoringv1.PrometheusRuleSpec) string {
	if len(got.Groups) != len(want.Groups) {
		return fmt.Sprintf("%d groups, want %d", len(got.Groups), len(want.Groups))
	}
	for i, g := range got.Groups {
		w := want.Groups[i]
		if len(g.Rules) != len(w.Rules) || g.Name != w.Name {
			return fmt.Sprintf("group %d: %q with %d rules, want %q with %d", i, g.Name, len(g.Rules), w.Name, len(w.Rules))
		}
		for j := range g.Rules {
			if !reflect.DeepEqual(g.Rules[j], w.Rules[j]) {
				gy, _ := yaml.Marshal(g.Rules[j])
				wy, _ := yaml.Marshal(w.Rules[j])
				return fmt.Sprintf("group %q, rule %d:\n--- rendered\n%s--- alerts.yml\n%s", g.Name, j, gy, wy)
			}
		}
		if !reflect.DeepEqual(g, w) {
			return fmt.Sprintf("group %q: its settings", g.Name)
		}
	}
	return "the spec's settings"
}

func dig(m map[string]any, path ...string) any {
	var v any = m
	for _, k := range path {
		mm, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = mm[k]
	}
	return v
}

func ptr[T any](v T) *T { return &v }
