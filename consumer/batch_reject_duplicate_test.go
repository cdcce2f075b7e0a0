package consumer

import (
	"context"
	"errors"
	"testing"
	"time"
)

// An event stored twice (the relay republished it) and rejected, in one
// batch whose neighbours fail past maxBatchRedo: the rejection is learnt
// once, kept on the first delivery through the one-at-a-time fallback and
// recorded there, and the second delivery is its duplicate. The handler
// sees the event once; neither delivery is dead-lettered.
func TestBatchRejectionOfAnEventStoredTwice(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	const name = "rejdup"
	r := newRecorder(name)
	rejected := uuidN(950)
	r.fail = func(m *Message, call int) error {
		switch {
		case m.ID == rejected:
			return Reject("registration was cancelled")
		case m.AggregateID != "ok" && call == 1:
			return errors.New("neighbour fails once")
		}
		return nil
	}
	cfg := f.baseConfig(name)
	cfg.MaxAttempts = 3
	c, err := New(f.pool, f.js, cfg, r, WithRegisterer(f.reg))
	if err != nil {
		t.Fatal(err)
	}
	evs := []event{
		{ID: uuidN(951), AggID: "ok", Version: 1},
		{ID: rejected, AggID: "cancelled", Version: 1},
		{ID: rejected, AggID: "cancelled", Version: 1, MsgID: rejected + "/again"},
	}
	for i := range maxBatchRedo + 1 {
		evs = append(evs, event{ID: uuidN(960 + i), AggID: "fails" + string(rune('a'+i)), Version: 1})
	}
	f.publish(evs...)
	jc := f.durable(name, 5*time.Second)
	its := f.fetch(c, jc, len(evs), 5*time.Second)
	w := newWorker(c, nil, 0)
	out := c.processItems(context.Background(), its)
	if !out.solo || out.res[1].kind != resRequeue || out.res[2].kind != resRequeue {
		t.Fatalf("the batch did not fall back to one at a time with both deliveries untried: solo %v, results %v", out.solo, kinds(out.res))
	}
	w.finishAll(context.Background(), its, out)
	drive(c, w, w.take())

	if n := r.callCount(rejected); n != 1 {
		t.Errorf("rejected event: handler called %d times, want 1", n)
	}
	var outcome string
	if err := f.pool.QueryRow(context.Background(), `SELECT outcome FROM consumed_message WHERE consumer = $1 AND event_id = $2`,
		name, rejected).Scan(&outcome); err != nil || outcome != outcomeRejected {
		t.Errorf("rejected event's dedup row: %q, %v", outcome, err)
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = $1 AND event_id = $2`, name, rejected); n != 0 {
		t.Errorf("rejected event's effect committed %d times", n)
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = $1 AND event_id = $2`, name, rejected); n != 0 {
		t.Errorf("rejected event dead-lettered %d times", n)
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = $1 AND event_id = $2`, name, uuidN(951)); n != 1 {
		t.Errorf("its neighbour applied %d times, want 1", n)
	}
	for seq := uint64(1); seq <= 3; seq++ {
		if !f.acked(jc, seq) {
			t.Errorf("delivery %d not acknowledged", seq)
		}
	}
}
