package router

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/replication"
)

// seedColumns are sql/outbox.sql's columns, in table order.
var seedColumns = []string{
	"event_id", "aggregate_type", "aggregate_id", "aggregate_version",
	"event_type", "payload", "occurred_at", "publish_state",
}

const (
	testEventID = "3f2504e0-4f89-11d3-9a0c-0305e82c3301"
	testPayload = `{"version": 7, "registrationId": "3f2504e0-4f89-11d3-9a0c-0305e82c3301"}`
)

var testCommit = CommitInfo{
	LSN:  replication.LSN(0x16B37A0),
	Time: time.Date(2026, 11, 29, 9, 35, 22, 500_000_000, time.UTC),
}

func newRelation(id uint32, schema, name string, cols ...string) *replication.Relation {
	rel := &replication.Relation{ID: id, Namespace: schema, Name: name}
	for _, c := range cols {
		rel.Columns = append(rel.Columns, replication.Column{Name: c, TypeOID: 25})
	}
	return rel
}

func txt(s string) replication.Value {
	return replication.Value{Kind: replication.ValueText, Data: []byte(s)}
}

var null = replication.Value{Kind: replication.ValueNull}

// seedRow is a valid row of the seed table, keyed by column.
func seedRow() map[string]replication.Value {
	return map[string]replication.Value{
		"event_id":          txt(testEventID),
		"aggregate_type":    txt(""),
		"aggregate_id":      txt("r-1"),
		"aggregate_version": txt("7"),
		"event_type":        txt("RegistrationConfirmed"),
		"payload":           txt(testPayload),
		"occurred_at":       txt("2026-11-29 09:35:21.123456+00"),
		"publish_state":     txt("PENDING"),
	}
}

// newInsert lays row out in rel's column order; absent columns are NULL.
func newInsert(rel *replication.Relation, row map[string]replication.Value) *replication.Insert {
	ins := &replication.Insert{Relation: rel, LSN: 0x16B3748}
	for _, c := range rel.Columns {
		v, ok := row[c.Name]
		if !ok {
			v = null
		}
		ins.Values = append(ins.Values, v)
	}
	return ins
}

func mustNew(t testing.TB, cfg Config, opts ...Option) *Router {
	t.Helper()
	r, err := New(cfg, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return r
}

func seedConfig() Config { return Config{Tables: []TableConfig{{Table: "outbox"}}} }

func TestRouteSeedTable(t *testing.T) {
	r := mustNew(t, seedConfig())
	rel := newRelation(1, "public", "outbox", seedColumns...)
	row := seedRow()
	ins := newInsert(rel, row)
	m, err := r.Route(ins, testCommit)
	if err != nil {
		t.Fatalf("Route: %v", err)
	}
	want := nats.Header{
		contract.MsgID:            {testEventID},
		contract.EventID:          {testEventID},
		contract.EventType:        {"RegistrationConfirmed"},
		contract.AggregateType:    {"outbox"}, // empty column: the table name
		contract.AggregateID:      {"r-1"},
		contract.AggregateVersion: {"7"},
		contract.OccurredAt:       {"2026-11-29T09:35:21.123456Z"},
		contract.CommitLSN:        {"0/16B37A0"},
		contract.CommitTime:       {"2026-11-29T09:35:22.5Z"},
		contract.Table:            {"public.outbox"},
		contract.ContentType:      {"application/json"},
	}
	checkHeaders(t, m.Header.NATS(), want)
	if m.Subject != "outbox.outbox.r-1" || m.Key != "outbox\x00r-1" || m.EventID != testEventID ||
		m.Table != "public.outbox" || string(m.Data) != testPayload || m.LSN != ins.LSN || m.Commit != testCommit {
		t.Fatalf("message = %+v", m)
	}
	ev, err := contract.Parse(m.Header.NATS(), m.Data)
	if err != nil {
		t.Fatalf("contract.Parse: %v", err)
	}
	if ev.AggregateVersion != 7 || ev.AggregateID != "r-1" || !ev.OccurredAt.Equal(time.Date(2026, 11, 29, 9, 35, 21, 123456000, time.UTC)) {
		t.Fatalf("parsed event = %+v", ev)
	}

	// The decoder reuses its buffers: the message must not share them.
	for _, v := range ins.Values {
		for i := range v.Data {
			v.Data[i] = 'X'
		}
	}
	if string(m.Data) != testPayload || m.Subject != "outbox.outbox.r-1" || m.Header.Get(contract.EventID) != testEventID {
		t.Fatalf("message changed with the row's buffers: %+v", m)
	}
}

func checkHeaders(t *testing.T, got, want nats.Header) {
	t.Helper()
	for k, v := range want {
		if g, ok := got[k]; !ok || len(g) != len(v) || (len(v) > 0 && g[0] != v[0]) {
			t.Errorf("header %s = %q, want %q", k, got[k], v)
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("unexpected header %s = %q", k, got[k])
		}
	}
}

func TestRouteMapping(t *testing.T) {
	seedRel := func() *replication.Relation { return newRelation(1, "public", "outbox", seedColumns...) }
	tests := []struct {
		name    string
		cfg     Config
		rel     *replication.Relation
		edit    func(row map[string]replication.Value)
		subject string
		key     string
		headers map[string]string // expected values; "" value with absent=true means no header
		absent  []string
	}{
		{
			name:    "aggregate type column",
			cfg:     seedConfig(),
			edit:    func(r map[string]replication.Value) { r["aggregate_type"] = txt("Registration") },
			subject: "outbox.Registration.r-1",
			key:     "Registration\x00r-1",
			headers: map[string]string{contract.AggregateType: "Registration"},
		},
		{
			name:    "NULL aggregate type falls back to the table name",
			cfg:     seedConfig(),
			edit:    func(r map[string]replication.Value) { r["aggregate_type"] = null },
			subject: "outbox.outbox.r-1",
			headers: map[string]string{contract.AggregateType: "outbox"},
		},
		{
			name:    "table without aggregate_type column",
			cfg:     Config{Tables: []TableConfig{{Table: "app.events"}}},
			rel:     newRelation(2, "app", "events", "event_id", "aggregate_id", "aggregate_version", "event_type", "payload"),
			subject: "outbox.events.r-1",
			key:     "events\x00r-1",
			headers: map[string]string{contract.AggregateType: "events", contract.Table: "app.events"},
			absent:  []string{contract.OccurredAt},
		},
		{
			name:    "constant aggregate type wins over the column",
			cfg:     Config{Tables: []TableConfig{{Table: "outbox", AggregateType: "Registration"}}},
			edit:    func(r map[string]replication.Value) { r["aggregate_type"] = txt("Ignored") },
			subject: "outbox.Registration.r-1",
			key:     "Registration\x00r-1",
			headers: map[string]string{contract.AggregateType: "Registration"},
		},
		{
			name: "custom columns and template",
			cfg: Config{Tables: []TableConfig{{
				Table:   "billing.invoice_events",
				Subject: "billing.{schema}.{table}.{event_type}.id-{aggregate_id}",
				Columns: ColumnsConfig{EventID: "id", AggregateID: "invoice_id", AggregateVersion: "seq",
					EventType: "kind", Payload: "body", AggregateType: "agg", OccurredAt: "created_at"},
			}}},
			rel: newRelation(3, "billing", "invoice_events", "id", "invoice_id", "seq", "kind", "body", "agg", "created_at"),
			edit: func(r map[string]replication.Value) {
				r["id"], r["invoice_id"], r["seq"], r["kind"] = txt("e-9"), txt("inv.2026/1"), txt("3"), txt("InvoicePaid")
				r["body"], r["agg"], r["created_at"] = txt(`{}`), txt("Invoice"), txt("2026-11-29 15:05:21+05:30")
			},
			subject: "billing.billing.invoice_events.InvoicePaid.id-inv~2E2026~2F1",
			key:     "Invoice\x00inv.2026/1",
			headers: map[string]string{
				contract.EventID: "e-9", contract.AggregateID: "inv.2026/1", contract.AggregateVersion: "3",
				contract.OccurredAt: "2026-11-29T09:35:21Z", contract.Table: "billing.invoice_events",
			},
		},
		{
			name: "extra headers, NULL omitted",
			cfg: Config{Tables: []TableConfig{{Table: "outbox", Headers: map[string]string{
				"publish_state": "", "trace_id": "Trace-Id", "tenant": "X-Tenant",
			}}}},
			rel: newRelation(1, "public", "outbox", append(seedColumns, "trace_id", "tenant")...),
			edit: func(r map[string]replication.Value) {
				r["trace_id"], r["tenant"] = txt("00-abc-01"), null
			},
			subject: "outbox.outbox.r-1",
			headers: map[string]string{"Outbox-Extra-publish_state": "PENDING", "Trace-Id": "00-abc-01"},
			absent:  []string{"X-Tenant"},
		},
		{
			name:    "added column does not matter",
			cfg:     seedConfig(),
			rel:     newRelation(1, "public", "outbox", append([]string{"added_first"}, seedColumns...)...),
			edit:    func(r map[string]replication.Value) { r["added_first"] = txt("x") },
			subject: "outbox.outbox.r-1",
		},
		{
			name:    "empty aggregate id",
			cfg:     seedConfig(),
			edit:    func(r map[string]replication.Value) { r["aggregate_id"] = txt("") },
			subject: "outbox.outbox.~",
			key:     "outbox\x00",
			headers: map[string]string{contract.AggregateID: ""},
		},
		{
			name:    "aggregate id with subject syntax",
			cfg:     seedConfig(),
			edit:    func(r map[string]replication.Value) { r["aggregate_id"] = txt("a.*.> ~é") },
			subject: "outbox.outbox.a~2E~2A~2E~3E~20~7E~C3~A9",
			headers: map[string]string{contract.AggregateID: "a.*.> ~é"},
		},
		{
			name:    "NULL occurred_at omits the header",
			cfg:     seedConfig(),
			edit:    func(r map[string]replication.Value) { r["occurred_at"] = null },
			subject: "outbox.outbox.r-1",
			absent:  []string{contract.OccurredAt},
		},
		{
			name:    "occurred_at with seconds offset",
			cfg:     seedConfig(),
			edit:    func(r map[string]replication.Value) { r["occurred_at"] = txt("2026-11-29 06:05:06.5-03:30:15") },
			subject: "outbox.outbox.r-1",
			headers: map[string]string{contract.OccurredAt: "2026-11-29T09:35:21.5Z"},
		},
		{
			name:    "timestamp without time zone is UTC",
			cfg:     seedConfig(),
			edit:    func(r map[string]replication.Value) { r["occurred_at"] = txt("2026-11-29 09:35:21") },
			subject: "outbox.outbox.r-1",
			headers: map[string]string{contract.OccurredAt: "2026-11-29T09:35:21Z"},
		},
		{
			name:    "int64 max version",
			cfg:     seedConfig(),
			edit:    func(r map[string]replication.Value) { r["aggregate_version"] = txt("9223372036854775807") },
			subject: "outbox.outbox.r-1",
			headers: map[string]string{contract.AggregateVersion: "9223372036854775807"},
		},
		{
			name:    "int64 min version",
			cfg:     seedConfig(),
			edit:    func(r map[string]replication.Value) { r["aggregate_version"] = txt("-9223372036854775808") },
			subject: "outbox.outbox.r-1",
			headers: map[string]string{contract.AggregateVersion: "-9223372036854775808"},
		},
		{
			name:    "leading zeros are normalised",
			cfg:     seedConfig(),
			edit:    func(r map[string]replication.Value) { r["aggregate_version"] = txt("007") },
			subject: "outbox.outbox.r-1",
			headers: map[string]string{contract.AggregateVersion: "7"},
		},
		{
			name:    "empty payload is allowed",
			cfg:     seedConfig(),
			edit:    func(r map[string]replication.Value) { r["payload"] = txt("") },
			subject: "outbox.outbox.r-1",
		},
		{
			name:    "event type placeholder",
			cfg:     Config{Tables: []TableConfig{{Table: "outbox", Subject: "ev.{event_type}"}}},
			subject: "ev.RegistrationConfirmed",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := mustNew(t, tt.cfg)
			rel := tt.rel
			if rel == nil {
				rel = seedRel()
			}
			row := seedRow()
			if tt.edit != nil {
				tt.edit(row)
			}
			if _, ok := row["id"]; ok {
				// Custom tables take only their own columns.
				for _, c := range seedColumns {
					delete(row, c)
				}
			}
			ins := newInsert(rel, row)
			m, err := r.Route(ins, testCommit)
			if err != nil {
				t.Fatalf("Route: %v", err)
			}
			if m.Subject != tt.subject {
				t.Errorf("subject = %q, want %q", m.Subject, tt.subject)
			}
			if tt.key != "" && m.Key != tt.key {
				t.Errorf("key = %q, want %q", m.Key, tt.key)
			}
			for k, v := range tt.headers {
				if got := m.Header.NATS().Values(k); len(got) != 1 || got[0] != v {
					t.Errorf("header %s = %q, want %q", k, got, v)
				}
			}
			for _, k := range tt.absent {
				if _, ok := m.Header.NATS()[k]; ok {
					t.Errorf("header %s = %q, want none", k, m.Header.NATS()[k])
				}
			}
			if pi := rel.ColumnIndex(r.rules[relKey{rel.Namespace, rel.Name}].payload); !bytes.Equal(m.Data, ins.Values[pi].Data) || m.Data == nil {
				t.Errorf("data = %q, want the payload column's bytes %q", m.Data, ins.Values[pi].Data)
			}
			if _, err := contract.Parse(m.Header.NATS(), m.Data); err != nil {
				t.Errorf("contract.Parse: %v", err)
			}
			if msg := checkSubject(m.Subject); msg != "" {
				t.Errorf("subject %q: %s", m.Subject, msg)
			}
		})
	}
}

func TestRouteErrors(t *testing.T) {
	long := strings.Repeat("x", 2000)
	tests := []struct {
		name   string
		cfg    Config
		opts   []Option
		cols   []string // relation columns; nil for the seed table
		edit   func(row map[string]replication.Value)
		class  string
		column string
	}{
		{name: "dropped required column", cfg: seedConfig(), cols: without(seedColumns, "aggregate_version"), class: ClassMissingColumn, column: "aggregate_version"},
		{name: "renamed payload", cfg: seedConfig(), cols: append(without(seedColumns, "payload"), "body"), class: ClassMissingColumn, column: "payload"},
		{name: "explicit aggregate type column missing", cfg: Config{Tables: []TableConfig{{Table: "outbox", Columns: ColumnsConfig{AggregateType: "kind"}}}}, class: ClassMissingColumn, column: "kind"},
		{name: "explicit occurred_at column missing", cfg: Config{Tables: []TableConfig{{Table: "outbox", Columns: ColumnsConfig{OccurredAt: "created_at"}}}}, class: ClassMissingColumn, column: "created_at"},
		{name: "extra header column missing", cfg: Config{Tables: []TableConfig{{Table: "outbox", Headers: map[string]string{"trace_id": ""}}}}, class: ClassMissingColumn, column: "trace_id"},
		{name: "NULL event id", cfg: seedConfig(), edit: set("event_id", null), class: ClassNullField, column: "event_id"},
		{name: "NULL aggregate id", cfg: seedConfig(), edit: set("aggregate_id", null), class: ClassNullField, column: "aggregate_id"},
		{name: "NULL version", cfg: seedConfig(), edit: set("aggregate_version", null), class: ClassNullField, column: "aggregate_version"},
		{name: "NULL event type", cfg: seedConfig(), edit: set("event_type", null), class: ClassNullField, column: "event_type"},
		{name: "NULL payload", cfg: seedConfig(), edit: set("payload", null), class: ClassNullField, column: "payload"},
		{name: "empty event id", cfg: seedConfig(), edit: set("event_id", txt("")), class: ClassInvalidField, column: "event_id"},
		{name: "empty event type", cfg: seedConfig(), edit: set("event_type", txt("")), class: ClassInvalidField, column: "event_type"},
		{name: "fractional version", cfg: seedConfig(), edit: set("aggregate_version", txt("7.5")), class: ClassInvalidField, column: "aggregate_version"},
		{name: "empty version", cfg: seedConfig(), edit: set("aggregate_version", txt("")), class: ClassInvalidField, column: "aggregate_version"},
		{name: "version over int64", cfg: seedConfig(), edit: set("aggregate_version", txt("9223372036854775808")), class: ClassInvalidField, column: "aggregate_version"},
		{name: "version under int64", cfg: seedConfig(), edit: set("aggregate_version", txt("-9223372036854775809")), class: ClassInvalidField, column: "aggregate_version"},
		{name: "version with plus sign", cfg: seedConfig(), edit: set("aggregate_version", txt("+7")), class: ClassInvalidField, column: "aggregate_version"},
		{name: "bad occurred_at", cfg: seedConfig(), edit: set("occurred_at", txt("infinity")), class: ClassInvalidField, column: "occurred_at"},
		{name: "binary value", cfg: seedConfig(), edit: set("payload", replication.Value{Kind: replication.ValueBinary, Data: []byte{1}}), class: ClassInvalidField, column: "payload"},
		{name: "unchanged value", cfg: seedConfig(), edit: set("aggregate_id", replication.Value{Kind: replication.ValueUnchanged}), class: ClassInvalidField, column: "aggregate_id"},
		{name: "line break in aggregate id", cfg: seedConfig(), edit: set("aggregate_id", txt("a\nb")), class: ClassInvalidField, column: "aggregate_id"},
		{name: "trailing space in event type", cfg: seedConfig(), edit: set("event_type", txt("Confirmed ")), class: ClassInvalidField, column: "event_type"},
		{name: "line break in extra header", cfg: Config{Tables: []TableConfig{{Table: "outbox", Headers: map[string]string{"publish_state": ""}}}},
			edit: set("publish_state", txt("a\r\nNats-Expected-Stream: x")), class: ClassInvalidField, column: "publish_state"},
		{name: "subject too long", cfg: Config{MaxSubjectBytes: 64, Tables: []TableConfig{{Table: "outbox"}}}, edit: set("aggregate_id", txt(strings.Repeat("a", 60))), class: ClassSubjectTooLong},
		{name: "escaping makes the subject too long", cfg: seedConfig(), edit: set("aggregate_id", txt(strings.Repeat(".", 400))), class: ClassSubjectTooLong},
		{name: "payload too large", cfg: seedConfig(), opts: []Option{WithMaxPayload(4096)}, edit: set("payload", txt(`"`+strings.Repeat("p", 4096)+`"`)), class: ClassTooLarge},
		{name: "headers make it too large", cfg: Config{Tables: []TableConfig{{Table: "outbox", Headers: map[string]string{"publish_state": ""}}}},
			opts: []Option{WithMaxPayload(4096)}, edit: set("publish_state", txt(long+long)), class: ClassTooLarge},
		// Regression (issue 16, case 2): within max_payload, over JetStream's
		// 64 KiB header limit.
		{name: "headers over 64 KiB", cfg: seedConfig(), edit: set("event_type", txt(strings.Repeat("t", 70000))), class: ClassHeaderTooLarge},
		{name: "extra header over 64 KiB", cfg: Config{Tables: []TableConfig{{Table: "outbox", Headers: map[string]string{"publish_state": ""}}}},
			edit: set("publish_state", txt(strings.Repeat("s", MaxHeaderBytes))), class: ClassHeaderTooLarge},
		{name: "unknown table", cfg: Config{Tables: []TableConfig{{Table: "other"}}}, class: ClassUnknownTable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := mustNew(t, tt.cfg, tt.opts...)
			cols := tt.cols
			if cols == nil {
				cols = seedColumns
			}
			row := seedRow()
			if tt.edit != nil {
				tt.edit(row)
			}
			m, err := r.Route(newInsert(newRelation(1, "public", "outbox", cols...), row), testCommit)
			if m != nil {
				t.Fatalf("Route = %+v, want an error", m)
			}
			if !errors.Is(err, ErrUnroutable) {
				t.Fatalf("Route error %v does not wrap ErrUnroutable", err)
			}
			var re *RouteError
			if !errors.As(err, &re) {
				t.Fatalf("Route error %T is not a *RouteError", err)
			}
			if re.Class != tt.class || re.Column != tt.column || re.Table != "public.outbox" || re.Reason == "" {
				t.Fatalf("RouteError = %+v, want class %s column %q", re, tt.class, tt.column)
			}
			if len(err.Error()) > 1024 {
				t.Fatalf("error is %d bytes long; values must be cut", len(err.Error()))
			}
		})
	}
}

func without(cols []string, drop string) []string {
	var out []string
	for _, c := range cols {
		if c != drop {
			out = append(out, c)
		}
	}
	return out
}

func set(col string, v replication.Value) func(map[string]replication.Value) {
	return func(r map[string]replication.Value) { r[col] = v }
}

// TestRouteMaxPayloadIsExact checks that Route's size check counts the
// header block exactly as nats.go encodes it: a payload of the largest
// accepted size makes a message of exactly max payload bytes.
func TestRouteMaxPayloadIsExact(t *testing.T) {
	const limit = 8192
	r := mustNew(t, Config{Tables: []TableConfig{{Table: "outbox", Headers: map[string]string{"publish_state": "State"}}}}, WithMaxPayload(limit))
	rel := newRelation(1, "public", "outbox", seedColumns...)
	row := seedRow()
	route := func(n int) (*Message, error) {
		row["payload"] = txt(strings.Repeat("p", n))
		return r.Route(newInsert(rel, row), testCommit)
	}
	lo, hi := 0, limit // Route(lo) succeeds, Route(hi) fails
	for hi-lo > 1 {
		mid := (lo + hi) / 2
		if _, err := route(mid); err == nil {
			lo = mid
		} else {
			hi = mid
		}
	}
	m, err := route(lo)
	if err != nil {
		t.Fatal(err)
	}
	nm := &nats.Msg{Subject: m.Subject, Header: m.Header.NATS(), Data: m.Data}
	if size := nm.Size() - len(nm.Subject); size != limit {
		t.Fatalf("largest accepted message is %d bytes on the wire, want %d", size, limit)
	}
	if hdr := nm.Size() - len(nm.Subject) - len(nm.Data); m.HeaderLen != hdr {
		t.Fatalf("HeaderLen %d, nats.go encodes %d bytes of headers", m.HeaderLen, hdr)
	}
	if _, err := route(lo + 1); !errors.Is(err, ErrUnroutable) {
		t.Fatalf("one byte more: %v", err)
	}
}

func TestRouteRelationChanges(t *testing.T) {
	r := mustNew(t, seedConfig())
	rel1 := newRelation(7, "public", "outbox", seedColumns...)
	row := seedRow()
	if _, err := r.Route(newInsert(rel1, row), testCommit); err != nil {
		t.Fatal(err)
	}
	// ALTER TABLE ... DROP COLUMN aggregate_version: a new relation, same id.
	rel2 := newRelation(7, "public", "outbox", without(seedColumns, "aggregate_version")...)
	if _, err := r.Route(newInsert(rel2, row), testCommit); !isClass(err, ClassMissingColumn) {
		t.Fatalf("after the drop: %v", err)
	}
	// ADD COLUMN back (now last) and another column: routing works again,
	// with the new positions.
	rel3 := newRelation(7, "public", "outbox", append(without(seedColumns, "aggregate_version"), "note", "aggregate_version")...)
	row["aggregate_version"] = txt("8")
	m, err := r.Route(newInsert(rel3, row), testCommit)
	if err != nil || m.Header.Get(contract.AggregateVersion) != "8" {
		t.Fatalf("after re-adding: %v %v", m, err)
	}
	// A row of the old relation still routes with the old plan.
	row["aggregate_version"] = txt("9")
	if m, err := r.Route(newInsert(rel1, row), testCommit); err != nil || m.Header.Get(contract.AggregateVersion) != "9" {
		t.Fatalf("old relation: %v %v", m, err)
	}
	if !r.Handles(rel3) || r.Handles(newRelation(8, "public", "other", seedColumns...)) || r.Handles(nil) {
		t.Fatal("Handles is wrong")
	}
}

func isClass(err error, class string) bool {
	var re *RouteError
	return errors.As(err, &re) && re.Class == class
}

func TestWithMaxPayload(t *testing.T) {
	if _, err := New(seedConfig(), WithMaxPayload(100)); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("New(WithMaxPayload(100)) = %v, want ErrInvalidOption", err)
	}
}

func TestParseInt64(t *testing.T) {
	for _, s := range []string{"0", "-0", "1", "-1", "42", "9223372036854775807", "-9223372036854775808", "9223372036854775808", "-9223372036854775809",
		"", "-", "+1", "1.0", " 1", "1 ", "99999999999999999999", "0x10", "00012"} {
		want, werr := strconv.ParseInt(s, 10, 64)
		if strings.HasPrefix(s, "+") {
			werr = errors.New("no plus sign")
		}
		got, ok := parseInt64([]byte(s))
		if ok != (werr == nil) || (ok && got != want) {
			t.Errorf("parseInt64(%q) = %d, %v; strconv says %d, %v", s, got, ok, want, werr)
		}
	}
	if v, ok := parseInt64([]byte("-9223372036854775808")); !ok || v != math.MinInt64 {
		t.Fatal("min int64")
	}
}

// FuzzRoute feeds arbitrary column texts to Route: it must never panic, and
// it either returns a message with a valid subject and the exact payload
// bytes, or a RouteError.
func FuzzRoute(f *testing.F) {
	f.Add(testEventID, "", "r-1", "7", "RegistrationConfirmed", testPayload, "2026-11-29 09:35:21.123456+00", uint8(0))
	f.Add("e", "T.x", "", "-9223372036854775808", "E", "", "2026-11-29 06:05:06-03:30:15", uint8(0xFF))
	f.Add("e\n", "~", "a b", "x", " E", "{}", "infinity", uint8(3))
	cfg := Config{Tables: []TableConfig{{Table: "outbox", Subject: "o.{aggregate_type}.{event_type}.x{aggregate_id}", Headers: map[string]string{"publish_state": ""}}}}
	r := mustNew(f, cfg, WithMaxPayload(MinMaxPayload))
	rel := newRelation(1, "public", "outbox", seedColumns...)
	f.Fuzz(func(t *testing.T, eventID, aggType, aggID, version, eventType, payload, occurredAt string, nulls uint8) {
		vals := []string{eventID, aggType, aggID, version, eventType, payload, occurredAt, "PENDING"}
		ins := &replication.Insert{Relation: rel, LSN: 1}
		for i, v := range vals {
			if nulls&(1<<i) != 0 {
				ins.Values = append(ins.Values, null)
			} else {
				ins.Values = append(ins.Values, txt(v))
			}
		}
		m, err := r.Route(ins, testCommit)
		if err != nil {
			var re *RouteError
			if m != nil || !errors.As(err, &re) || !errors.Is(err, ErrUnroutable) || re.Class == "" {
				t.Fatalf("Route = %v, %v: want a RouteError", m, err)
			}
			dl := r.DeadLetter(ins, testCommit, err)
			if size := (&nats.Msg{Header: dl.Header.NATS(), Data: dl.Data}).Size(); size > MinMaxPayload {
				t.Fatalf("dead-letter record is %d bytes, over %d", size, MinMaxPayload)
			}
			return
		}
		if msg := checkSubject(m.Subject); msg != "" || len(m.Subject) > DefaultMaxSubjectBytes {
			t.Fatalf("subject %q: %s", m.Subject, msg)
		}
		if !bytes.Equal(m.Data, []byte(payload)) {
			t.Fatalf("data = %q, want %q", m.Data, payload)
		}
		if _, err := contract.Parse(m.Header.NATS(), m.Data); err != nil {
			t.Fatalf("contract.Parse: %v", err)
		}
		if size := (&nats.Msg{Header: m.Header.NATS(), Data: m.Data}).Size(); size > MinMaxPayload {
			t.Fatalf("message is %d bytes, over %d", size, MinMaxPayload)
		}
	})
}

// TestRouteMessagesIndependent: each message is the caller's; a message
// still held is not touched by later rows (the router reuses its scratch
// buffer), and each one equals what a fresh router builds.
func TestRouteMessagesIndependent(t *testing.T) {
	r := mustNew(t, seedConfig())
	rel := newRelation(1, "public", "outbox", seedColumns...)
	route := func(id, agg, payload string) *Message {
		t.Helper()
		row := seedRow()
		row["event_id"] = txt(id)
		row["aggregate_id"] = txt(agg)
		row["payload"] = txt(payload)
		m, err := r.Route(newInsert(rel, row), testCommit)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	fresh := mustNew(t, seedConfig()) // empty caches: the reference
	held := route("11111111-1111-4111-8111-111111111111", "held", `{"a": 1}`)
	for i := 0; i < 50; i++ {
		m := route(fmt.Sprintf("22222222-2222-4222-8222-%012d", i), fmt.Sprintf("agg-%d", i), fmt.Sprintf(`{"n": %d}`, i))
		row := seedRow()
		row["event_id"] = txt(fmt.Sprintf("22222222-2222-4222-8222-%012d", i))
		row["aggregate_id"] = txt(fmt.Sprintf("agg-%d", i))
		row["payload"] = txt(fmt.Sprintf(`{"n": %d}`, i))
		m2, err := fresh.Route(newInsert(rel, row), testCommit)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(m.Header, m2.Header) {
			t.Fatalf("row %d: headers %v, fresh router's %v", i, m.Header, m2.Header)
		}
		if got, want := m.Header.Get(contract.MsgID), fmt.Sprintf("22222222-2222-4222-8222-%012d", i); got != want || m.EventID != want {
			t.Fatalf("row %d: Nats-Msg-Id %q, EventID %q, want %q", i, got, m.EventID, want)
		}
		if got := m.Header.Get(contract.AggregateID); got != fmt.Sprintf("agg-%d", i) {
			t.Fatalf("row %d: aggregate id %q", i, got)
		}
		if string(m.Data) != fmt.Sprintf(`{"n": %d}`, i) {
			t.Fatalf("row %d: data %q", i, m.Data)
		}
		if n := len(m.Header); n != fixedHeaders+1 { // + occurred_at
			t.Fatalf("row %d: %d headers: %v", i, n, m.Header)
		}
	}
	if held.Header.Get(contract.AggregateID) != "held" || string(held.Data) != `{"a": 1}` || held.Key != "outbox\x00held" {
		t.Fatalf("a held message changed: %v %q %q", held.Header, held.Data, held.Key)
	}
}

// TestRouteAcrossTables alternates tables whose rows carry different header
// sets: a message never has a key its row does not have, and HeaderLen
// always matches the map.
func TestRouteAcrossTables(t *testing.T) {
	r := mustNew(t, Config{Tables: []TableConfig{
		{Table: "outbox", Headers: map[string]string{"publish_state": "State"}},
		{Table: "lean"},
	}})
	full := newRelation(1, "public", "outbox", seedColumns...)
	lean := newRelation(2, "public", "lean", seedColumns...)
	leanRow := seedRow()
	leanRow["occurred_at"] = null
	for i, step := range []struct {
		rel  *replication.Relation
		row  map[string]replication.Value
		want int
	}{
		{full, seedRow(), fixedHeaders + 2}, // occurred_at and State
		{lean, leanRow, fixedHeaders},
		{full, seedRow(), fixedHeaders + 2},
		{lean, seedRow(), fixedHeaders + 1},
		{lean, leanRow, fixedHeaders},
	} {
		m, err := r.Route(newInsert(step.rel, step.row), testCommit)
		if err != nil {
			t.Fatal(err)
		}
		if len(m.Header) != step.want {
			t.Fatalf("step %d (%s): %d headers, want %d: %v", i, m.Table, len(m.Header), step.want, m.Header)
		}
		if _, ok := m.Header.NATS()["State"]; ok != (step.rel == full) {
			t.Fatalf("step %d (%s): State header present %v", i, m.Table, ok)
		}
		nm := &nats.Msg{Subject: m.Subject, Header: m.Header.NATS(), Data: m.Data}
		if hdr := nm.Size() - len(nm.Subject) - len(nm.Data); m.HeaderLen != hdr {
			t.Fatalf("step %d: HeaderLen %d, nats.go encodes %d", i, m.HeaderLen, hdr)
		}
	}
}

// TestRouteManyExtraHeaders maps more than 63 extra columns (where a
// header-shape bitset once gave up): every column present is a header, and
// HeaderLen is what nats.go encodes.
func TestRouteManyExtraHeaders(t *testing.T) {
	cols := slices.Clone(seedColumns)
	headers := map[string]string{}
	row := seedRow()
	for i := range 70 {
		c := fmt.Sprintf("x%02d", i)
		cols = append(cols, c)
		headers[c] = fmt.Sprintf("X-%02d", i)
		if i%7 == 3 {
			row[c] = null
		} else {
			row[c] = txt(fmt.Sprintf("v%d", i))
		}
	}
	r := mustNew(t, Config{Tables: []TableConfig{{Table: "outbox", Headers: headers}}})
	rel := newRelation(1, "public", "outbox", cols...)
	for range 3 {
		m, err := r.Route(newInsert(rel, row), testCommit)
		if err != nil {
			t.Fatal(err)
		}
		if want := fixedHeaders + 1 + 60; len(m.Header) != want { // + occurred_at, 10 of the 70 NULL
			t.Fatalf("%d headers, want %d", len(m.Header), want)
		}
		if got := m.Header.Get("X-69"); got != "v69" {
			t.Fatalf("X-69 = %q", got)
		}
		if _, ok := m.Header.NATS()["X-03"]; ok {
			t.Fatal("a NULL column became a header")
		}
		nm := &nats.Msg{Subject: m.Subject, Header: m.Header.NATS(), Data: m.Data}
		if hdr := nm.Size() - len(nm.Subject) - len(nm.Data); m.HeaderLen != hdr {
			t.Fatalf("HeaderLen %d, nats.go encodes %d", m.HeaderLen, hdr)
		}
	}
}
