package consumer

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// ceOnly turns a message of the Outbox-* form into one with CloudEvents
// binary-mode headers alone, as a CloudEvents tool forwarding the relay's
// events might store it.
func ceOnly(m *nats.Msg, e event, occurred time.Time) *nats.Msg {
	for k := range m.Header {
		if strings.HasPrefix(k, "Outbox-") || k == contract.ContentType {
			delete(m.Header, k)
		}
	}
	m.Header[contract.CESpecVersion] = []string{contract.CESpecVersionValue}
	m.Header[contract.CEID] = []string{e.ID}
	m.Header[contract.CESource] = []string{"/outbox-relay/public.outbox"}
	m.Header[contract.CEType] = []string{"RegistrationConfirmed"}
	m.Header[contract.CESubject] = []string{"registration/" + e.AggID}
	m.Header[contract.CEAggregateVersion] = []string{strconv.FormatInt(e.Version, 10)}
	m.Header[contract.CETime] = []string{occurred.Format(time.RFC3339Nano)}
	m.Header[contract.CEContentType] = []string{contract.JSONContentType}
	return m
}

// TestCloudEventsOnlyMessageIsApplied: messages carrying only ce-* headers
// are applied in version order between Outbox-* ones, with the same Message
// fields; the same event in the other form is recognised as a duplicate
// (one content hash for both forms).
func TestCloudEventsOnlyMessageIsApplied(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	cfg := f.baseConfig("ce")
	cfg.VersionCheck = true
	cfg.GapWait = cfg.RetryMax + cfg.AckWait
	var mu sync.Mutex
	seen := map[string]Message{}
	r := newRecorder("ce")
	f.start(cfg, HandlerFunc(func(ctx context.Context, tx pgx.Tx, m *Message) error {
		mu.Lock()
		seen[m.ID] = *m
		mu.Unlock()
		return r.Handle(ctx, tx, m)
	}))
	occurred := time.Date(2026, 11, 29, 9, 35, 21, 123456000, time.UTC)
	evs := []event{{ID: uuidN(1), AggID: "r/1", Version: 1}, {ID: uuidN(2), AggID: "r/1", Version: 2}, {ID: uuidN(3), AggID: "r/1", Version: 3}}
	ctx := context.Background()
	for i, e := range evs {
		m := e.msg(f.stream)
		if i > 0 {
			m = ceOnly(m, e, occurred)
		}
		_, err := f.js.PublishMsg(ctx, m)
		testenv.Must(t, err, "publish")
	}
	// Version 2 again, in the Outbox-* form and under another Nats-Msg-Id.
	dup := evs[1]
	dup.MsgID = dup.ID + "/again"
	f.publish(dup)
	f.waitSettled("ce", 15*time.Second)

	if got := appliedVersions(t, f, "ce", "r/1"); len(got) != 3 || got[0] != 1 || got[1] != 2 || got[2] != 3 {
		t.Fatalf("applied versions %v, want [1 2 3]", got)
	}
	if n := r.callCount(uuidN(2)); n != 1 {
		t.Fatalf("handler called %d times for version 2, want 1", n)
	}
	mu.Lock()
	m := seen[uuidN(3)]
	mu.Unlock()
	if m.Type != "RegistrationConfirmed" || m.AggregateType != "registration" || m.AggregateID != "r/1" ||
		m.AggregateVersion != 3 || !m.OccurredAt.Equal(occurred) || m.Header.Get(contract.CESource) != "/outbox-relay/public.outbox" {
		t.Fatalf("ce-only message = %+v", m)
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'ce'`); n != 0 {
		t.Fatalf("%d dead letters", n)
	}
}
