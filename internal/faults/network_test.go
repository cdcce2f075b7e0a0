package faults

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// netBounds are the dead-peer detection bounds docs/faults.md states.
const (
	// pgReceiveTimeout is the receive timeout the PostgreSQL test
	// configures; detection takes at most that plus one status interval.
	pgReceiveTimeout = 3 * time.Second
	// natsStaleBound: the relay's NATS client pings every 5 s and gives up
	// after 2 unanswered pings, so a dead connection is detected in 10-15 s.
	natsStaleBound = 15 * time.Second
	// slack absorbs scheduling on a loaded 2-core machine.
	slack = 3 * time.Second
)

// netFault is one network fault applied through the proxy while the load
// runs.
type netFault struct {
	name string
	// needs names a configuration key the fault needs, set to needValue.
	needs     string
	needValue any
	// apply injects the fault; it returns when the fault is over (healed)
	// and how long detection took (0 when not measured).
	apply func(t *testing.T, s *scenario, p *testenv.Proxy) (detect time.Duration, note string)
	// bound limits the recovery after the fault ends.
	bound time.Duration
}

// runNetFaults drives a load through the relay while each fault happens in
// turn on the link to one server, then checks the guarantees.
func runNetFaults(t *testing.T, s *scenario, p *testenv.Proxy, link string, faults []netFault) {
	ctx := context.Background()
	// Keys a fault needs are set before the relay starts; a fault whose key
	// the core does not know yet is skipped, naming the missing feature.
	missing := map[string]string{}
	for _, f := range faults {
		if f.needs != "" {
			if ok, what := s.trySet(f.needs, f.needValue); !ok {
				missing[f.needs] = what
			}
		}
	}
	s.sample()
	s.startRelay()
	ld := startLoad(t, s.db.Pool, loadSpec{Writers: 2, Aggregates: 100, TxRows: []int{1, 1, 10}, Pause: 2 * time.Millisecond})
	s.waitCount(s.stream, 200, 30*time.Second)
	type result struct {
		name              string
		detect, recovered time.Duration
		note              string
	}
	var results []result
	for _, f := range faults {
		t.Run(f.name, func(t *testing.T) {
			if what := missing[f.needs]; what != "" {
				t.Skipf("blocked on: %s is not implemented yet", what)
			}
			_, last := s.streamState(ctx, s.stream)
			detect, note := f.apply(t, s, p)
			if t.Failed() {
				return
			}
			// Progress after the fault: a margin over the last sequence
			// seen, since in-flight acks may still land.
			start := time.Now()
			ok := testenv.WaitFor(f.bound, func() bool {
				_, l := s.streamState(ctx, s.stream)
				return l > last+20
			})
			rec := time.Since(start)
			if !ok {
				t.Errorf("%s %s: the relay did not publish again within %s of the fault's end", link, f.name, f.bound)
				return
			}
			s.logf("%s %s: detected in %s, publishing again %s after the fault ended %s", link, f.name, detect.Round(time.Millisecond), rec.Round(time.Millisecond), note)
			results = append(results, result{f.name, detect, rec, note})
		})
	}
	ld.stop()
	o := s.verify(2 * time.Minute)
	for _, r := range results {
		note := r.note
		if r.detect > 0 {
			note = fmt.Sprintf("detected in %s %s", r.detect.Round(10*time.Millisecond), note)
		}
		record(faultRow{Fault: link + " link: " + r.name, Events: o.Written, Missing: o.Missing, OutOfOrder: o.OutOfOrder,
			Duplicates: o.Duplicates, LSNAhead: o.LSNAhead, Recovery: r.recovered, Note: note})
	}
	s.t.Logf("%s link faults: %s", link, o)
	if !o.OK() || o.LSNAhead > 0 {
		t.Fatalf("%s link faults: guarantees broken: %s", link, o)
	}
}

// waitNewConn waits until the client opened a connection after the fault
// began, and returns how long that took.
func waitNewConn(t *testing.T, p *testenv.Proxy, before int64, start time.Time, timeout time.Duration) time.Duration {
	t.Helper()
	if !testenv.WaitFor(timeout, func() bool { return p.Accepted() > before }) {
		t.Errorf("no reconnect within %s", timeout)
		return 0
	}
	return time.Since(start)
}

// faults common to both links.
func cutFault() netFault {
	return netFault{name: "cut (RST)", bound: 15 * time.Second,
		apply: func(t *testing.T, s *scenario, p *testenv.Proxy) (time.Duration, string) {
			before, start := p.Accepted(), time.Now()
			p.Cut()
			return waitNewConn(t, p, before, start, 15*time.Second), ""
		}}
}

func partitionFault(d time.Duration) netFault {
	return netFault{name: fmt.Sprintf("partition %s then heal", d), bound: 20 * time.Second,
		apply: func(t *testing.T, s *scenario, p *testenv.Proxy) (time.Duration, string) {
			p.Stall(testenv.Both)
			time.Sleep(d)
			p.Heal()
			return 0, ""
		}}
}

func slowFault(lat, d time.Duration) netFault {
	return netFault{name: fmt.Sprintf("slow (+%s per chunk) for %s", lat, d), bound: 15 * time.Second,
		apply: func(t *testing.T, s *scenario, p *testenv.Proxy) (time.Duration, string) {
			before := p.Accepted()
			n0, _ := s.streamState(context.Background(), s.stream)
			p.SetLatency(lat)
			time.Sleep(d)
			n1, _ := s.streamState(context.Background(), s.stream)
			p.SetLatency(0)
			if p.Accepted() != before {
				t.Errorf("a slow link was taken for a dead one: %d reconnects", p.Accepted()-before)
			}
			if n1 <= n0 {
				t.Errorf("nothing was relayed over the slow link in %s", d)
			}
			return 0, fmt.Sprintf("(%d events relayed while slow, no reconnect)", n1-n0)
		}}
}

// connectBlackholeFault kills the current connection silently and makes
// new connections reach nothing for d: a client without connect and
// handshake timeouts hangs on its first reconnect attempt forever.
func connectBlackholeFault(d, detectBound time.Duration) netFault {
	return netFault{name: fmt.Sprintf("dead peer, reconnects blackholed for %s", d), bound: 30 * time.Second,
		apply: func(t *testing.T, s *scenario, p *testenv.Proxy) (time.Duration, string) {
			before, start := p.Accepted(), time.Now()
			p.BlackholeNew(true)
			p.Blackhole()
			detect := waitNewConn(t, p, before, start, detectBound)
			// Let the attempt sit on the dead connection, then open the
			// way: only a client that gives up on it and retries recovers.
			time.Sleep(max(0, d-time.Since(start)))
			p.BlackholeNew(false)
			return detect, fmt.Sprintf("(%d connections attempted while blackholed)", p.Accepted()-before)
		}}
}

// Network faults between the relay and PostgreSQL, through a TCP proxy:
// a reset connection, a silently dead one (detected by the receive
// timeout), a partition that heals, a slow link, and a dead peer whose
// reconnects are blackholed too (the reconnect itself must time out).
func TestNetworkFaultsPostgres(t *testing.T) {
	t.Parallel()
	env := testenv.Get(t)
	p, err := testenv.StartProxy(fmt.Sprintf("127.0.0.1:%d", env.PG.Port()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	s := newScenario(t, env.PG, env.NATS.URL)
	s.set("postgres.url", withHostPort(s.db.URL, p.Addr))
	detectBound := pgReceiveTimeout + time.Second + slack
	deadPeer := netFault{name: "dead peer (blackhole)", needs: "postgres.receive_timeout", needValue: pgReceiveTimeout.String(), bound: 15 * time.Second,
		apply: func(t *testing.T, s *scenario, p *testenv.Proxy) (time.Duration, string) {
			before, start := p.Accepted(), time.Now()
			p.Blackhole()
			d := waitNewConn(t, p, before, start, 60*time.Second)
			if d > detectBound {
				t.Errorf("dead PostgreSQL connection detected after %s, want at most %s (receive_timeout %s + status interval + slack)", d, detectBound, pgReceiveTimeout)
			}
			return d, fmt.Sprintf("(bound %s)", detectBound)
		}}
	hole := connectBlackholeFault(12*time.Second, detectBound)
	hole.needs, hole.needValue = "postgres.receive_timeout", pgReceiveTimeout.String()
	faults := []netFault{cutFault(), deadPeer, partitionFault(4 * time.Second), slowFault(20*time.Millisecond, 4*time.Second), hole}
	runNetFaults(t, s, p, "postgres", faults)
}

// The same faults between the relay and NATS. A dead connection is found
// by the client's pings (every 5 s, 2 outstanding).
func TestNetworkFaultsNATS(t *testing.T) {
	t.Parallel()
	env := testenv.Get(t)
	p, err := testenv.StartProxy(strings.TrimPrefix(env.NATS.URL, "nats://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	s := newScenario(t, env.PG, env.NATS.URL)
	s.set("nats.url", "nats://"+p.Addr)
	detectBound := natsStaleBound + slack
	deadPeer := netFault{name: "dead peer (blackhole)", bound: 20 * time.Second,
		apply: func(t *testing.T, s *scenario, p *testenv.Proxy) (time.Duration, string) {
			before, start := p.Accepted(), time.Now()
			p.Blackhole()
			d := waitNewConn(t, p, before, start, 60*time.Second)
			if d > detectBound {
				t.Errorf("dead NATS connection detected after %s, want at most %s (2 pings at 5 s + slack)", d, detectBound)
			}
			return d, fmt.Sprintf("(bound %s)", detectBound)
		}}
	faults := []netFault{cutFault(), deadPeer, partitionFault(4 * time.Second), slowFault(20*time.Millisecond, 4*time.Second),
		connectBlackholeFault(12*time.Second, detectBound)}
	runNetFaults(t, s, p, "nats", faults)
}
