package relay_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Regression (issue 16, case 5): a core NATS subscriber answering
// {"stream":"FAKE","seq":1} on a subject bound to no stream made the relay
// settle the event as stored and confirm past it. The answer is a bad ack:
// the event stays unsettled while it comes, and once nothing answers the
// subject the event is dead-lettered (no_stream).
func TestRelayRefusesAckFromAnotherStream(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.Cfg.BatchPublish = "off"
	f.Cfg.Router.Tables[0].Subject = "elsewhere_" + f.Prefix + ".{aggregate_id}" // bound to no stream
	var answered atomic.Int32
	sub, err := f.NC.Subscribe("elsewhere_"+f.Prefix+".>", func(m *nats.Msg) {
		answered.Add(1)
		_ = m.Respond([]byte(`{"stream":"FAKE","seq":1}`))
	})
	if err != nil {
		t.Fatal(err)
	}
	f.Setup(ctx)
	f.start(ctx)
	if _, err := f.DB.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_id, aggregate_version, event_type, payload)
		VALUES (gen_random_uuid(), 'a', 1, 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	if !testenv.WaitFor(30*time.Second, func() bool { return answered.Load() >= 3 }) {
		t.Fatalf("%d fake answers", answered.Load())
	}
	if lag := f.slot(ctx).LagBytes; lag == 0 {
		t.Fatal("the slot confirmed past an event only a fake stream acknowledged")
	}
	if err := sub.Unsubscribe(); err != nil {
		t.Fatal(err)
	}
	f.WaitCount(ctx, f.DLQ, 1, 60*time.Second)
	if c := relaytest.ReadStream(ctx, t, f.JS, f.DLQ)[0].Headers[contract.DLQReasonClass][0]; c != "no_stream" {
		t.Fatalf("reason class %q", c)
	}
	f.waitConfirmed(ctx, 10*time.Second, nil)
}
