package helmtest

import (
	"fmt"
	"regexp"
	"sort"
	"strings"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// Paths from this module's directory, which `go test` runs in.
const (
	chartDir        = "../helm/outbox-relay"
	chartAlertsPath = chartDir + "/files/alerts.yml"
	alertsPath      = "../prometheus/alerts.yml"
	fullConfigPath  = "../../testdata/full.yaml"

	releaseName = "orders"
	namespace   = "apps"
)

// manifest holds a rendered release, one typed object per kind the chart
// may render; nil when the values do not ask for it.
type manifest struct {
	deployment     *appsv1.Deployment
	configMap      *corev1.ConfigMap
	service        *corev1.Service
	serviceAccount *corev1.ServiceAccount
	secret         *corev1.Secret
	pdb            *policyv1.PodDisruptionBudget
	serviceMonitor *monitoringv1.ServiceMonitor
	prometheusRule *monitoringv1.PrometheusRule

	kinds map[string]bool // every kind rendered
}

// render renders the chart as `helm install orders -n apps -f <values>`
// would, with values given as YAML, and decodes every object strictly.
func render(t *testing.T, values string) (*manifest, error) {
	t.Helper()
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatalf("load chart: %v", err)
	}
	vals, err := chartutil.ReadValues([]byte(values))
	if err != nil {
		t.Fatalf("values: %v", err)
	}
	opts := chartutil.ReleaseOptions{Name: releaseName, Namespace: namespace, Revision: 1, IsInstall: true}
	rv, err := chartutil.ToRenderValues(ch, vals.AsMap(), opts, chartutil.DefaultCapabilities)
	if err != nil {
		return nil, fmt.Errorf("values: %w", err)
	}
	files, err := engine.Render(ch, rv)
	if err != nil {
		return nil, fmt.Errorf("render: %w", err)
	}
	names := make([]string, 0, len(files))
	for name := range files {
		if strings.HasSuffix(name, ".yaml") {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	m := &manifest{kinds: map[string]bool{}}
	for _, name := range names {
		for i, doc := range splitDocuments(files[name]) {
			if err := m.add(doc); err != nil {
				t.Fatalf("%s, document %d: %v\n%s", name, i, err, doc)
			}
		}
	}
	return m, nil
}

var documentSeparator = regexp.MustCompile(`(?m)^---[ \t]*$`)

// splitDocuments splits a rendered template into its YAML documents,
// leaving out those that hold only comments or nothing (a disabled
// template renders as empty).
func splitDocuments(s string) []string {
	var docs []string
	for _, doc := range documentSeparator.Split(s, -1) {
		for _, line := range strings.Split(doc, "\n") {
			if l := strings.TrimSpace(line); l != "" && !strings.HasPrefix(l, "#") {
				docs = append(docs, doc)
				break
			}
		}
	}
	return docs
}

// add decodes one rendered object into the API type its kind names.
func (m *manifest) add(doc string) error {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
		return err
	}
	type target struct {
		apiVersion string
		obj        any
		set        func()
	}
	var tg target
	switch tm.Kind {
	case "Deployment":
		o := &appsv1.Deployment{}
		tg = target{"apps/v1", o, func() { m.deployment = o }}
	case "ConfigMap":
		o := &corev1.ConfigMap{}
		tg = target{"v1", o, func() { m.configMap = o }}
	case "Service":
		o := &corev1.Service{}
		tg = target{"v1", o, func() { m.service = o }}
	case "ServiceAccount":
		o := &corev1.ServiceAccount{}
		tg = target{"v1", o, func() { m.serviceAccount = o }}
	case "Secret":
		o := &corev1.Secret{}
		tg = target{"v1", o, func() { m.secret = o }}
	case "PodDisruptionBudget":
		o := &policyv1.PodDisruptionBudget{}
		tg = target{"policy/v1", o, func() { m.pdb = o }}
	case "ServiceMonitor":
		o := &monitoringv1.ServiceMonitor{}
		tg = target{"monitoring.coreos.com/v1", o, func() { m.serviceMonitor = o }}
	case "PrometheusRule":
		o := &monitoringv1.PrometheusRule{}
		tg = target{"monitoring.coreos.com/v1", o, func() { m.prometheusRule = o }}
	default:
		return fmt.Errorf("kind %q: not one the chart is expected to render (add it to manifest)", tm.Kind)
	}
	if tm.APIVersion != tg.apiVersion {
		return fmt.Errorf("%s: apiVersion %q, want %q", tm.Kind, tm.APIVersion, tg.apiVersion)
	}
	if err := decodeStrict([]byte(doc), tg.obj); err != nil {
		return fmt.Errorf("%s: %w", tm.Kind, err)
	}
	if m.kinds[tm.Kind] {
		return fmt.Errorf("%s rendered twice", tm.Kind)
	}
	m.kinds[tm.Kind] = true
	tg.set()
	return nil
}

// decodeStrict decodes YAML into an API type and refuses what the type
// does not know: an unknown or misplaced field, which the API server would
// drop or refuse, and duplicate keys.
func decodeStrict(doc []byte, obj any) error {
	return yaml.UnmarshalStrict(doc, obj)
}
