package consumer

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// closingHandler: the event closeID closes an account, and its calls from
// failFrom on fail permanently (a downstream that refuses it after all);
// every other event of the account is rejected while the closure is
// visible in the transaction, applied otherwise.
type closingHandler struct {
	*recorder
	closeID  string
	failFrom int
}

func (h *closingHandler) Handle(ctx context.Context, tx pgx.Tx, m *Message) error {
	if err := h.recorder.Handle(ctx, tx, m); err != nil {
		return err
	}
	if m.ID == h.closeID {
		if h.callCount(m.ID) >= h.failFrom {
			return Permanent(errors.New("account service refuses the closure"))
		}
		return nil
	}
	var closed bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM applied WHERE consumer = $1 AND event_id = $2)`,
		h.name, h.closeID).Scan(&closed); err != nil {
		return err
	}
	if closed {
		return Reject("account is closed")
	}
	return nil
}

// A rejection learnt in a batch was judged with the earlier events of its
// aggregate applied in the same transaction. When one of those does not
// commit after all (it fails in a later try, and is dead-lettered), the
// rejection stands on an effect that never was: the message must be
// judged again, as it would be alone.
func TestBatchRejectionOfAFailedPredecessorIsNotKept(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		others   int // failing neighbours after the rejection: past maxBatchRedo
		failFrom int
	}{
		{name: "requeued behind its aggregate", others: 0, failFrom: 2},
		{name: "one by one after maxBatchRedo", others: maxBatchRedo + 1, failFrom: maxBatchRedo + 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t)
			name := "rejstale"
			h := &closingHandler{recorder: newRecorder(name), closeID: uuidN(500), failFrom: tc.failFrom}
			others := map[string]bool{}
			h.fail = func(m *Message, call int) error {
				if others[m.AggregateID] && call == 1 {
					return errors.New("neighbour fails once")
				}
				return nil
			}
			cfg := f.baseConfig(name)
			cfg.MaxAttempts = 3
			c, err := New(f.pool, f.js, cfg, h, WithRegisterer(f.reg))
			if err != nil {
				t.Fatal(err)
			}
			evs := []event{
				{ID: uuidN(500), AggID: "acct", Version: 1},
				{ID: uuidN(501), AggID: "acct", Version: 2},
			}
			for i := range tc.others {
				agg := "other" + string(rune('a'+i))
				others[agg] = true
				evs = append(evs, event{ID: uuidN(510 + i), AggID: agg, Version: 1})
			}
			f.publish(evs...)
			jc := f.durable(cfg.Name, 5*time.Second)
			its := f.fetch(c, jc, len(evs), 5*time.Second)
			drive(c, newWorker(c, nil, 0), its)

			if n := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = $1 AND event_id = $2`,
				name, uuidN(500)); n != 1 {
				t.Fatalf("closure: %d dead letters, want 1", n)
			}
			var outcome string
			var reason *string
			if err := f.pool.QueryRow(context.Background(), `SELECT outcome, reason FROM consumed_message WHERE consumer = $1 AND event_id = $2`,
				name, uuidN(501)).Scan(&outcome, &reason); err != nil {
				t.Fatal(err)
			}
			applied := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = $1 AND event_id = $2`, name, uuidN(501))
			if outcome != outcomeApplied || applied != 1 {
				r := "<nil>"
				if reason != nil {
					r = *reason
				}
				t.Errorf("the account's closure was dead-lettered, never applied; its next event ended %q (reason %q), applied %d times, handler called %d times: want applied once",
					outcome, r, applied, h.callCount(uuidN(501)))
			}
		})
	}
}
