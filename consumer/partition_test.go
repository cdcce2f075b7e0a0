package consumer

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/consumer/internal/group"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// pinOf is the client partition durable name is pinned to ("" for none).
func (f *fixture) pinOf(name string) string {
	info, ok := f.consumerInfo(name)
	if !ok {
		return ""
	}
	for _, pg := range info.PriorityGroups {
		return pg.PinnedClientID
	}
	return ""
}

// TestGroupHandOffUnpinsNewOwner forces the interleaving of the CI run in
// which a partition went back to a member while its previous owner handed
// it off: the old owner reads the consumer info while it still holds the
// pin, the new owner unpins, resets and is pinned, and only then does the
// old owner unpin — taking the new owner's pin. The partition then shows
// no pinned client while it is idle (JetStream pins a client only when it
// delivers to it), and the new owner must consume what arrives next at
// once: its pull carries the pin id it lost, the server refuses it (423),
// the client pulls again without one and the next delivery pins it.
// Without VersionCheck, every event is applied once and in order.
func TestGroupHandOffUnpinsNewOwner(t *testing.T) {
	f := newFixture(t)
	f.partitionedStream(2)
	cfg := groupConfig(f, 2)
	cfg.VersionCheck, cfg.InitialVersion = false, 0
	rec := newRecorder("grp")
	const aggs = 16
	var n atomic.Int64
	pub := func(k int) {
		for range k {
			i := n.Add(1)
			f.publish(event{ID: uuidN(int(i)), AggID: fmt.Sprintf("agg%d", i%aggs), Version: (i-1)/aggs + 1})
		}
	}
	durable := PartitionDurable("grp", 2, 1)
	stopPub, published := make(chan struct{}), make(chan struct{})
	var raced atomic.Bool
	var newPin atomic.Value // the new owner's pin, which the hand-off then takes
	group.HookHandOffUnpin = func(member, name, old string) {
		if member != "a" || name != durable || raced.Swap(true) {
			return
		}
		if !testenv.WaitFor(20*time.Second, func() bool { p := f.pinOf(durable); return p != "" && p != old }) {
			t.Errorf("the new owner was not pinned within 20s")
		}
		close(stopPub)
		<-published
		newPin.Store(f.pinOf(durable))
	}
	t.Cleanup(func() { group.HookHandOffUnpin = nil })
	f.runMember(cfg, rec, "a")
	f.waitMembers("grp", 1)
	pub(4 * aggs)
	f.waitFor("a applied", 30*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`) == n.Load()
	})
	go func() { // events keep coming until the new owner is pinned
		defer close(published)
		for {
			select {
			case <-stopPub:
				return
			case <-time.After(100 * time.Millisecond):
				pub(aggs)
			}
		}
	}()
	f.runMember(cfg, rec, "b") // partition 1 moves from a to b
	f.waitFor("the hand-off's unpin of the new owner", 30*time.Second, func() bool {
		p, _ := newPin.Load().(string)
		return p != "" && f.pinOf(durable) != p
	})
	f.waitFor("the partitions settled", 30*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`) == n.Load()
	})
	// Idle and unpinned: what arrives now is consumed by b at once.
	pub(4 * aggs)
	f.waitFor("events after the race applied", 10*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`) == n.Load()
	})
	if f.pinOf(durable) == "" {
		t.Errorf("partition 1 consumed but not pinned")
	}
	f.waitGroupSettled("grp", 2, 30*time.Second)
	f.checkApplied("grp", aggs, int(n.Load())/aggs)
}
