package contract

import (
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// TestParseCloudEvents: a message with only ce-* headers parses into the
// same Event fields as the Outbox-* form, and a message with both is read
// from its Outbox-* headers.
func TestParseCloudEvents(t *testing.T) {
	ceOnly := func() nats.Header {
		return nats.Header{
			MsgID:              {"e1"},
			CESpecVersion:      {"1.0"},
			CEID:               {"e1"},
			CESource:           {"/outbox-relay/public.outbox"},
			CEType:             {"RegistrationConfirmed"},
			CESubject:          {"registration/r-1/a"},
			CEAggregateVersion: {"7"},
			CETime:             {"2026-11-29T09:35:21.123456Z"},
			CEContentType:      {JSONContentType},
		}
	}
	want := Event{
		ID: "e1", Type: "RegistrationConfirmed", AggregateType: "registration", AggregateID: "r-1/a",
		AggregateVersion: 7, OccurredAt: time.Date(2026, 11, 29, 9, 35, 21, 123456000, time.UTC),
	}
	tests := []struct {
		name    string
		edit    func(nats.Header)
		want    func(*Event)
		wantErr string // header named in the error, "" for success
	}{
		{name: "ce only"},
		{name: "no ce-time", edit: func(h nats.Header) { h.Del(CETime) }, want: func(e *Event) { e.OccurredAt = time.Time{} }},
		{name: "empty aggregate id", edit: func(h nats.Header) { h.Set(CESubject, "registration/") }, want: func(e *Event) { e.AggregateID = "" }},
		{name: "both forms: Outbox-* win", edit: func(h nats.Header) {
			h.Set(EventID, "e1")
			h.Set(EventType, "Outboxed")
			h.Set(AggregateType, "order")
			h.Set(AggregateID, "o-9")
			h.Set(AggregateVersion, "3")
			h.Set(CommitLSN, "0/16B37A0")
		}, want: func(e *Event) {
			e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion, e.OccurredAt, e.CommitLSN = "Outboxed", "order", "o-9", 3, time.Time{}, "0/16B37A0"
		}},
		// Issue 23: the type holds a '/'; the relay's ce-aggregatetype
		// says where it ends, so the key is its Outbox-* twin's.
		{name: "type with a slash", edit: func(h nats.Header) {
			h.Set(CESubject, "billing/invoice/r-1/a")
			h.Set(CEAggregateType, "billing/invoice")
		}, want: func(e *Event) { e.AggregateType = "billing/invoice" }},
		// Issue 23: an untyped aggregate ("/id") was refused for good
		// (a dead letter) although its Outbox-* twin is accepted.
		{name: "untyped aggregate", edit: func(h nats.Header) { h.Set(CESubject, "/r-1/a") }, want: func(e *Event) { e.AggregateType = "" }},
		{name: "untyped aggregate, typed header", edit: func(h nats.Header) {
			h.Set(CESubject, "/r-1/a")
			h.Set(CEAggregateType, "")
		}, want: func(e *Event) { e.AggregateType = "" }},
		{name: "subject not of its aggregatetype", edit: func(h nats.Header) { h.Set(CEAggregateType, "order") }, wantErr: CESubject},
		{name: "other spec version", edit: func(h nats.Header) { h.Set(CESpecVersion, "0.3") }, wantErr: CESpecVersion},
		{name: "no type", edit: func(h nats.Header) { h.Del(CEType) }, wantErr: CEType},
		{name: "no subject", edit: func(h nats.Header) { h.Del(CESubject) }, wantErr: CESubject},
		{name: "subject without slash", edit: func(h nats.Header) { h.Set(CESubject, "r-1") }, wantErr: CESubject},
		{name: "no version", edit: func(h nats.Header) { h.Del(CEAggregateVersion) }, wantErr: CEAggregateVersion},
		{name: "bad version", edit: func(h nats.Header) { h.Set(CEAggregateVersion, "x") }, wantErr: CEAggregateVersion},
		{name: "bad time", edit: func(h nats.Header) { h.Set(CETime, "now") }, wantErr: CETime},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := ceOnly()
			if tt.edit != nil {
				tt.edit(h)
			}
			ev, err := Parse(h, []byte(`{}`))
			if tt.wantErr != "" {
				var fe *FieldError
				if !errors.As(err, &fe) || fe.Header != tt.wantErr || !errors.Is(err, ErrInvalidEvent) {
					t.Fatalf("Parse error = %v, want a FieldError for %s", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			w := want
			w.Payload = ev.Payload
			if tt.want != nil {
				tt.want(&w)
			}
			if !ev.OccurredAt.Equal(w.OccurredAt) {
				t.Fatalf("OccurredAt = %v, want %v", ev.OccurredAt, w.OccurredAt)
			}
			ev.OccurredAt, w.OccurredAt = time.Time{}, time.Time{}
			if ev.ID != w.ID || ev.Type != w.Type || ev.AggregateType != w.AggregateType || ev.AggregateID != w.AggregateID ||
				ev.AggregateVersion != w.AggregateVersion || ev.CommitLSN != w.CommitLSN {
				t.Fatalf("Parse = %+v, want %+v", ev, w)
			}
		})
	}
}

// FuzzParseCloudEvents: any ce-* header values either parse into an event
// whose aggregate rebuilds ce-subject, or fail with a FieldError; never a
// panic.
func FuzzParseCloudEvents(f *testing.F) {
	f.Add("e1", "T", "registration/r-1", "7", "2026-11-29T09:35:21Z")
	f.Add("e1", "T", "/", "-1", "")
	f.Add("", "", "", "", "x")
	f.Fuzz(func(t *testing.T, id, typ, subject, version, ts string) {
		h := nats.Header{CESpecVersion: {"1.0"}, CEID: {id}, CEType: {typ}, CESubject: {subject}, CEAggregateVersion: {version}, CETime: {ts}}
		ev, err := Parse(h, nil)
		if err != nil {
			var fe *FieldError
			if !errors.As(err, &fe) {
				t.Fatalf("error %v is not a FieldError", err)
			}
			return
		}
		if CESubjectOf(ev.AggregateType, ev.AggregateID) != subject || ev.ID != id || ev.Type != typ {
			t.Fatalf("Parse(%q) = %+v", subject, ev)
		}
	})
}
