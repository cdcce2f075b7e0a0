package router

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/outbox"
	"github.com/outbox-relay/outbox-relay/replication"
)

func BenchmarkRoute(b *testing.B) {
	for _, bc := range []struct {
		name string
		cfg  Config
	}{
		{"seed", seedConfig()},
		{"extra_headers", Config{Tables: []TableConfig{{Table: "outbox", Headers: map[string]string{"publish_state": ""}}}}},
		{"cloudevents", Config{Tables: []TableConfig{{Table: "outbox", CloudEvents: CloudEventsConfig{Enabled: true}}}}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			r := mustNew(b, bc.cfg)
			ins := newInsert(newRelation(1, "public", "outbox", seedColumns...), seedRow())
			b.ReportAllocs()
			b.SetBytes(int64(len(testPayload)))
			for b.Loop() {
				if _, err := r.Route(ins, testCommit); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkDeadLetter(b *testing.B) {
	r := mustNew(b, seedConfig())
	row := seedRow()
	row["payload"] = txt(strings.Repeat("p", 2<<20))
	ins := newInsert(newRelation(1, "public", "outbox", seedColumns...), row)
	_, err := r.Route(ins, testCommit)
	b.ReportAllocs()
	for b.Loop() {
		r.DeadLetter(ins, testCommit, err)
	}
}

func BenchmarkEscapeToken(b *testing.B) {
	for _, bc := range []struct{ name, in string }{
		{"uuid_unchanged", testEventID},
		{"dotted", "order.2026.11.29/42"},
		{"utf8", "Zürich-Straße-日本"},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(bc.in)))
			for b.Loop() {
				_ = EscapeToken(bc.in)
			}
		})
	}
}

// BenchmarkRouteEnvelope routes a parsed logical-message envelope, and for
// comparison the synthetic row the relay used to build from it (the
// version and occurred_at formatted as text, then parsed again by Route).
func BenchmarkRouteEnvelope(b *testing.B) {
	env := outbox.Envelope{
		EventID: testEventID, AggregateID: "r-1", AggregateVersion: 7, EventType: "RegistrationConfirmed",
		Payload: json.RawMessage(testPayload), OccurredAt: time.Date(2026, 11, 29, 9, 35, 21, 123456000, time.UTC),
	}
	msg := &replication.Message{Transactional: true, Prefix: "evt", LSN: 0x16B3748}
	// messageRouter also routes syntheticRow's relation, which no
	// configuration can map.
	r := messageRouter(b, MessageConfig{Prefix: "evt"})
	b.Run("envelope", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := r.RouteEnvelope(msg, &env, testCommit); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("synthetic_row", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := r.Route(syntheticRow("evt", &env, msg.LSN), testCommit); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestRouteAllocs pins the allocations per routed row: the message with its
// headers, the string its parts share, the payload's copy (bench/README.md,
// issue 28: allocation per event is a drain cost; no header map any more).
func TestRouteAllocs(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		max  float64
	}{
		{"seed", seedConfig(), 3},
		{"extra_headers", Config{Tables: []TableConfig{{Table: "outbox", Headers: map[string]string{"publish_state": ""}}}}, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := mustNew(t, tc.cfg)
			ins := newInsert(newRelation(1, "public", "outbox", seedColumns...), seedRow())
			var err error
			got := testing.AllocsPerRun(200, func() { _, err = r.Route(ins, testCommit) })
			if err != nil {
				t.Fatal(err)
			}
			if got > tc.max {
				t.Errorf("Route: %.0f allocations per row, want ≤ %.0f", got, tc.max)
			}
		})
	}
}
