package consumer

import (
	"fmt"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// groupMetrics are a group member's series (outbox_consumer_group_*).
type groupMetrics struct {
	name       string
	members    prometheus.Gauge
	owned      prometheus.Gauge
	rebalances prometheus.Counter
	pending    *prometheus.GaugeVec
	unowned    *prometheus.GaugeVec
	draining   *prometheus.GaugeVec
}

// groupVecs are the group collectors, registered by New for every
// consumer (so that they are known before a group runs), shared by the
// consumers of one Registerer.
type groupVecs struct {
	members, owned   *prometheus.GaugeVec
	rebalances       *prometheus.CounterVec
	pending, unowned *prometheus.GaugeVec
	draining         *prometheus.GaugeVec
}

func newGroupVecs(reg prometheus.Registerer) (*groupVecs, error) {
	l := []string{"consumer"}
	pl := []string{"consumer", "partitions", "partition"}
	v := &groupVecs{
		members: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_consumer_group_members",
			Help: "Live members of the consumer group, as this member sees them.",
		}, l),
		owned: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_consumer_group_partitions_owned",
			Help: "Partitions assigned to this member and pulled by it (not counting those it is handing off).",
		}, l),
		rebalances: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_consumer_group_rebalances_total",
			Help: "Times this member's set of partitions changed (a member joined, left or died, or the partition count changed).",
		}, l),
		pending: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_consumer_group_partition_pending_messages",
			Help: "Messages of a partition not yet acknowledged: not yet delivered plus delivered and unacknowledged.",
		}, pl),
		unowned: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_consumer_group_partition_unowned_seconds",
			Help: "Seconds since a partition with pending messages last had an owner (a pinned member); 0 while it has one or nothing is pending.",
		}, pl),
		draining: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_consumer_group_generation_draining_seconds",
			Help: "Seconds this member has seen the older generation of partition durables (the partitions label) keep the stream's current partition count from being consumed, because it still has messages pending or unacknowledged; gone once it is drained.",
		}, []string{"consumer", "partitions"}),
	}
	var err error
	if v.members, err = register(reg, v.members); err == nil {
		if v.owned, err = register(reg, v.owned); err == nil {
			if v.rebalances, err = register(reg, v.rebalances); err == nil {
				if v.pending, err = register(reg, v.pending); err == nil {
					if v.unowned, err = register(reg, v.unowned); err == nil {
						v.draining, err = register(reg, v.draining)
					}
				}
			}
		}
	}
	if err != nil {
		return nil, fmt.Errorf("register consumer group metrics: %w", err)
	}
	return v, nil
}

func newGroupMetrics(reg prometheus.Registerer, name string) (*groupMetrics, error) {
	v, err := newGroupVecs(reg)
	if err != nil {
		return nil, err
	}
	return &groupMetrics{
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
func (g *group) observe(gens map[int]*generation, active int) {
	now := time.Now()
	for n, gen := range gens {
		for p, ci := range gen.durables {
			name := PartitionDurable(g.c.cfg.Name, n, p)
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

func (g *group) parseDurable(name string) (partitions, p int, ok bool) {
	prefix := g.c.cfg.Name + "-"
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
