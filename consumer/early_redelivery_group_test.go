package consumer

import (
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestEarlyHeadGroupHandOffAndBack: a group of 2 partitions, member m1
// alone at first; the first version of six aggregates fails twice
// (transient, 3 s backoff), with later versions behind them, more than the
// member's budget (MaxAckPending 8). While the heads wait: the partitions'
// durables are reset by another party every 400 ms (early deliveries to
// the owner, naked again), m2 joins and takes a partition (its reset
// delivers the heads to it at once), and m2 leaves again, handing the
// partition back to m1, whose workers still hold blocks from before with
// their backoffs (early naks on a new feed). Every event must be applied
// once, in version order, none dead-lettered, the partitions must settle,
// and m1's budget must come back whole (no slot kept by an early nak).
func TestEarlyHeadGroupHandOffAndBack(t *testing.T) {
	const aggs, versions, heads = 8, 4, 6
	f, cfg, rec := newUnversionedGroup(t, 2)
	cfg.Workers, cfg.MaxAckPending, cfg.BatchSize = 2, 8, 1
	cfg.RetryBase, cfg.RetryMax = 3*time.Second, 3*time.Second
	rec.fail = func(m *Message, call int) error {
		if m.AggregateVersion == 1 && call <= 2 && m.AggregateID < "agg6" {
			return Transient(errors.New("a head fails twice"))
		}
		return nil
	}
	inUse := budgetInUse(t, "m1")
	regA, regB := prometheus.NewRegistry(), prometheus.NewRegistry()
	f.runMember(cfg, rec, "m1", WithRegisterer(regA))
	f.waitOwns(regA, func(n float64) bool { return n == 2 })
	f.publishVersions(aggs, 1, versions)
	f.waitFor("every head's first call", 30*time.Second, func() bool {
		for a := range heads {
			if rec.callCount(uuidN(1000+a)) < 1 {
				return false
			}
		}
		return true
	})
	stopResets := resetLoop(t, f.js, f.stream, 400*time.Millisecond, PartitionDurable("grp", 2, 0), PartitionDurable("grp", 2, 1))
	stopB := f.runMember(cfg, rec, "m2", WithRegisterer(regB))
	f.waitOwns(regB, func(n float64) bool { return n == 1 })
	time.Sleep(time.Second)
	stopB()
	f.waitOwns(regA, func(n float64) bool { return n == 2 })
	time.Sleep(2 * time.Second)
	resets := stopResets()
	f.waitFor("every event applied", time.Minute, func() bool {
		return queryInt(t, f.pool, `SELECT count(DISTINCT event_id) FROM applied WHERE consumer = 'grp'`) == aggs*versions
	})
	f.waitGroupSettled("grp", 2, 30*time.Second)
	calls := 0
	for a := range heads {
		calls += rec.callCount(uuidN(1000 + a))
	}
	t.Logf("%d resets; %d calls of the %d heads", resets, calls, heads)
	f.checkApplied("grp", aggs, versions)
	if !testenv.WaitFor(30*time.Second, func() bool { return inUse() == 0 }) {
		t.Errorf("member m1's budget has %d of %d slots in use with the group idle, want 0", inUse(), cfg.MaxAckPending)
	}
	// The whole budget is still there: more than it at once goes through.
	f.publishVersions(aggs, versions+1, versions+3)
	f.waitApplied(aggs * (versions + 3))
	f.waitGroupSettled("grp", 2, 30*time.Second)
	f.checkApplied("grp", aggs, versions+3)
}
