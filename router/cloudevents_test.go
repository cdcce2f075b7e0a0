package router

import (
	"errors"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/replication"
)

// TestRouteCloudEvents checks the CloudEvents binary-mode headers: beside
// the Outbox-* contract, with a default or configured source, without
// ce-time when the row has no occurred_at, and a HeaderLen that matches
// what nats.go encodes (the header-size checks rely on it).
func TestRouteCloudEvents(t *testing.T) {
	base := func() nats.Header {
		return nats.Header{
			contract.MsgID:            {testEventID},
			contract.EventID:          {testEventID},
			contract.EventType:        {"RegistrationConfirmed"},
			contract.AggregateType:    {"registration"},
			contract.AggregateID:      {"r-1"},
			contract.AggregateVersion: {"7"},
			contract.OccurredAt:       {"2026-11-29T09:35:21.123456Z"},
			contract.CommitLSN:        {"0/16B37A0"},
			contract.CommitTime:       {"2026-11-29T09:35:22.5Z"},
			contract.Table:            {"public.outbox"},
			contract.ContentType:      {"application/json"},
		}
	}
	withCE := func(source string, h nats.Header) nats.Header {
		h[contract.CESpecVersion] = []string{"1.0"}
		h[contract.CEID] = []string{testEventID}
		h[contract.CESource] = []string{source}
		h[contract.CEType] = []string{"RegistrationConfirmed"}
		h[contract.CESubject] = []string{"registration/r-1"}
		h[contract.CEContentType] = []string{"application/json"}
		h[contract.CEAggregateVersion] = []string{"7"}
		h[contract.CEAggregateType] = []string{"registration"}
		if v, ok := h[contract.OccurredAt]; ok {
			h[contract.CETime] = v
		}
		return h
	}
	for _, tc := range []struct {
		name string
		ce   CloudEventsConfig
		edit func(map[string]replication.Value)
		want nats.Header
	}{
		{name: "off", want: base()},
		{name: "default source", ce: CloudEventsConfig{Enabled: true},
			want: withCE("/outbox-relay/public.outbox", base())},
		{name: "configured source", ce: CloudEventsConfig{Enabled: true, Source: "https://shop.example/outbox"},
			want: withCE("https://shop.example/outbox", base())},
		{name: "no occurred_at: no ce-time", ce: CloudEventsConfig{Enabled: true},
			edit: func(row map[string]replication.Value) { row["occurred_at"] = null },
			want: func() nats.Header {
				h := base()
				delete(h, contract.OccurredAt)
				return withCE("/outbox-relay/public.outbox", h)
			}()},
		{name: "aggregate id with a slash", ce: CloudEventsConfig{Enabled: true},
			edit: func(row map[string]replication.Value) { row["aggregate_id"] = txt("a/b") },
			want: func() nats.Header {
				h := withCE("/outbox-relay/public.outbox", base())
				h[contract.AggregateID] = []string{"a/b"}
				h[contract.CESubject] = []string{"registration/a/b"}
				return h
			}()},
		// Issue 23: ce-aggregatetype tells a consumer reading ce-* only
		// where the type ends.
		{name: "aggregate type with a slash", ce: CloudEventsConfig{Enabled: true},
			edit: func(row map[string]replication.Value) { row["aggregate_type"] = txt("billing/invoice") },
			want: func() nats.Header {
				h := withCE("/outbox-relay/public.outbox", base())
				h[contract.AggregateType] = []string{"billing/invoice"}
				h[contract.CEAggregateType] = []string{"billing/invoice"}
				h[contract.CESubject] = []string{"billing/invoice/r-1"}
				return h
			}()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := mustNew(t, Config{Tables: []TableConfig{{Table: "outbox", CloudEvents: tc.ce}}})
			rel := newRelation(1, "public", "outbox", seedColumns...)
			row := seedRow()
			row["aggregate_type"] = txt("registration")
			if tc.edit != nil {
				tc.edit(row)
			}
			routeTwice(t, r, newInsert(rel, row), tc.want)
		})
	}
}

// TestRouteCloudEventsHeaderLimit: the ce-* copies of the event type count
// against JetStream's header limit, so a row under it without CloudEvents
// can be over it with them, and is dead-lettered rather than refused by the
// broker.
func TestRouteCloudEventsHeaderLimit(t *testing.T) {
	row := seedRow()
	row["event_type"] = txt(strings.Repeat("T", MaxHeaderBytes/2-200))
	rel := newRelation(1, "public", "outbox", seedColumns...)
	plain := mustNew(t, Config{Tables: []TableConfig{{Table: "outbox"}}}, WithMaxPayload(1<<20))
	if _, err := plain.Route(newInsert(rel, row), testCommit); err != nil {
		t.Fatalf("without CloudEvents: %v", err)
	}
	ce := mustNew(t, Config{Tables: []TableConfig{{Table: "outbox", CloudEvents: CloudEventsConfig{Enabled: true}}}}, WithMaxPayload(1<<20))
	_, err := ce.Route(newInsert(rel, row), testCommit)
	var re *RouteError
	if !errors.As(err, &re) || re.Class != ClassHeaderTooLarge {
		t.Fatalf("with CloudEvents: %v, want class %s", err, ClassHeaderTooLarge)
	}
}

func TestCloudEventsConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		tc   TableConfig
		path string
	}{
		{"source without enabled", TableConfig{Table: "outbox", CloudEvents: CloudEventsConfig{Source: "/x"}}, "tables[0].cloudevents.source"},
		{"source with a line break", TableConfig{Table: "outbox", CloudEvents: CloudEventsConfig{Enabled: true, Source: "/x\n"}}, "tables[0].cloudevents.source"},
		{"source not a URI", TableConfig{Table: "outbox", CloudEvents: CloudEventsConfig{Enabled: true, Source: "%zz"}}, "tables[0].cloudevents.source"},
		{"extra column on a ce header", TableConfig{Table: "outbox", CloudEvents: CloudEventsConfig{Enabled: true},
			Headers: map[string]string{"publish_state": "CE-Source"}}, "tables[0].headers.publish_state"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{Tables: []TableConfig{tc.tc}}
			err := cfg.Validate()
			var ce *ConfigError
			if !errors.As(err, &ce) || ce.Path != tc.path {
				t.Fatalf("Validate = %v, want an error at %s", err, tc.path)
			}
		})
	}
}
