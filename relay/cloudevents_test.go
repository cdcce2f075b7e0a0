package relay_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/binding/spec"
	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/router"
)

// natsSpecs maps CloudEvents attributes to NATS headers as the NATS
// protocol binding does in binary content mode: "ce-" + attribute name,
// and content-type for datacontenttype. NATS header names are
// case-sensitive, so the match is exact.
var natsSpecs = spec.WithPrefixMatchExact(ceHeaderName, "ce-")

func ceHeaderName(attribute string) string {
	if attribute == "datacontenttype" {
		return "content-type"
	}
	return "ce-" + attribute
}

// natsMessage adapts a stored NATS message to the SDK's binding.Message, so
// that binding.ToEvent, not our parser, decides what the relay's headers
// mean. (The SDK's own NATS protocol module is not on the module proxy
// here; this is the same mapping.)
type natsMessage struct {
	header  nats.Header
	data    []byte
	version spec.Version
}

func newNATSMessage(h nats.Header, data []byte) *natsMessage {
	return &natsMessage{header: h, data: data, version: natsSpecs.Version(h.Get(natsSpecs.PrefixedSpecVersionName()))}
}

func (m *natsMessage) ReadEncoding() binding.Encoding {
	if m.version != nil {
		return binding.EncodingBinary
	}
	return binding.EncodingUnknown
}

func (m *natsMessage) ReadStructured(context.Context, binding.StructuredWriter) error {
	return binding.ErrNotStructured
}

func (m *natsMessage) ReadBinary(ctx context.Context, w binding.BinaryWriter) error {
	if m.version == nil {
		return binding.ErrNotBinary
	}
	for k, v := range m.header {
		var err error
		if attr := m.version.Attribute(k); attr != nil {
			err = w.SetAttribute(attr, v[0])
		} else if ext, ok := strings.CutPrefix(k, "ce-"); ok {
			err = w.SetExtension(ext, v[0])
		}
		if err != nil {
			return err
		}
	}
	return w.SetData(bytes.NewReader(m.data))
}

// GetAttribute and GetExtension make natsMessage a
// binding.MessageMetadataReader, which the SDK requires of binary messages.
func (m *natsMessage) GetAttribute(k spec.Kind) (spec.Attribute, interface{}) {
	attr := m.version.AttributeFromKind(k)
	if attr == nil {
		return nil, nil
	}
	if v := m.header.Values(ceHeaderName(attr.Name())); len(v) > 0 {
		return attr, v[0]
	}
	return attr, nil
}

func (m *natsMessage) GetExtension(name string) interface{} {
	if v := m.header.Values("ce-" + name); len(v) > 0 {
		return v[0]
	}
	return nil
}

func (m *natsMessage) Finish(error) error { return nil }

// TestRelayCloudEvents relays outbox rows and a logical message of tables
// with cloudevents on, reads the stored messages with the CloudEvents Go
// SDK and checks every attribute against the row; the Outbox-* headers
// stay beside them.
func TestRelayCloudEvents(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	prefix := "evt_" + strings.ToLower(f.Stream[2:8])
	f.Cfg.Router.Tables[0].CloudEvents = router.CloudEventsConfig{Enabled: true}
	f.Cfg.Router.Messages = append(f.Cfg.Router.Messages, router.MessageConfig{
		Prefix:      prefix,
		Subject:     f.Cfg.Router.Tables[0].Subject,
		CloudEvents: router.CloudEventsConfig{Enabled: true, Source: "https://shop.example/orders"},
	})
	f.Setup(ctx)
	f.start(ctx)

	if _, err := f.DB.Pool.Exec(ctx, `
		INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, occurred_at) VALUES
		('3f2504e0-4f89-11d3-9a0c-0305e82c3301', 'registration', 'r/1', 1, 'RegistrationConfirmed', '{"seat": 12}', '2026-11-29 09:35:21.123456+00'),
		('3f2504e0-4f89-11d3-9a0c-0305e82c3302', '', 'r-2', 4, 'RegistrationCancelled', '{}', '2026-11-29 10:00:00+01')`); err != nil {
		t.Fatal(err)
	}
	if _, err := f.DB.Pool.Exec(ctx, "SELECT pg_logical_emit_message(true, $1, $2::text)", prefix,
		`{"event_id":"m1","aggregate_type":"order","aggregate_id":"o.1","aggregate_version":3,"event_type":"OrderPlaced","payload":{"total": 42},"occurred_at":"2026-11-29T09:35:21.5Z"}`); err != nil {
		t.Fatal(err)
	}
	f.WaitCount(ctx, f.Stream, 3, 30*time.Second)
	got := relaytest.ReadStream(ctx, t, f.JS, f.Stream)
	if len(got) != 3 {
		t.Fatalf("read %d events, want 3", len(got))
	}

	want := []struct {
		id, source, typ, subject, version, data string
		time                                    time.Time
	}{
		{"3f2504e0-4f89-11d3-9a0c-0305e82c3301", "/outbox-relay/public.outbox", "RegistrationConfirmed", "registration/r/1", "1", `{"seat": 12}`,
			time.Date(2026, 11, 29, 9, 35, 21, 123456000, time.UTC)},
		{"3f2504e0-4f89-11d3-9a0c-0305e82c3302", "/outbox-relay/public.outbox", "RegistrationCancelled", "outbox/r-2", "4", `{}`,
			time.Date(2026, 11, 29, 9, 0, 0, 0, time.UTC)},
		{"m1", "https://shop.example/orders", "OrderPlaced", "order/o.1", "3", `{"total": 42}`,
			time.Date(2026, 11, 29, 9, 35, 21, 500000000, time.UTC)},
	}
	for i, w := range want {
		m := got[i]
		ev, err := binding.ToEvent(ctx, newNATSMessage(m.Headers, m.Data))
		if err != nil {
			t.Fatalf("event %d: binding.ToEvent: %v (headers %v)", i, err, m.Headers)
		}
		if err := ev.Validate(); err != nil {
			t.Errorf("event %d: not a valid CloudEvent: %v", i, err)
		}
		if ev.SpecVersion() != event.CloudEventsVersionV1 || ev.ID() != w.id || ev.Source() != w.source || ev.Type() != w.typ ||
			ev.Subject() != w.subject || !ev.Time().Equal(w.time) || ev.DataContentType() != "application/json" ||
			ev.DataSchema() != "" || string(ev.Data()) != w.data {
			t.Errorf("event %d: %s, want %+v", i, ev, w)
		}
		if exts := ev.Extensions(); len(exts) != 2 || exts["aggregateversion"] != w.version || exts["aggregatetype"] != m.Event.AggregateType {
			t.Errorf("event %d: extensions %v, want only aggregateversion %s and aggregatetype %s", i, exts, w.version, m.Event.AggregateType)
		}
		// Beside, not instead: the Outbox-* contract and Nats-Msg-Id stay.
		if m.Headers[contract.MsgID][0] != w.id || m.Event.ID != w.id || m.Event.Type != w.typ || m.Headers[contract.ContentType][0] != contract.JSONContentType {
			t.Errorf("event %d: contract headers %v", i, m.Headers)
		}
	}
}
