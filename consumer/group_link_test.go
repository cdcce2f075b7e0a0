package consumer

// A member's link to NATS that flaps. Written first as a helper's attack
// (branch attack10) on the roster watch started anew at every reconnect:
// on a link cut every 300 ms the watch, restarted faster than it could
// read, let the member's own entry expire (partitions unowned 3.7 s at TTL
// 2 s in one run of four), and each restart's replay of a dead member's
// last heartbeat renewed it (its partitions unowned 3.5 s against 1.7 s).
// A reconnect now restarts the watch only if it delivered nothing since,
// and a replay renews nothing (TestRosterReplayDoesNotRenew).

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// linkConn is a connection to NATS through p, as a member's would be.
func linkConn(t *testing.T, p *testenv.Proxy) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect("nats://"+p.Addr, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	testenv.Must(t, err, "connect through the proxy")
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	testenv.Must(t, err, "jetstream")
	return js
}

func logCount(obs *observer.ObservedLogs, text string) int {
	n := 0
	for _, e := range obs.All() {
		if strings.Contains(fmt.Sprint(e.Message, e.ContextMap()), text) {
			n++
		}
	}
	return n
}

func reorderedCount(t *testing.T, f *fixture) int64 {
	return queryInt(t, f.pool, `SELECT count(*) FROM (SELECT version, lag(version) OVER (PARTITION BY aggregate_id ORDER BY n) AS prev
		FROM applied WHERE consumer = 'grp') s WHERE prev IS NOT NULL AND version <= prev`)
}

// ownGroup is a group on a NATS server of its own: members a and b, each
// through a proxy of its own when proxied, consuming version 1 of aggs
// aggregates of a 4-partition stream on storage.
type ownGroup struct {
	f       *fixture
	nats    *testenv.NATS
	ttl     time.Duration
	regs    []prometheus.Gatherer
	dones   []chan error
	cancels []context.CancelFunc
	logs    []*observer.ObservedLogs
	proxies []*testenv.Proxy
}

func startOwnGroup(t *testing.T, storage jetstream.StorageType, proxied bool, aggs int) *ownGroup {
	t.Helper()
	n, err := testenv.StartNATS()
	testenv.Must(t, err, "start nats")
	t.Cleanup(n.Close)
	g := &ownGroup{nats: n, f: newFixtureOn(t, testenv.Get(t).NewDatabase(t), n.URL)}
	g.f.partitionedStreamOn(4, storage)
	cfg := groupConfig(g.f, 4)
	g.ttl = cfg.Group.MemberTTL
	for _, id := range []string{"a", "b"} {
		js := g.f.js
		if proxied {
			p, err := testenv.StartProxy(strings.TrimPrefix(n.URL, "nats://"))
			testenv.Must(t, err, "proxy")
			t.Cleanup(p.Close)
			js = linkConn(t, p)
			g.proxies = append(g.proxies, p)
		}
		reg := prometheus.NewRegistry()
		log, obs := observedLogger(t, id)
		done, cancel := g.f.runJoiner(js, cfg, id, 4, log, WithRegisterer(reg))
		g.regs, g.dones, g.cancels, g.logs = append(g.regs, reg), append(g.dones, done), append(g.cancels, cancel), append(g.logs, obs)
	}
	g.f.publishVersions(aggs, 1, 1)
	g.f.waitApplied(aggs)
	for _, reg := range g.regs {
		g.f.waitOwns(reg, func(n float64) bool { return n == 2 })
	}
	return g
}

// TestGroupFlappingLink: two members, each through a proxy; member a's
// link is cut every 300 ms, 50 times (the server stays up, so the watch's
// ordered consumer survives each cut) while events are published. No
// partition goes unowned for more than a member TTL, every event is
// applied once and in order.
func TestGroupFlappingLink(t *testing.T) {
	t.Parallel() // its own NATS server and database
	const aggs = 16
	g := startOwnGroup(t, jetstream.MemoryStorage, true, aggs)
	f, ttl, regs, dones, logs, proxies := g.f, g.ttl, g.regs, g.dones, g.logs, g.proxies
	const period, flaps = 300 * time.Millisecond, 50
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for range flaps {
			time.Sleep(period)
			proxies[0].Cut()
		}
	}()
	const versions = 6
	go func() {
		for v := 2; v <= versions; v++ {
			time.Sleep(period)
			f.publishVersions(aggs, v, v)
		}
	}()
	start := time.Now()
	whole := func() bool {
		ma, _ := f.metricOf(regs[0], "outbox_consumer_group_members")
		mb, _ := f.metricOf(regs[1], "outbox_consumer_group_members")
		return f.appliedCount() == int64(versions*aggs) && ma == 2 && mb == 2
	}
	longest, ok := f.unowned(time.Duration(flaps+1)*period, 90*time.Second, 4, whole, regs...)
	wg.Wait()
	for i, done := range dones {
		select {
		case err := <-done:
			t.Errorf("member %d exited: %v", i, err)
		default:
		}
	}
	twice := f.appliedTwice()
	reordered := reorderedCount(t, f)
	t.Logf("%d cuts of a's link every %s: partitions unowned for at most %s (TTL %s); a's watch started anew on reconnect %d times, stale %d times; b's %d/%d; accepted by a's proxy %d; whole after %s",
		flaps, period, longest.Round(time.Millisecond), ttl,
		logCount(logs[0], "connection to NATS reconnected"), logCount(logs[0], "delivered none of this member"),
		logCount(logs[1], "connection to NATS reconnected"), logCount(logs[1], "delivered none of this member"),
		proxies[0].Accepted(), time.Since(start).Round(time.Millisecond))
	if !ok {
		t.Errorf("not whole within 90 s: applied %d of %d", f.appliedCount(), versions*aggs)
	}
	if longest > ttl {
		t.Errorf("partitions unowned for %s (> a member TTL of %s) under a flapping link of one member", longest.Round(time.Millisecond), ttl)
	}
	if twice != 0 || reordered != 0 {
		t.Errorf("%d applied twice, %d out of order", twice, reordered)
	}
}

// TestGroupDeadMemberBesideFlappingLink: member b vanishes (its link
// blackholed, then stopped: it cannot delete its entry) while member a's
// link is cut every half TTL. a owns all four partitions within one and a
// half member TTLs, as with a steady link: its watch, delivering, is not
// started anew at each reconnect, and a restart's replay of b's last
// heartbeat (still in the bucket until its TTL) would not renew b.
func TestGroupDeadMemberBesideFlappingLink(t *testing.T) {
	t.Parallel() // its own NATS server and database
	const aggs = 16
	g := startOwnGroup(t, jetstream.MemoryStorage, true, aggs)
	f, ttl, regs, cancels, logs, proxies := g.f, g.ttl, g.regs, g.cancels, g.logs, g.proxies
	proxies[1].Blackhole()
	proxies[1].BlackholeNew(true)
	dead := time.Now()
	cancels[1]()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(ttl / 2):
				proxies[0].Cut()
			}
		}
	}()
	var took time.Duration
	for time.Since(dead) < 30*time.Second {
		owned, _ := f.metricOf(regs[0], "outbox_consumer_group_partitions_owned")
		members, _ := f.metricOf(regs[0], "outbox_consumer_group_members")
		if owned == 4 && members == 1 {
			took = time.Since(dead)
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	t.Logf("b vanished; a (link cut every %s) owned all 4 after %s (TTL %s); a's watch restarts on reconnect %d, stale %d; a's proxy accepted %d",
		ttl/2, took.Round(time.Millisecond), ttl, logCount(logs[0], "connection to NATS reconnected"), logCount(logs[0], "delivered none of this member"), proxies[0].Accepted())
	if took == 0 {
		t.Fatalf("a did not own all 4 partitions within 30 s of b vanishing")
	}
	if took > 3*ttl/2 {
		t.Errorf("a dead member's partitions went unowned for %s (> 1.5 member TTLs of %s; about one TTL plus a step with the watch kept)", took.Round(time.Millisecond), ttl)
	}
}
