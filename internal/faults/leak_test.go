package faults

import (
	"context"
	"os"
	"runtime"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/relay"
)

// No goroutine or connection leaks across 100 reconnect cycles: the relay
// runs in this process (so its goroutines can be counted) behind two
// proxies; each cycle cuts the PostgreSQL connection (every fifth also the
// NATS one), writes events and waits until they are relayed. Afterwards
// the goroutine count is back at its baseline and one connection per
// server remains.
//
// Not parallel: goroutines are counted process-wide, so no other test may
// run meanwhile (Go runs the sequential tests before the parallel ones).
func TestNoLeaksAcrossReconnects(t *testing.T) {
	env := testenv.Get(t)
	pgp, err := testenv.StartProxy("127.0.0.1:" + itoa(env.PG.Port()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pgp.Close)
	np, err := testenv.StartProxy(strings.TrimPrefix(env.NATS.URL, "nats://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(np.Close)
	s := newScenario(t, env.PG, env.NATS.URL)
	s.set("postgres.url", withHostPort(s.db.URL, pgp.Addr))
	s.set("nats.url", "nats://"+np.Addr)
	s.set("postgres.receive_timeout", "5s")
	cfg, err := config.Load(config.Sources{File: s.writeConfig()})
	if err != nil {
		t.Fatal(err)
	}
	rcfg := cfg.Relay()
	rcfg.ReconnectMin, rcfg.ReconnectMax = 10*time.Millisecond, 50*time.Millisecond
	nc, err := nats.Connect("nats://"+np.Addr, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond),
		nats.ReconnectJitter(0, 0), nats.PingInterval(5*time.Second), nats.MaxPingsOutstanding(2))
	if err != nil {
		t.Fatal(err)
	}
	var log *zap.Logger = zap.NewNop()
	if testing.Verbose() && os.Getenv("OUTBOX_FAULTS_RELAY_LOG") != "" {
		log = zaptest.NewLogger(t)
	}
	rl, err := relay.New(rcfg, nc, relay.WithLogger(log))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rl.Run(ctx) }()
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			cancel()
			if err := <-done; err != nil {
				t.Errorf("relay Run: %v", err)
			}
			nc.Close()
		}
	}
	t.Cleanup(stop)

	total := uint64(0)
	write := func(n int) {
		startLoad(t, s.db.Pool, loadSpec{Writers: 1, Aggregates: 20, Events: n}).wait()
		total += uint64(n)
		s.waitCount(s.stream, total, 30*time.Second)
	}
	write(100)
	if _, err := s.caughtUp(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	settle := func() int {
		var n int
		// Goroutines of closed connections and finished writers exit
		// asynchronously: take the lowest count over a short while.
		low := runtime.NumGoroutine()
		for i := 0; i < 10; i++ {
			time.Sleep(50 * time.Millisecond)
			n = runtime.NumGoroutine()
			low = min(low, n)
		}
		return low
	}
	base := settle()
	pgBase, natsBase := pgp.Accepted(), np.Accepted()
	cycles := 100
	start := time.Now()
	for i := 0; i < cycles; i++ {
		pgp.Cut()
		if i%5 == 0 {
			np.Cut()
		}
		write(5)
	}
	elapsed := time.Since(start)
	if _, err := s.caughtUp(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	var after int
	leaked := !testenv.WaitFor(15*time.Second, func() bool {
		after = settle()
		return after <= base+3
	})
	s.logf("%d cycles in %s: %d PostgreSQL and %d NATS connections opened; goroutines %d before, %d after; open connections: PostgreSQL %d, NATS %d",
		cycles, elapsed.Round(time.Millisecond), pgp.Accepted()-pgBase, np.Accepted()-natsBase, base, after, pgp.Active(), np.Active())
	if leaked {
		var b strings.Builder
		_ = pprof.Lookup("goroutine").WriteTo(&b, 1)
		t.Errorf("goroutines: %d before %d reconnect cycles, %d after: leak\n%s", base, cycles, after, b.String())
	}
	if pgp.Accepted()-pgBase < int64(cycles) {
		t.Errorf("only %d PostgreSQL connections for %d cuts: the cuts did not all force a reconnect", pgp.Accepted()-pgBase, cycles)
	}
	// PostgreSQL: the replication session and the publication check's
	// connection of its own.
	if !testenv.WaitFor(10*time.Second, func() bool { return pgp.Active() <= 2 && np.Active() <= 1 }) {
		t.Errorf("open connections after the cycles: PostgreSQL %d, NATS %d, want at most 2 and 1", pgp.Active(), np.Active())
	}
	stop()
	if !testenv.WaitFor(5*time.Second, func() bool { return pgp.Active()+np.Active() == 0 }) {
		t.Errorf("%d connections still open after the relay stopped", pgp.Active()+np.Active())
	}
	record(faultRow{Fault: "100 reconnect cycles (leaks)", Events: int(total), Note: "goroutines " + itoa(base) + " -> " + itoa(after) + ", connections 2+1"})
}
