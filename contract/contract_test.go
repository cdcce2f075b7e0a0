package contract

import (
	"errors"
	"testing"

	"github.com/nats-io/nats.go"
)

func TestParse(t *testing.T) {
	full := func() nats.Header {
		return nats.Header{
			MsgID:            {"e1"},
			EventID:          {"e1"},
			EventType:        {"RegistrationConfirmed"},
			AggregateType:    {"registration"},
			AggregateID:      {"r-1"},
			AggregateVersion: {"7"},
			OccurredAt:       {"2026-11-29T09:35:21.123456Z"},
			CommitTime:       {"2026-11-29T09:35:22Z"},
		}
	}
	tests := []struct {
		name    string
		edit    func(nats.Header)
		wantErr string // header named in the error, "" for success
	}{
		{"complete", func(nats.Header) {}, ""},
		{"empty aggregate id is legal", func(h nats.Header) { h.Set(AggregateID, "") }, ""},
		{"id from Nats-Msg-Id", func(h nats.Header) { h.Del(EventID) }, ""},
		{"no id", func(h nats.Header) { h.Del(EventID); h.Del(MsgID) }, EventID},
		{"no type", func(h nats.Header) { h.Del(EventType) }, EventType},
		{"no aggregate id", func(h nats.Header) { h.Del(AggregateID) }, AggregateID},
		{"no version", func(h nats.Header) { h.Del(AggregateVersion) }, AggregateVersion},
		{"bad version", func(h nats.Header) { h.Set(AggregateVersion, "7.5") }, AggregateVersion},
		{"bad occurred at", func(h nats.Header) { h.Set(OccurredAt, "yesterday") }, OccurredAt},
		{"bad commit time", func(h nats.Header) { h.Set(CommitTime, "now") }, CommitTime},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := full()
			tt.edit(h)
			ev, err := Parse(h, []byte(`{}`))
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("Parse: %v", err)
				}
				if ev.ID != "e1" || ev.AggregateVersion != 7 {
					t.Fatalf("Parse = %+v", ev)
				}
				return
			}
			var fe *FieldError
			if !errors.As(err, &fe) || fe.Header != tt.wantErr || !errors.Is(err, ErrInvalidEvent) {
				t.Fatalf("Parse error = %v, want a FieldError for %s", err, tt.wantErr)
			}
		})
	}
}
