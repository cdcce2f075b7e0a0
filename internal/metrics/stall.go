package metrics

import (
	"strings"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
)

var stallDesc = prometheus.NewDesc("outbox_relay_watermark_stalled_seconds",
	"How long the confirmed position has stood still with messages unacknowledged (0 while it moves), labelled with the message holding it once the relay has named it (after nats.stall_warning): its aggregate type and id, and its subject.",
	[]string{"aggregate_type", "aggregate_id", "subject"}, nil)

// stallCollector exports one series: the current stall, so the labels name
// one aggregate at a time and never accumulate.
type stallCollector func() Stall

func (c stallCollector) Describe(ch chan<- *prometheus.Desc) { ch <- stallDesc }

func (c stallCollector) Collect(ch chan<- prometheus.Metric) {
	s := c()
	typ, id, _ := strings.Cut(s.Key, "\x00")
	ch <- prometheus.MustNewConstMetric(stallDesc, prometheus.GaugeValue, s.Seconds, labelValue(typ), labelValue(id), labelValue(s.Subject))
}

// maxLabelBytes bounds a label taken from a row: an aggregate id can be
// long.
const maxLabelBytes = 128

func labelValue(s string) string {
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "\uFFFD")
	}
	if len(s) <= maxLabelBytes {
		return s
	}
	n := maxLabelBytes
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}
