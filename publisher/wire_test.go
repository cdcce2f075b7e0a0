package publisher_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

const (
	wireEventID     = "3f2504e0-4f89-11d3-9a0c-0305e82c3301"
	wireTraceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
)

// wireRows routes the representative messages of the wire test: an event
// with a mapped extra column, trace context and CloudEvents headers; the
// same table's event without occurred_at and trace context (fewer
// headers); a plain seed-table event; and a dead-letter record (other
// names). Each comes with the headers the relay put on the wire before
// headers left nats.Header maps (the router's map, as its tests pin it).
func wireRows(t *testing.T) (msgs []*router.Message, want []nats.Header) {
	t.Helper()
	cols := []string{"event_id", "aggregate_type", "aggregate_id", "aggregate_version", "event_type", "payload", "occurred_at", "publish_state", "traceparent"}
	rel := &replication.Relation{ID: 1, Namespace: "public", Name: "outbox"}
	for _, c := range cols {
		rel.Columns = append(rel.Columns, replication.Column{Name: c, TypeOID: 25})
	}
	row := func(occurred, traceparent string) *replication.Insert {
		vals := []string{wireEventID, "registration", "r-1", "7", "RegistrationConfirmed", `{"a": 1}`, occurred, "PENDING", traceparent}
		ins := &replication.Insert{Relation: rel, LSN: 0x16B3748}
		for _, v := range vals {
			if v == "" {
				ins.Values = append(ins.Values, replication.Value{Kind: replication.ValueNull})
				continue
			}
			ins.Values = append(ins.Values, replication.Value{Kind: replication.ValueText, Data: []byte(v)})
		}
		return ins
	}
	commit := router.CommitInfo{LSN: 0x16B37A0, Time: time.Date(2026, 11, 29, 9, 35, 22, 500_000_000, time.UTC)}
	ce, err := router.New(router.Config{Tables: []router.TableConfig{{Table: "outbox", Subject: "bt.ev.{aggregate_type}.{aggregate_id}",
		Headers: map[string]string{"publish_state": "Publish-State"}, CloudEvents: router.CloudEventsConfig{Enabled: true}}}})
	if err != nil {
		t.Fatal(err)
	}
	plain, err := router.New(router.Config{Tables: []router.TableConfig{{Table: "outbox", Subject: "bt.ev.{aggregate_type}.{aggregate_id}"}}, DeadLetterSubject: "bt.dlq"})
	if err != nil {
		t.Fatal(err)
	}
	route := func(r *router.Router, ins *replication.Insert) *router.Message {
		m, err := r.Route(ins, commit)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	event := nats.Header{
		contract.MsgID: {wireEventID}, contract.EventID: {wireEventID},
		contract.EventType: {"RegistrationConfirmed"}, contract.AggregateType: {"registration"},
		contract.AggregateID: {"r-1"}, contract.AggregateVersion: {"7"},
		contract.CommitLSN: {"0/16B37A0"}, contract.CommitTime: {"2026-11-29T09:35:22.5Z"},
		contract.Table: {"public.outbox"}, contract.ContentType: {"application/json"},
	}
	with := func(h nats.Header, kv ...string) nats.Header {
		out := nats.Header{}
		for k, v := range h {
			out[k] = v
		}
		for i := 0; i < len(kv); i += 2 {
			out[kv[i]] = []string{kv[i+1]}
		}
		return out
	}
	ceHeaders := []string{
		contract.CESpecVersion, "1.0", contract.CEID, wireEventID, contract.CESource, "/outbox-relay/public.outbox",
		contract.CEType, "RegistrationConfirmed", contract.CESubject, "registration/r-1", contract.CEAggregateVersion, "7",
		contract.CEAggregateType, "registration", contract.CEContentType, "application/json", "Publish-State", "PENDING",
	}
	full := with(event, append(ceHeaders, contract.OccurredAt, "2026-11-29T09:35:21.123456Z",
		contract.CETime, "2026-11-29T09:35:21.123456Z", router.TraceparentHeader, wireTraceparent)...)
	seed := route(plain, row("2026-11-29 09:35:21.123456+00", ""))
	dl := plain.DeadLetterMessage(seed, errors.New("rejected\r\nfor good"))
	msgs = []*router.Message{
		route(ce, row("2026-11-29 09:35:21.123456+00", wireTraceparent)),
		route(ce, row("", "")),
		seed,
		dl,
	}
	want = []nats.Header{
		full,
		with(event, ceHeaders...),
		with(event, contract.OccurredAt, "2026-11-29T09:35:21.123456Z", contract.AggregateType, "registration"),
		dl.Header.NATS(), // its own names, for the reused header's rebuild
	}
	return msgs, want
}

// TestWireHeadersAsRouted publishes routed messages whose header names
// differ from one to the next, through the per-key publisher and the
// batch publisher (each encodes through one reused nats.Header), and reads
// every message as the server delivers it: each carries exactly its own
// headers, the ones the router's header map used to carry, with nothing
// left over from the message before.
func TestWireHeadersAsRouted(t *testing.T) {
	msgs, wants := wireRows(t)
	f := newBatchFixture(t, batchStream("B"), publisher.Config{})
	sub, err := f.nc.SubscribeSync("bt.>")
	if err != nil {
		t.Fatal(err)
	}
	if err := f.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const rounds = 3
	want := map[string]nats.Header{} // by payload
	n := 0
	for round := range rounds {
		for i, rm := range msgs {
			// A fresh Nats-Msg-Id and payload per send: the stream stores
			// each, and the payload names the message received.
			id := fmt.Sprintf("%s-%d", rm.Header.Get(contract.MsgID), n)
			h := slices.Clone(rm.Header)
			for j := range h {
				if h[j].Name == contract.MsgID {
					h[j].Value = id
				}
			}
			w := maps.Clone(wants[i])
			w[contract.MsgID] = []string{id}
			data := strconv.Itoa(n)
			want[data] = w
			n++
			m := &publisher.Message{Subject: rm.Subject, Header: h, Data: []byte(data), Key: rm.Key}
			if (round+i)%2 == 0 {
				if err := f.keyed.Publish(ctx, m); err != nil {
					t.Fatal(err)
				}
				continue
			}
			for ok := false; !ok; {
				if ok, err = f.b.TryPublish(m); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	for len(want) > 0 {
		got, err := sub.NextMsg(10 * time.Second)
		if err != nil {
			t.Fatalf("%d messages not received: %v", len(want), err)
		}
		w, ok := want[string(got.Data)]
		if !ok {
			continue // a batch's commit, or a resend
		}
		delete(want, string(got.Data))
		if !reflect.DeepEqual(got.Header, w) {
			t.Errorf("message %s on %s: headers on the wire\n%v\nwant\n%v", got.Data, got.Subject, got.Header, w)
		}
	}
	f.drain(ctx)
}
