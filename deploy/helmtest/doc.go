// Package helmtest checks the Helm chart in deploy/helm/outbox-relay without
// a cluster: it renders the chart with Helm's own Go library, for the
// default values and for variants, decodes every object strictly into the
// Kubernetes (k8s.io/api) and Prometheus Operator API types, so a field
// Kubernetes would drop or refuse fails the test, and asserts what the HA
// pair depends on: two replicas rolled one at a time, the probes on the
// relay's port, the PodDisruptionBudget, a configuration made of the
// relay's keys (testdata/full.yaml), secrets only through a Secret, and a
// PrometheusRule equal to deploy/prometheus/alerts.yml.
//
// It is a Go module of its own so that Helm and the Kubernetes API types
// stay out of the relay's module: run it with `make test-deploy` (part of
// `make test`) or `cd deploy/helmtest && go test ./...`.
package helmtest
