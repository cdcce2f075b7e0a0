package router

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/outbox"
	"github.com/outbox-relay/outbox-relay/replication"
)

// syntheticRow is how the relay once routed a logical message: a row of
// a made-up relation with the default column names, the version formatted
// as text and occurred_at in PostgreSQL's ISO text, for Route to parse
// again. TestRouteEnvelopeMatchesSyntheticRow holds RouteEnvelope to the
// messages and errors that path gave.
func syntheticRow(prefix string, env *outbox.Envelope, lsn replication.LSN) *replication.Insert {
	rel := newRelation(0xFFFF0000, MessageSchema, prefix,
		"event_id", "aggregate_type", "aggregate_id", "aggregate_version", "event_type", "payload", "occurred_at")
	occurred := txt(env.OccurredAt.UTC().Format("2006-01-02 15:04:05.999999") + "+00")
	if env.OccurredAt.IsZero() || env.OccurredAt.Year() < 1 {
		occurred = null
	}
	return &replication.Insert{Relation: rel, LSN: lsn, Values: []replication.Value{
		txt(env.EventID), txt(env.AggregateType), txt(env.AggregateID), txt(fmt.Sprint(env.AggregateVersion)),
		txt(env.EventType), {Kind: replication.ValueText, Data: env.Payload}, occurred,
	}}
}

// messageRouter is a router for the message prefix of mc that also routes
// syntheticRow's relation with the prefix's rule, so the two paths can be
// compared; no configuration can map that relation.
func messageRouter(t testing.TB, mc MessageConfig, opts ...Option) *Router {
	t.Helper()
	r := mustNew(t, Config{Messages: []MessageConfig{mc}}, opts...)
	r.rules[relKey{MessageSchema, mc.Prefix}] = r.messages[mc.Prefix]
	return r
}

func TestRouteEnvelopeMatchesSyntheticRow(t *testing.T) {
	const prefix = "evt"
	base := outbox.Envelope{
		EventID: testEventID, AggregateType: "order", AggregateID: "o.1", AggregateVersion: 7,
		EventType: "OrderPlaced", Payload: json.RawMessage(`{"total": 42}`),
		OccurredAt: time.Date(2026, 11, 29, 9, 35, 21, 500_000_000, time.UTC),
	}
	configs := map[string]MessageConfig{
		"default":     {Prefix: prefix},
		"subject":     {Prefix: prefix, Subject: "m.{aggregate_type}.{event_type}.{aggregate_id}"},
		"constant":    {Prefix: prefix, AggregateType: "Fixed"},
		"cloudevents": {Prefix: prefix, CloudEvents: CloudEventsConfig{Enabled: true}},
	}
	for _, tc := range []struct {
		name string
		edit func(*outbox.Envelope)
	}{
		{"plain", func(*outbox.Envelope) {}},
		{"no aggregate type", func(e *outbox.Envelope) { e.AggregateType = "" }},
		{"empty aggregate id", func(e *outbox.Envelope) { e.AggregateID = "" }},
		{"no occurred_at", func(e *outbox.Envelope) { e.OccurredAt = time.Time{} }},
		{"nanoseconds and an offset", func(e *outbox.Envelope) {
			e.OccurredAt = time.Date(2026, 11, 29, 11, 35, 21, 123_456_789, time.FixedZone("", 2*3600))
		}},
		{"negative version", func(e *outbox.Envelope) { e.AggregateVersion = -3 }},
		{"control character in event type", func(e *outbox.Envelope) { e.EventType = "Order\nPlaced" }},
		{"control character in event id", func(e *outbox.Envelope) { e.EventID = "e\r1"; e.EventType = "" }},
		{"control character in aggregate type", func(e *outbox.Envelope) { e.AggregateType = "o\x00" }},
		{"subject too long", func(e *outbox.Envelope) { e.AggregateID = strings.Repeat("a", 300) }},
		{"too large", func(e *outbox.Envelope) {
			e.Payload = json.RawMessage(`"` + strings.Repeat("p", DefaultMaxPayload) + `"`)
		}},
	} {
		for cname, cfg := range configs {
			t.Run(tc.name+"/"+cname, func(t *testing.T) {
				r := messageRouter(t, cfg)
				env := base
				tc.edit(&env)
				msg := &replication.Message{Transactional: true, Prefix: prefix, LSN: 0x16B3748}
				want, wantErr := r.Route(syntheticRow(prefix, &env, msg.LSN), testCommit)
				got, err := r.RouteEnvelope(msg, &env, testCommit)
				if (err == nil) != (wantErr == nil) {
					t.Fatalf("RouteEnvelope error %v, the synthetic row's %v", err, wantErr)
				}
				if err != nil {
					var re, wre *RouteError
					if !errors.As(err, &re) || !errors.As(wantErr, &wre) || *re != *wre {
						t.Fatalf("RouteEnvelope error %#v, the synthetic row's %#v", err, wantErr)
					}
					return
				}
				if !reflect.DeepEqual(got, want) {
					t.Fatalf("RouteEnvelope:\n%+v\nthe synthetic row:\n%+v", got, want)
				}
			})
		}
	}
}

func TestRouteEnvelopeUnknownPrefix(t *testing.T) {
	r := mustNew(t, seedConfig())
	env := outbox.Envelope{EventID: "e", AggregateID: "a", EventType: "T", Payload: json.RawMessage(`{}`)}
	_, err := r.RouteEnvelope(&replication.Message{Transactional: true, Prefix: "nope"}, &env, testCommit)
	var re *RouteError
	if !errors.As(err, &re) || re.Class != ClassUnknownTable || re.Table != MessageSchema+".nope" || !errors.Is(err, ErrUnroutable) {
		t.Fatalf("RouteEnvelope = %v, want an unknown_table RouteError for %s.nope", err, MessageSchema)
	}
}

// Messages are their own configuration: a table in MessageSchema is
// refused, naming messages; a bad or repeated prefix is refused at its
// path; a configuration of messages only is valid.
func TestValidateMessages(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		path string
		hint string
	}{
		{"table in the message schema", Config{Tables: []TableConfig{{Table: MessageSchema + ".evt"}}}, "tables[0].table", "messages: [{prefix: evt}]"},
		{"prefix with a dot", Config{Messages: []MessageConfig{{Prefix: "a.b"}}}, "messages[0].prefix", "letters, digits, _ or -"},
		{"prefix twice", Config{Messages: []MessageConfig{{Prefix: "ev"}, {Prefix: "ev"}}}, "messages[1].prefix", "mapped twice"},
		{"subject", Config{Messages: []MessageConfig{{Prefix: "ev", Subject: "ev.{nope}"}}}, "messages[0].subject", "{nope}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			var ce *ConfigError
			if !errors.As(err, &ce) || ce.Path != tc.path || !strings.Contains(ce.Msg, tc.hint) {
				t.Fatalf("Validate = %v, want an error at %s saying %q", err, tc.path, tc.hint)
			}
		})
	}
	ok := Config{Messages: []MessageConfig{{Prefix: "evt", CloudEvents: CloudEventsConfig{Enabled: true}}}}
	if err := ok.Validate(); err != nil {
		t.Fatalf("messages only: %v", err)
	}
	if m := ok.Messages[0]; m.Subject != DefaultSubject || m.CloudEvents.Source != DefaultCloudEventsSourcePrefix+MessageTable("evt") {
		t.Fatalf("defaults not applied: %+v", m)
	}
	if got := ok.SubjectFilters(); len(got) != 1 {
		t.Fatalf("SubjectFilters of messages only = %v", got)
	}
}

// DeadLetterLogical keeps the emitted content and names the event when it
// is known.
func TestDeadLetterLogical(t *testing.T) {
	r := mustNew(t, Config{Messages: []MessageConfig{{Prefix: "evt"}}})
	msg := &replication.Message{Transactional: true, Prefix: "evt", Content: []byte(`{"event_id":"e-1"}`), LSN: 0x16B3748}
	env := &outbox.Envelope{EventID: "e-1"}
	dl := r.DeadLetterLogical(msg, env, testCommit, &RouteError{Class: ClassTooLarge, Reason: "too big"})
	if got := dl.Header.Get(contract.MsgID); got != "dlq:"+MessageSchema+".evt:event:e-1" {
		t.Fatalf("Nats-Msg-Id %q", got)
	}
	var body struct {
		Table string            `json:"table"`
		Row   map[string]string `json:"row"`
	}
	if err := json.Unmarshal(dl.Data, &body); err != nil || body.Table != MessageSchema+".evt" || body.Row["content"] != string(msg.Content) {
		t.Fatalf("record %s (%v)", dl.Data, err)
	}
	dl = r.DeadLetterLogical(msg, nil, testCommit, errors.New("non-transactional"))
	if got := dl.Header.Get(contract.MsgID); got != "dlq:"+MessageSchema+".evt:0/16B3748" {
		t.Fatalf("Nats-Msg-Id without an envelope %q", got)
	}
}

// FuzzRouteEnvelope: RouteEnvelope never panics and agrees with the
// synthetic row the relay used to route: the same message, or an error of
// the same class on the same field.
func FuzzRouteEnvelope(f *testing.F) {
	f.Add(testEventID, "", "r-1", int64(7), "RegistrationConfirmed", testPayload, int64(1796117721123456789), int32(0))
	f.Add("e", "T.x", "", int64(-1), "E", "", int64(0), int32(-12600))
	f.Add("e\n", "~", "a b", int64(1<<62), " E", "{}", int64(-9_000_000_000_000_000_000), int32(3600))
	r := messageRouter(f, MessageConfig{Prefix: "evt", Subject: "m.{aggregate_type}.{event_type}.x{aggregate_id}", CloudEvents: CloudEventsConfig{Enabled: true}},
		WithMaxPayload(MinMaxPayload))
	f.Fuzz(func(t *testing.T, eventID, aggType, aggID string, version int64, eventType, payload string, unixNano int64, offset int32) {
		env := outbox.Envelope{
			EventID: eventID, AggregateType: aggType, AggregateID: aggID, AggregateVersion: version,
			EventType: eventType, Payload: json.RawMessage(payload),
			OccurredAt: time.Unix(0, unixNano).In(time.FixedZone("", int(offset%86400))),
		}
		msg := &replication.Message{Transactional: true, Prefix: "evt", LSN: 1}
		want, wantErr := r.Route(syntheticRow("evt", &env, msg.LSN), testCommit)
		got, err := r.RouteEnvelope(msg, &env, testCommit)
		if (err == nil) != (wantErr == nil) {
			t.Fatalf("RouteEnvelope error %v, the synthetic row's %v", err, wantErr)
		}
		if err != nil {
			var re, wre *RouteError
			if !errors.As(err, &re) || !errors.As(wantErr, &wre) || re.Class != wre.Class || re.Column != wre.Column || re.EventID != wre.EventID {
				t.Fatalf("RouteEnvelope error %#v, the synthetic row's %#v", err, wantErr)
			}
			return
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("RouteEnvelope:\n%+v\nthe synthetic row:\n%+v", got, want)
		}
	})
}
