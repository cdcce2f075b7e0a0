package metrics

import (
	"errors"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/internal/reconcile"
)

// gather returns every series of reg as "name{k=v,...}" -> value.
func gather(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			sort.Strings(labels)
			key := f.GetName()
			if len(labels) > 0 {
				key += "{" + strings.Join(labels, ",") + "}"
			}
			switch {
			case m.GetGauge() != nil:
				out[key] = m.GetGauge().GetValue()
			case m.GetCounter() != nil:
				out[key] = m.GetCounter().GetValue()
			}
		}
	}
	return out
}

func expect(t *testing.T, got map[string]float64, want map[string]float64) {
	t.Helper()
	for k, v := range want {
		g, ok := got[k]
		switch {
		case v < 0 && ok:
			t.Errorf("%s = %v, want absent", k, g)
		case v >= 0 && !ok:
			t.Errorf("%s absent, want %v", k, v)
		case v >= 0 && g != v:
			t.Errorf("%s = %v, want %v", k, g, v)
		}
	}
}

const absent = -1

func TestSlotPollerCollect(t *testing.T) {
	reg := prometheus.NewRegistry()
	p := NewSlotPoller(reg, nil, "s", time.Second, nil)
	// Before the first poll only the error counter is exported.
	if got := gather(t, reg); len(got) != 1 {
		t.Fatalf("before a poll: %v", got)
	}
	safe := int64(4096)
	p.last = &SlotSnapshot{Exists: true, Active: true, WALStatus: "extended", ConfirmedLSN: 0x16B3748, RetainedBytes: 1000, LagBytes: 10, SafeWALSize: &safe, At: time.Unix(100, 0)}
	expect(t, gather(t, reg), map[string]float64{
		"outbox_relay_slot_exists":                      1,
		"outbox_relay_slot_active":                      1,
		"outbox_relay_slot_wal_status{status=extended}": 1,
		"outbox_relay_slot_wal_status{status=reserved}": 0,
		"outbox_relay_slot_wal_status{status=lost}":     0,
		"outbox_relay_slot_retained_wal_bytes":          1000,
		"outbox_relay_slot_lag_bytes":                   10,
		"outbox_relay_slot_safe_wal_size_bytes":         4096,
		"outbox_relay_slot_confirmed_flush_lsn":         0x16B3748,
		"outbox_relay_slot_last_poll_timestamp_seconds": 100,
		"outbox_relay_slot_poll_errors_total":           0,
	})
	// Unlimited max_slot_wal_keep_size: no safe size.
	p.last = &SlotSnapshot{Exists: true, WALStatus: "reserved", At: time.Unix(100, 0)}
	expect(t, gather(t, reg), map[string]float64{"outbox_relay_slot_safe_wal_size_bytes": absent})
	// A missing slot: exists 0, every status 0, no sizes.
	p.last = &SlotSnapshot{At: time.Unix(100, 0)}
	expect(t, gather(t, reg), map[string]float64{
		"outbox_relay_slot_exists":                      0,
		"outbox_relay_slot_wal_status{status=reserved}": 0,
		"outbox_relay_slot_retained_wal_bytes":          absent,
	})
}

func TestStreamPollerAge(t *testing.T) {
	reg := prometheus.NewRegistry()
	p := NewStreamPoller(reg, nil, "EV", "DLQ", time.Second, nil)
	now := time.Unix(1000, 0)
	p.now = func() time.Time { return now }
	p.lastEv = &StreamSnapshot{Stream: "EV", Exists: true, Messages: 7}
	p.lastDLQ = &StreamSnapshot{Stream: "DLQ", Exists: true, Messages: 2, FirstAt: now.Add(-90 * time.Second)}
	expect(t, gather(t, reg), map[string]float64{
		"outbox_relay_stream_messages{stream=EV}":                 7,
		"outbox_relay_dead_letters{stream=DLQ}":                   2,
		"outbox_relay_dead_letter_oldest_age_seconds{stream=DLQ}": 90,
	})
	// An empty or missing dead-letter stream has age 0.
	for _, s := range []StreamSnapshot{{Stream: "DLQ"}, {Stream: "DLQ", Exists: true, FirstAt: now.Add(-time.Hour)}} {
		if age := s.OldestAge(now); age != 0 {
			t.Errorf("%+v: age %s", s, age)
		}
	}
}

// The watermark stall is one series, labelled with the blocking message
// once the relay has named it (issue 16, case 2).
func TestWatermarkStall(t *testing.T) {
	reg := prometheus.NewRegistry()
	var st Stall
	NewRelay(reg, Gauges{Stall: func() Stall { return st }})
	expect(t, gather(t, reg), map[string]float64{
		"outbox_relay_watermark_stalled_seconds{aggregate_id=,aggregate_type=,subject=}": 0,
	})
	st = Stall{Seconds: 90, Key: "order\x00o-42", Subject: "outbox.order.o-42"}
	got := gather(t, reg)
	expect(t, got, map[string]float64{
		"outbox_relay_watermark_stalled_seconds{aggregate_id=o-42,aggregate_type=order,subject=outbox.order.o-42}": 90,
		"outbox_relay_watermark_stalled_seconds{aggregate_id=,aggregate_type=,subject=}":                           absent,
	})
	st = Stall{Seconds: 1, Key: "t\x00" + strings.Repeat("é", 100) + "\xff"}
	for k := range gather(t, reg) {
		if strings.HasPrefix(k, "outbox_relay_watermark_stalled_seconds") && len(k) > 300 {
			t.Errorf("label not cut: %d bytes", len(k))
		}
	}
}

func TestReconcileGauges(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewReconcile(reg)
	m.Reconciled(&reconcile.Report{Groups: []reconcile.Group{
		{Table: "public.outbox", AggregateType: "a", Rows: 10, Missing: 2, Unexpected: 1},
		{Table: "public.outbox", AggregateType: "b", Rows: 5},
	}}, nil)
	expect(t, gather(t, reg), map[string]float64{
		"outbox_relay_reconcile_missing_events{aggregate_type=a,table=public.outbox}":    2,
		"outbox_relay_reconcile_unexpected_events{aggregate_type=a,table=public.outbox}": 1,
		"outbox_relay_reconcile_rows{aggregate_type=b,table=public.outbox}":              5,
		"outbox_relay_reconcile_runs_total{result=ok}":                                   1,
		"outbox_relay_reconcile_runs_total{result=error}":                                0,
	})
	// The next run replaces the series: a group that disappeared is gone.
	m.Reconciled(&reconcile.Report{Groups: []reconcile.Group{{Table: "public.outbox", AggregateType: "b", Rows: 6}}}, nil)
	m.Reconciled(nil, errors.New("boom"))
	m.Repaired(&reconcile.RepairReport{Published: 3, Duplicates: 1, Failed: []reconcile.RepairFailure{{}}})
	expect(t, gather(t, reg), map[string]float64{
		"outbox_relay_reconcile_missing_events{aggregate_type=a,table=public.outbox}": absent,
		"outbox_relay_reconcile_rows{aggregate_type=b,table=public.outbox}":           6,
		"outbox_relay_reconcile_runs_total{result=ok}":                                2,
		"outbox_relay_reconcile_runs_total{result=error}":                             1,
		"outbox_relay_reconcile_repaired_events_total{result=published}":              3,
		"outbox_relay_reconcile_repaired_events_total{result=duplicate}":              1,
		"outbox_relay_reconcile_repaired_events_total{result=failed}":                 1,
	})
}

func TestParseText(t *testing.T) {
	in := `# TYPE a counter
a{x="1"} 2
a{x="2"} 3
# TYPE h histogram
h_bucket{le="1"} 1
h_bucket{le="+Inf"} 4
h_sum 9
h_count 4
# TYPE g gauge
g 0.5
`
	got, err := parseText(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	if got["a"] != 5 || got["h"] != 4 || got["g"] != 0.5 {
		t.Fatalf("got %v", got)
	}
	if _, err := parseText(strings.NewReader("a{ 1\n")); err == nil {
		t.Fatal("no error for a broken exposition")
	}
}

// The labelled counters the alerts use are exported at 0 before their
// first increment, and a standby's retries are not restarts.
func TestRelayCountersStartAtZero(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewRelay(reg, Gauges{})
	m.StandingBy()
	m.StandingBy()
	expect(t, gather(t, reg), map[string]float64{
		"outbox_relay_dead_lettered_total{reason=invalid_field}":      0,
		"outbox_relay_dead_lettered_total{reason=rejected_by_broker}": 0,
		"outbox_relay_publish_retries_total{class=timeout}":           0,
		"outbox_relay_publish_retries_total{class=no_responders}":     0,
		"outbox_relay_replication_restarts_total":                     0,
		"outbox_relay_standby_retries_total":                          2,
	})
	m.Reconnected()
	m.DeadLettered("too_large")
	expect(t, gather(t, reg), map[string]float64{
		"outbox_relay_replication_restarts_total":            1,
		"outbox_relay_standby_retries_total":                 2,
		"outbox_relay_dead_lettered_total{reason=too_large}": 1,
	})
}
