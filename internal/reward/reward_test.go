package reward

import (
	"fmt"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/consumer"
)

const (
	registration = "6f1c1f7e-8a7b-4c5d-9e0f-1a2b3c4d5e6f"
	unmapped     = "0b7e8f6a-3c1d-4a8e-9a57-2f4e9d1c6b3a"
)

func TestParseConfirmed(t *testing.T) {
	msg := func(payload string, agg string, version int64) *consumer.Message {
		m := &consumer.Message{}
		m.Payload, m.AggregateID, m.AggregateVersion = []byte(payload), agg, version
		return m
	}
	ok := fmt.Sprintf(`{"registrationId": %q, "version": 3}`, registration)
	for _, tc := range []struct {
		name string
		m    *consumer.Message
		err  string
	}{
		{"valid", msg(ok, registration, 3), ""},
		{"upper-case aggregate id", msg(ok, strings.ToUpper(registration), 3), ""},
		{"not json", msg(`{`, registration, 3), "payload is not"},
		{"no id", msg(`{"version": 3}`, registration, 3), "lacks registrationId"},
		{"no version", msg(fmt.Sprintf(`{"registrationId": %q}`, registration), registration, 3), "lacks version"},
		{"bad uuid", msg(`{"registrationId": "x", "version": 3}`, "x", 3), "not a UUID"},
		{"other aggregate", msg(ok, unmapped, 3), "does not match the event's aggregate id"},
		{"other version", msg(ok, registration, 4), "does not match the event's aggregate version"},
	} {
		_, err := parseConfirmed(tc.m)
		switch {
		case tc.err == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("%s: err %v, want %q", tc.name, err, tc.err)
		}
	}
}
