package consumer

import (
	"context"
	"testing"
	"time"
)

// A rejection learnt in a batch outlives the batch. The handler rejected
// the event once; the batch was tried again with the rejection recorded
// instead, and failed for its neighbours until maxBatchRedo sent what was
// left back to be taken one at a time. There the rejection was forgotten
// and the handler called a second time for the same delivery, which alone
// it never is. A loaded CI run met it in TestErrorClasses (batch size 64:
// "rejected: handler called 2 times, want 1"), when its five events shared
// one worker's batch; here they always do.
func TestBatchRejectionSurvivesOneByOne(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := newRecorder("rejone")
	r.fail = classFailure
	cfg := f.baseConfig("rejone")
	cfg.MaxAttempts = 3
	c, err := New(f.pool, f.js, cfg, r, WithRegisterer(f.reg))
	if err != nil {
		t.Fatal(err)
	}
	// perm fails the first try, reject is rejected in the second, unknown
	// and panic fail the third and fourth: past maxBatchRedo.
	order := []string{"perm", "reject", "unknown", "panic", "flaky"}
	for i, agg := range order {
		f.publish(event{ID: uuidN(300 + i), AggID: agg, Version: 1})
	}
	jc := f.durable(cfg.Name, 5*time.Second)
	its := f.fetch(c, jc, len(order), 5*time.Second)
	drive(c, newWorker(c, nil, 0), its)
	if n := r.callCount(uuidN(301)); n != 1 {
		t.Errorf("rejected event: handler called %d times, want 1", n)
	}
	var outcome string
	if err := f.pool.QueryRow(context.Background(), `SELECT outcome FROM consumed_message WHERE consumer = 'rejone' AND event_id = $1`,
		uuidN(301)).Scan(&outcome); err != nil || outcome != "rejected" {
		t.Errorf("rejected event's dedup row: %q, %v", outcome, err)
	}
}
