package group

import (
	"fmt"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/consumer/internal/observe"
)

// metrics are a group member's series (outbox_consumer_group_*).
type metrics struct {
	name       string
	members    prometheus.Gauge
	owned      prometheus.Gauge
	rebalances prometheus.Counter
	pending    *prometheus.GaugeVec
	unowned    *prometheus.GaugeVec
	draining   *prometheus.GaugeVec
}

// vecs are the group collectors, registered by consumer.New for every
// consumer (so that they are known before a group runs), shared by the
// consumers of one Registerer.
type vecs struct {
	members, owned   *prometheus.GaugeVec
	rebalances       *prometheus.CounterVec
	pending, unowned *prometheus.GaugeVec
	draining         *prometheus.GaugeVec
}

func gaugeVec(name string, labels []string, help string) *prometheus.GaugeVec {
	return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, labels)
}

func counterVec(name string, labels []string, help string) *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels)
}

// RegisterMetrics registers the group collectors with reg, or adopts those
// registered there before.
func RegisterMetrics(reg prometheus.Registerer) error {
	_, err := newVecs(reg)
	return err
}

func newVecs(reg prometheus.Registerer) (*vecs, error) {
	l := []string{"consumer"}
	pl := []string{"consumer", "partitions", "partition"}
	v := &vecs{
		members: gaugeVec("outbox_consumer_group_members", l,
			"Live members of the consumer group, as this member sees them."),
		owned: gaugeVec("outbox_consumer_group_partitions_owned", l,
			"Partitions assigned to this member and pulled by it (not counting those it is handing off)."),
		rebalances: counterVec("outbox_consumer_group_rebalances_total", l,
			"Times this member's set of partitions changed (a member joined, left or died, or the partition count changed)."),
		pending: gaugeVec("outbox_consumer_group_partition_pending_messages", pl,
			"Messages of a partition not yet acknowledged: not yet delivered plus delivered and unacknowledged."),
		unowned: gaugeVec("outbox_consumer_group_partition_unowned_seconds", pl,
			"Seconds since a partition with pending messages last had an owner (a pinned member); 0 while it has one or nothing is pending."),
		draining: gaugeVec("outbox_consumer_group_generation_draining_seconds", []string{"consumer", "partitions"},
			"Seconds this member has seen the older generation of partition durables (the partitions label) keep the stream's current partition count from being consumed, because it still has messages pending or unacknowledged; gone once it is drained."),
	}
	var err error
	for _, g := range []**prometheus.GaugeVec{&v.members, &v.owned, &v.pending, &v.unowned, &v.draining} {
		if *g, err = observe.Register(reg, *g); err != nil {
			break
		}
	}
	if err == nil {
		v.rebalances, err = observe.Register(reg, v.rebalances)
	}
	if err != nil {
		return nil, fmt.Errorf("register consumer group metrics: %w", err)
	}
	return v, nil
}

func newMetricsOf(reg prometheus.Registerer, name string) (*metrics, error) {
	v, err := newVecs(reg)
	if err != nil {
		return nil, err
	}
	return &metrics{
		name:       name,
		members:    v.members.WithLabelValues(name),
		owned:      v.owned.WithLabelValues(name),
		rebalances: v.rebalances.WithLabelValues(name),
		pending:    v.pending,
		unowned:    v.unowned,
		draining:   v.draining,
	}, nil
}

// observe sets the per-partition gauges from the last durable listing.
func (g *Member) observe(gens map[int]*generation, active int) {
	now := time.Now()
	for n, gen := range gens {
		for p, ci := range gen.durables {
			name := PartitionDurable(g.cfg.Name, n, p)
			pending := ci.NumPending + uint64(ci.NumAckPending)
			pinned := false
			for _, pg := range ci.PriorityGroups {
				pinned = pinned || pg.PinnedClientID != ""
			}
			// An older generation waiting for nothing, or the active one
			// while idle, is not "without owner".
			if _, ok := g.lastOwner[name]; !ok || pinned || pending == 0 || (n != active && gen.drained) {
				g.lastOwner[name] = now
			}
			ls := []string{g.met.name, strconv.Itoa(n), strconv.Itoa(p)}
			g.met.pending.WithLabelValues(ls...).Set(float64(pending))
			g.met.unowned.WithLabelValues(ls...).Set(now.Sub(g.lastOwner[name]).Seconds())
		}
	}
	for name := range g.lastOwner {
		n, p, ok := g.parseDurable(name)
		if _, live := gens[n]; ok && !live {
			ls := []string{g.met.name, strconv.Itoa(n), strconv.Itoa(p)}
			g.met.pending.DeleteLabelValues(ls...)
			g.met.unowned.DeleteLabelValues(ls...)
			delete(g.lastOwner, name)
		}
	}
}

func (g *Member) parseDurable(name string) (partitions, p int, ok bool) {
	prefix := g.cfg.Name + "-"
	if len(name) <= len(prefix) {
		return 0, 0, false
	}
	n, q, ok := parsePair(name[len(prefix):])
	return n, q, ok
}

func parsePair(s string) (int, int, bool) {
	for i := 0; i < len(s); i++ {
		if s[i] == '-' {
			a, err1 := strconv.Atoi(s[:i])
			b, err2 := strconv.Atoi(s[i+1:])
			return a, b, err1 == nil && err2 == nil
		}
	}
	return 0, 0, false
}
