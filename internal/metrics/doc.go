// Package metrics exports the relay's Prometheus metrics on the relay's
// HTTP listener: the pipeline's counters and latency histogram (fed through
// relay.Observer), gauges read at scrape time from the ack tracker and the
// publisher, the replication slot and the streams polled on an interval
// (SlotPoller, StreamPoller), and the outcome of the last reconciliation
// (Reconcile).
//
// Names follow the Prometheus conventions: the outbox_relay_ prefix, base
// units in the name (_seconds, _bytes) and _total on counters. They are a
// stable interface: docs/operations.md documents every one, and the
// dashboard (deploy/grafana) and alerts (deploy/prometheus) use them; a test
// checks that everything those reference is exported.
package metrics
