package faults

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Dead-peer detection bounds docs/faults.md states, and the settings the
// tests use to check them.
const (
	// pgReceiveTimeout is the relay's postgres.receive_timeout in the
	// PostgreSQL link test: silence that long means a dead connection.
	pgReceiveTimeout = 3 * time.Second
	// pgWalSenderTimeout is the test server's wal_sender_timeout: how long
	// PostgreSQL keeps a vanished relay's walsender (and so the slot) busy.
	pgWalSenderTimeout = 10 * time.Second
	// standbyPoll is how often a relay that finds the slot in use retries.
	standbyPoll = 2 * time.Second
	// natsStaleBound: the relay's NATS client pings every 5 s and gives up
	// after 2 unanswered pings, so a dead connection is detected in 10-15 s.
	natsStaleBound = 15 * time.Second
	// slack absorbs scheduling on a loaded 2-core machine.
	slack = 5 * time.Second
)

// netFault is one network fault applied through the proxy while the load
// runs.
type netFault struct {
	name string
	// needs names a configuration key the fault needs, set to needValue
	// before the relay starts.
	needs     string
	needValue any
	// apply injects the fault and returns when it is over (healed), with
	// how long the relay took to notice (0 when not measured).
	apply func(t *testing.T, f *netRun) (detect time.Duration, note string)
	// bound limits the time from the fault's end until the relay has
	// caught up (every event committed by then confirmed).
	bound time.Duration
}

// netRun is the state a fault works on.
type netRun struct {
	s     *scenario
	p     *testenv.Proxy
	r     *relayProc
	link  string // "postgres" or "nats"
	lost  func(logEntry) bool
	start time.Time
}

// detected waits for the relay to log that it lost the link after the
// fault began, and returns how long that took.
func (f *netRun) detected(t *testing.T, timeout time.Duration) time.Duration {
	t.Helper()
	at, ok := f.r.waitLog(f.start, timeout, f.lost)
	if !ok {
		t.Errorf("%s: the relay did not notice the fault within %s", f.link, timeout)
		return 0
	}
	return at.Sub(f.start)
}

// runNetFaults drives a load through the relay while each fault happens in
// turn on the link to one server, then checks the guarantees.
func runNetFaults(t *testing.T, s *scenario, p *testenv.Proxy, link string, lost func(logEntry) bool, faults []netFault) {
	// Keys a fault needs are set before the relay starts.
	for _, f := range faults {
		if f.needs != "" {
			s.set(f.needs, f.needValue)
		}
	}
	s.sample()
	run := &netRun{s: s, p: p, r: s.startRelay(), link: link, lost: lost}
	ld := startLoad(t, s.db.Pool, loadSpec{Writers: 2, Aggregates: 100, TxRows: []int{1, 1, 4}, Pause: 5 * time.Millisecond})
	s.waitCount(s.stream, 200, 30*time.Second)
	type result struct {
		name              string
		detect, recovered time.Duration
		note              string
	}
	var results []result
	for _, f := range faults {
		t.Run(f.name, func(t *testing.T) {
			if _, err := s.caughtUp(30 * time.Second); err != nil {
				t.Fatalf("before the fault: %v", err)
			}
			run.start = time.Now()
			detect, note := f.apply(t, run)
			if t.Failed() {
				return
			}
			// Recovered: everything committed by the fault's end is
			// relayed and confirmed.
			rec, err := s.caughtUp(f.bound)
			if err != nil {
				t.Errorf("%s %s, after the fault ended: %v", link, f.name, err)
				return
			}
			s.logf("%s %s: detected in %s, caught up %s after the fault ended %s", link, f.name, detect.Round(time.Millisecond), rec.Round(time.Millisecond), note)
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

func cutFault() netFault {
	return netFault{name: "cut (RST)", bound: 15 * time.Second,
		apply: func(t *testing.T, f *netRun) (time.Duration, string) {
			f.p.Cut()
			return f.detected(t, 15*time.Second), ""
		}}
}

func partitionFault(d time.Duration) netFault {
	return netFault{name: fmt.Sprintf("partition %s then heal", d), bound: 20 * time.Second,
		apply: func(t *testing.T, f *netRun) (time.Duration, string) {
			f.p.Stall(testenv.Both)
			time.Sleep(d)
			f.p.Heal()
			n := f.r.countLog(f.start, f.lost)
			return 0, fmt.Sprintf("(%d reconnect(s) during the partition)", n)
		}}
}

func slowFault(lat, d time.Duration) netFault {
	return netFault{name: fmt.Sprintf("slow (+%s per chunk) for %s", lat, d), bound: 20 * time.Second,
		apply: func(t *testing.T, f *netRun) (time.Duration, string) {
			n0, _ := f.s.streamState(t.Context(), f.s.stream)
			f.p.SetLatency(lat)
			time.Sleep(d)
			n1, _ := f.s.streamState(t.Context(), f.s.stream)
			f.p.SetLatency(0)
			if n := f.r.countLog(f.start, f.lost); n > 0 {
				t.Errorf("a slow link was taken for a dead one: %d reconnect(s)", n)
			}
			if n1 <= n0 {
				t.Errorf("nothing was relayed over the slow link in %s", d)
			}
			return 0, fmt.Sprintf("(%d events relayed while slow, no reconnect)", n1-n0)
		}}
}

// deadPeerFault blackholes the current connection: nothing crosses it any
// more, not even a close. Only the relay's own timers can tell.
func deadPeerFault(detectBound, recoverBound time.Duration) netFault {
	return netFault{name: "dead peer (blackhole)", bound: recoverBound,
		apply: func(t *testing.T, f *netRun) (time.Duration, string) {
			f.p.Blackhole()
			d := f.detected(t, 60*time.Second)
			if d > detectBound {
				t.Errorf("dead %s connection detected after %s, want at most %s", f.link, d, detectBound)
			}
			return d, fmt.Sprintf("(bound %s)", detectBound)
		}}
}

// connectBlackholeFault kills the current connection silently and makes
// new connections reach nothing for d: a client without connect and
// handshake timeouts hangs on its first reconnect attempt for good.
func connectBlackholeFault(d, detectBound, recoverBound time.Duration) netFault {
	return netFault{name: fmt.Sprintf("dead peer, reconnects blackholed for %s", d), bound: recoverBound,
		apply: func(t *testing.T, f *netRun) (time.Duration, string) {
			f.p.BlackholeNew(true)
			f.p.Blackhole()
			detect := f.detected(t, detectBound)
			// Let the reconnect attempts sit on dead connections, then
			// open the way: only a client that gives up on them recovers.
			time.Sleep(max(0, d-time.Since(f.start)))
			f.p.BlackholeNew(false)
			return detect, ""
		}}
}

// Network faults between the relay and PostgreSQL, through a TCP proxy: a
// reset connection, a silently dead one (found by postgres.receive_timeout;
// the slot is free again once the server's wal_sender_timeout ends the
// orphaned walsender), a partition that heals, a slow link, and a dead peer
// whose reconnects are blackholed too (the reconnect must time out).
func TestNetworkFaultsPostgres(t *testing.T) {
	t.Parallel()
	pg, err := testenv.StartPostgres(testenv.WithSetting("wal_sender_timeout", fmt.Sprintf("'%ds'", int(pgWalSenderTimeout.Seconds()))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	p, err := testenv.StartProxy(fmt.Sprintf("127.0.0.1:%d", pg.Port()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	s := newScenario(t, pg, testenv.Get(t).NATS.URL)
	s.set("postgres.url", withHostPort(s.db.URL, p.Addr))
	detect := pgReceiveTimeout + time.Second + slack
	// After a dead peer the relay reconnects at once but finds the slot
	// held by its own orphaned walsender until wal_sender_timeout.
	resume := pgWalSenderTimeout + standbyPoll + slack
	deadPeer := deadPeerFault(detect, resume)
	deadPeer.needs, deadPeer.needValue = "postgres.receive_timeout", pgReceiveTimeout.String()
	hole := connectBlackholeFault(8*time.Second, detect, resume+10*time.Second)
	hole.needs, hole.needValue = deadPeer.needs, deadPeer.needValue
	lost := func(e logEntry) bool { return e.Msg == "replication interrupted; reconnecting" }
	runNetFaults(t, s, p, "postgres", lost, []netFault{cutFault(), deadPeer, partitionFault(4 * time.Second), slowFault(20*time.Millisecond, 4*time.Second), hole})
}

// The same faults between the relay and NATS. A dead connection is found
// by the client's pings (every 5 s, 2 outstanding); connects time out
// after 5 s.
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
	detect := natsStaleBound + slack
	lost := func(e logEntry) bool { return e.Logger == "nats" && e.Msg == "nats disconnected" }
	runNetFaults(t, s, p, "nats", lost, []netFault{cutFault(), deadPeerFault(detect, 20*time.Second), partitionFault(4 * time.Second),
		slowFault(20*time.Millisecond, 4*time.Second), connectBlackholeFault(12*time.Second, detect, 30*time.Second)})
}
