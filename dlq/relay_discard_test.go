package dlq

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Issue 17, likely case: a relay discard writes the audit entry, then
// deletes; two operators discarding one record at once produced two audit
// entries and one error. The entry's id now names the record: one entry,
// and the record deleted meanwhile counts as discarded.
func TestRelayDiscardTwiceAtOnceAuditsOnce(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := context.Background()
	dlqStream, auditStream := testenv.UniqueName("DLQ"), testenv.UniqueName("AUDIT")
	_, err := f.js.CreateStream(ctx, jetstream.StreamConfig{Name: dlqStream, Subjects: []string{dlqStream + ".>"}, Storage: jetstream.MemoryStorage})
	testenv.Must(t, err, "dlq stream")
	t.Cleanup(func() {
		_ = f.js.DeleteStream(context.Background(), dlqStream)
		_ = f.js.DeleteStream(context.Background(), auditStream)
	})
	m := nats.NewMsg(dlqStream + ".public_outbox")
	m.Header.Set(contract.MsgID, "dlq-1")
	m.Header.Set(contract.Table, "public.outbox")
	m.Data = []byte(`{"event_id":"evt-1","row":{}}`)
	_, err = f.js.PublishMsg(ctx, m)
	testenv.Must(t, err, "publish")

	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := NewRelayDLQ(f.js, dlqStream, auditStream, auditStream+".entries")
			errs[i] = r.Discard(ctx, Action{Actor: fmt.Sprintf("op%d", i), Reason: "row fixed"}, []uint64{1})
		}()
	}
	wg.Wait()
	for i, err := range errs {
		// One that read the record after another deleted it is told so.
		if err != nil && !errors.Is(err, ErrNotFound) {
			t.Errorf("operator %d: %v", i, err)
		}
	}
	entries, err := NewRelayDLQ(f.js, dlqStream, auditStream, auditStream+".entries").Audit(ctx, AuditFilter{})
	testenv.Must(t, err, "audit")
	if len(entries) != 1 {
		t.Fatalf("%d audit entries for one discarded record: %+v", len(entries), entries)
	}
	// Issue 27: the audit's EVENT column showed the record's own id.
	if entries[0].EventID != "evt-1" {
		t.Errorf("audit entry's event id = %q, want the dead-lettered event's, evt-1", entries[0].EventID)
	}
}
