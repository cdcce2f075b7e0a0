package faults

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// SIGKILL in the middle of a large transaction: part of its events are
// acknowledged, none of it is confirmed (the watermark moves only past a
// whole transaction), so the restarted relay re-sends it from the start
// and the duplicate window drops what was stored.
func TestKillMidLargeTransaction(t *testing.T) {
	t.Parallel()
	env := testenv.Get(t)
	s := newScenario(t, env.PG, env.NATS.URL)
	s.sample()
	ctx := context.Background()
	rows := 20000
	kills := 1
	if chaos {
		rows, kills = 100000, 3
	}
	r := s.startRelay()
	s.waitSlotActive(30 * time.Second)
	ld := startLoad(t, s.db.Pool, loadSpec{Writers: 2, Aggregates: 100, TxRows: []int{1, 1, 5}, Pause: 2 * time.Millisecond})
	// One transaction of `rows` rows over 100 aggregates of its own, with
	// increasing versions in insertion order.
	bigSubjects := s.name + ".bigtx.>"
	s.exec(ctx, fmt.Sprintf(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload)
		SELECT gen_random_uuid(), 'bigtx', 'big-' || (g %% 100), g / 100 + 1, 'Big', jsonb_build_object('g', g)
		FROM generate_series(0, %d) g`, rows-1))
	bigCount := func() uint64 {
		st, err := s.js.Stream(ctx, s.stream)
		if err != nil {
			return 0
		}
		info, err := st.Info(ctx, jetstream.WithSubjectFilter(bigSubjects))
		if err != nil {
			return 0
		}
		var n uint64
		for _, c := range info.State.Subjects {
			n += c
		}
		return n
	}
	var recovery time.Duration
	for k := 0; k < kills; k++ {
		target := uint64(rows) * uint64(k+1) / uint64(kills+2)
		var seen uint64
		if !testenv.WaitFor(60*time.Second, func() bool { seen = bigCount(); return seen >= target }) {
			t.Fatalf("large transaction: %d of %d events stored after 60s", seen, rows)
		}
		r.kill()
		seen = bigCount()
		if seen >= uint64(rows) {
			t.Logf("kill %d came after the whole transaction was stored (%d events): the window was missed", k+1, seen)
		} else {
			t.Logf("kill %d: %d of %d events of the large transaction stored (the slot may confirm it only once all are)", k+1, seen, rows)
		}
		_, last := s.streamState(ctx, s.stream)
		r = s.startRelay()
		recovery = s.waitProgress(last, 60*time.Second)
	}
	ld.stop()
	o := s.verify(2 * time.Minute)
	s.mustHold("kill -9 mid large transaction", o, recovery, fmt.Sprintf("%d-row tx, %d kill(s)", rows, kills))
}

// SIGKILL after JetStream stored messages but before the relay saw their
// acks: the proxy between relay and broker holds the acks back, the relay
// is killed, and its successor re-publishes what the slot had not
// confirmed. Nats-Msg-Id de-duplication keeps the stream free of copies.
func TestKillAfterPublishBeforeAck(t *testing.T) {
	t.Parallel()
	env := testenv.Get(t)
	proxy, err := testenv.StartProxy(env.NATS.Server().Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxy.Close)
	s := newScenario(t, env.PG, env.NATS.URL)
	s.set("nats.url", "nats://"+proxy.Addr)
	s.sample()
	ctx := context.Background()
	r := s.startRelay()
	s.waitSlotActive(30 * time.Second)
	ld := startLoad(t, s.db.Pool, loadSpec{Writers: 3, Aggregates: 150, TxRows: []int{1, 1, 10}, Pause: time.Millisecond})
	s.waitCount(s.stream, 300, 30*time.Second)
	rounds := 1
	if chaos {
		rounds = 5
	}
	var recovery time.Duration
	for i := 0; i < rounds; i++ {
		before, _ := s.streamState(ctx, s.stream)
		proxy.Stall(testenv.Downstream) // publishes reach the broker, acks do not come back
		// What was on the wire when the acks stopped is stored and never
		// confirmed: the batch in flight (stored perhaps before `before`
		// was read; after the ack timeout its first message is re-sent
		// alone, a duplicate), or with per-aggregate publishing one
		// message per busy aggregate. The newest stored message then
		// stays past the slot's confirmed position.
		if !testenv.WaitFor(10*time.Second, func() bool {
			st, err := s.slot(ctx)
			return err == nil && s.lastCommitLSN(ctx) >= st.ConfirmedFlushLSN
		}) {
			t.Fatal("no stored message stayed unconfirmed while acks were held back")
		}
		time.Sleep(500 * time.Millisecond)
		stored, _ := s.streamState(ctx, s.stream)
		r.kill()
		proxy.Heal()
		proxy.Cut()
		unconfirmed := 0
		if st, err := s.slot(ctx); err == nil {
			for _, m := range readStream(ctx, t, s.js, s.stream) {
				if m.CommitLSN >= st.ConfirmedFlushLSN {
					unconfirmed++
				}
			}
		}
		t.Logf("round %d: %d messages stored during the stall, %d stored past the slot's confirmed position when the relay died", i+1, stored-before, unconfirmed)
		_, last := s.streamState(ctx, s.stream)
		r = s.startRelay()
		recovery = s.waitProgress(last, 60*time.Second)
	}
	ld.stop()
	o := s.verify(2 * time.Minute)
	s.mustHold("kill -9 after publish, before ack", o, recovery, fmt.Sprintf("%d round(s)", rounds))
}

// SIGKILL after the acks arrived but before the standby status update that
// would have confirmed them: with a long status interval the slot lags the
// acknowledged transactions, and the successor re-sends them into the
// duplicate window.
func TestKillAfterAckBeforeStatus(t *testing.T) {
	t.Parallel()
	env := testenv.Get(t)
	s := newScenario(t, env.PG, env.NATS.URL)
	s.set("postgres.status_interval", "10s")
	s.sample()
	ctx := context.Background()
	r := s.startRelay()
	s.waitSlotActive(30 * time.Second)
	rounds := 1
	if chaos {
		rounds = 4
	}
	var recovery time.Duration
	hit := 0
	for i := 0; i < rounds+4 && hit < rounds; i++ {
		n, _ := s.streamState(ctx, s.stream)
		ld := startLoad(t, s.db.Pool, loadSpec{Writers: 2, Aggregates: 50, TxRows: []int{1, 3}, Events: 1000})
		ld.wait()
		// Kill the moment the last ack is in: the status update that
		// confirms it follows within about 100 ms.
		s.waitCount(s.stream, n+1000, 30*time.Second)
		r.kill()
		st, err := s.slot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		r = s.startRelay()
		// Acknowledged but unconfirmed: events whose transaction's commit
		// starts at or after the confirmed position (PostgreSQL re-sends
		// those).
		unconfirmed := 0
		for _, m := range readStream(ctx, t, s.js, s.stream) {
			if m.CommitLSN >= st.ConfirmedFlushLSN {
				unconfirmed++
			}
		}
		if unconfirmed == 0 {
			s.logf("round %d: the slot had already confirmed everything (%s): window missed", i+1, st.ConfirmedFlushLSN)
			continue
		}
		hit++
		s.logf("round %d: %d acknowledged events not yet confirmed (slot at %s) when the relay died", i+1, unconfirmed, st.ConfirmedFlushLSN)
		// Nothing new is written: recovery is the successor streaming.
		start := time.Now()
		s.waitSlotActive(30 * time.Second)
		recovery = time.Since(start)
	}
	if hit == 0 {
		t.Fatal("never killed the relay between ack and status update")
	}
	o := s.verify(time.Minute)
	s.mustHold("kill -9 after ack, before status update", o, recovery, fmt.Sprintf("%d kill(s) in the window, status_interval 10s", hit))
}

// Random SIGKILLs during a long load (the short variant is
// cmd/outbox-relay's TestKill9DuringLoad).
func TestKillRandomRepeated(t *testing.T) {
	if !chaos {
		t.Skip("long variant: OUTBOX_CHAOS=1 (make chaos); the short one is cmd/outbox-relay TestKill9DuringLoad")
	}
	t.Parallel()
	env := testenv.Get(t)
	s := newScenario(t, env.PG, env.NATS.URL)
	s.sample()
	ctx := context.Background()
	r := s.startRelay()
	ld := startLoad(t, s.db.Pool, loadSpec{Writers: 4, Aggregates: 500, TxRows: []int{1, 1, 1, 100}, Pause: time.Millisecond})
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 3))
	var worst time.Duration
	for i := 0; i < 15; i++ {
		time.Sleep(time.Duration(200+rng.IntN(1500)) * time.Millisecond)
		r.kill()
		_, last := s.streamState(ctx, s.stream)
		r = s.startRelay()
		worst = max(worst, s.waitProgress(last, 60*time.Second))
	}
	ld.stop()
	o := s.verify(2 * time.Minute)
	s.mustHold("kill -9 at random points x15", o, worst, "worst recovery")
}
