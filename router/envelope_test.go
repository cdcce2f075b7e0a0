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

// syntheticRow is how the relay used to route a logical message: a row of
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

func TestRouteEnvelopeMatchesSyntheticRow(t *testing.T) {
	const prefix = "evt"
	base := outbox.Envelope{
		EventID: testEventID, AggregateType: "order", AggregateID: "o.1", AggregateVersion: 7,
		EventType: "OrderPlaced", Payload: json.RawMessage(`{"total": 42}`),
		OccurredAt: time.Date(2026, 11, 29, 9, 35, 21, 500_000_000, time.UTC),
	}
	configs := map[string]TableConfig{
		"default":     {Table: MessageSchema + "." + prefix},
		"subject":     {Table: MessageSchema + "." + prefix, Subject: "m.{aggregate_type}.{event_type}.{aggregate_id}"},
		"constant":    {Table: MessageSchema + "." + prefix, AggregateType: "Fixed"},
		"cloudevents": {Table: MessageSchema + "." + prefix, CloudEvents: CloudEventsConfig{Enabled: true}},
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
				r := mustNew(t, Config{Tables: []TableConfig{cfg}})
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

// A logical-message table has no columns: renaming or mapping them is a
// configuration error, not a dead letter per message.
func TestValidateMessageTableColumns(t *testing.T) {
	for _, tc := range []struct {
		name string
		tc   TableConfig
		path string
	}{
		{"columns", TableConfig{Columns: ColumnsConfig{EventID: "id"}}, "tables[0].columns"},
		{"optional column", TableConfig{Columns: ColumnsConfig{OccurredAt: "at"}}, "tables[0].columns"},
		{"headers", TableConfig{Headers: map[string]string{"event_type": "X-Type"}}, "tables[0].headers"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.tc.Table = MessageSchema + ".evt"
			cfg := Config{Tables: []TableConfig{tc.tc}}
			err := cfg.Validate()
			var ce *ConfigError
			if !errors.As(err, &ce) || ce.Path != tc.path {
				t.Fatalf("Validate = %v, want an error at %s", err, tc.path)
			}
		})
	}
	ok := Config{Tables: []TableConfig{{Table: MessageSchema + ".evt", Columns: ColumnsConfig{EventID: DefaultEventIDColumn, OccurredAt: DefaultOccurredAtColumn}}}}
	if err := ok.Validate(); err != nil {
		t.Fatalf("default column names: %v", err)
	}
}

// DeadLetterLogical keeps the emitted content and names the event when it
// is known.
func TestDeadLetterLogical(t *testing.T) {
	r := mustNew(t, Config{Tables: []TableConfig{{Table: MessageSchema + ".evt"}}})
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
	r := mustNew(f, Config{Tables: []TableConfig{{Table: MessageSchema + ".evt", Subject: "m.{aggregate_type}.{event_type}.x{aggregate_id}", CloudEvents: CloudEventsConfig{Enabled: true}}}},
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
