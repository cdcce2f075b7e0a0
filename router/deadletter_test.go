package router

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/replication"
)

// dlqBody is the dead-letter record body as a consumer decodes it.
type dlqBody struct {
	Table           string             `json:"table"`
	LSN             string             `json:"lsn"`
	CommitLSN       string             `json:"commit_lsn"`
	CommitTime      string             `json:"commit_time"`
	Reason          string             `json:"reason"`
	ReasonClass     string             `json:"reason_class"`
	EventID         string             `json:"event_id"`
	Subject         string             `json:"subject"`
	Row             map[string]*string `json:"row"`
	Headers         map[string]string  `json:"headers"`
	Payload         *string            `json:"payload"`
	Omitted         map[string]string  `json:"omitted"`
	Truncated       bool               `json:"truncated"`
	TruncatedFields map[string]int     `json:"truncated_fields"`
	FieldsDropped   bool               `json:"fields_dropped"`
}

func decodeDLQ(t *testing.T, m *Message, maxPayload int) dlqBody {
	t.Helper()
	var b dlqBody
	dec := json.NewDecoder(strings.NewReader(string(m.Data)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&b); err != nil {
		t.Fatalf("record body is not the documented JSON: %v\n%s", err, m.Data)
	}
	if size := (&nats.Msg{Header: m.Header.NATS(), Data: m.Data}).Size(); size > maxPayload {
		t.Fatalf("record is %d bytes, over max payload %d", size, maxPayload)
	}
	return b
}

// rowKeys returns the keys of the body's "row" object in document order.
func rowKeys(t *testing.T, data []byte) []string {
	t.Helper()
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(data, &raw); err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(strings.NewReader(string(raw["row"])))
	var keys []string
	if _, err := dec.Token(); err != nil { // {
		t.Fatal(err)
	}
	for dec.More() {
		k, err := dec.Token()
		if err != nil {
			t.Fatal(err)
		}
		keys = append(keys, k.(string))
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			t.Fatal(err)
		}
	}
	return keys
}

func TestDeadLetterRouteError(t *testing.T) {
	r := mustNew(t, seedConfig())
	rel := newRelation(1, "public", "outbox", seedColumns...)
	row := seedRow()
	row["aggregate_version"] = txt("seven")
	row["occurred_at"] = null
	ins := newInsert(rel, row)
	_, err := r.Route(ins, testCommit)
	if !isClass(err, ClassInvalidField) {
		t.Fatalf("Route: %v", err)
	}
	m := r.DeadLetter(ins, testCommit, err)
	if m.Subject != "outbox_dlq.public~2Eoutbox" || m.Key != "" || m.Table != "public.outbox" || m.LSN != ins.LSN {
		t.Fatalf("record = %+v", m)
	}
	checkHeaders(t, m.Header.NATS(), nats.Header{
		contract.MsgID:          {"dlq:public.outbox:event:" + testEventID},
		contract.Table:          {"public.outbox"},
		contract.DLQReason:      {err.Error()},
		contract.DLQReasonClass: {ClassInvalidField},
		contract.DLQLSN:         {"0/16B3748"},
		contract.CommitLSN:      {"0/16B37A0"},
		contract.CommitTime:     {"2026-11-29T09:35:22.5Z"},
		contract.EventID:        {testEventID},
		contract.ContentType:    {contract.JSONContentType},
	})
	b := decodeDLQ(t, m, DefaultMaxPayload)
	if b.Table != "public.outbox" || b.LSN != "0/16B3748" || b.CommitLSN != "0/16B37A0" || b.CommitTime != "2026-11-29T09:35:22.5Z" ||
		b.Reason != err.Error() || b.ReasonClass != ClassInvalidField || b.EventID != testEventID || b.Subject != "" || b.Truncated {
		t.Fatalf("body = %+v", b)
	}
	if got := rowKeys(t, m.Data); strings.Join(got, ",") != strings.Join(seedColumns, ",") {
		t.Fatalf("row columns = %v, want table order %v", got, seedColumns)
	}
	if *b.Row["aggregate_version"] != "seven" || *b.Row["payload"] != testPayload || b.Row["occurred_at"] != nil {
		t.Fatalf("row = %v", b.Row)
	}
	// The same row dead-lettered again (after a relay restart) has the same
	// id, so the stream drops the copy.
	if again := r.DeadLetter(ins, testCommit, err); again.Header.Get(contract.MsgID) != m.Header.Get(contract.MsgID) || string(again.Data) != string(m.Data) {
		t.Fatal("dead-letter record is not deterministic")
	}
}

func TestDeadLetterHugeRow(t *testing.T) {
	r := mustNew(t, seedConfig())
	rel := newRelation(1, "public", "outbox", seedColumns...)
	row := seedRow()
	huge := `"` + strings.Repeat("é", 1<<20) + `"` // 2 MiB + 2 bytes
	row["payload"] = txt(huge)
	ins := newInsert(rel, row)
	_, err := r.Route(ins, testCommit)
	var re *RouteError
	if !errors.As(err, &re) || re.Class != ClassTooLarge || re.Subject != "outbox.outbox.r-1" {
		t.Fatalf("Route: %v", err)
	}
	m := r.DeadLetter(ins, testCommit, err)
	b := decodeDLQ(t, m, DefaultMaxPayload)
	if !b.Truncated || b.TruncatedFields["payload"] != len(huge) || b.Subject != "outbox.outbox.r-1" || b.ReasonClass != ClassTooLarge {
		t.Fatalf("body: truncated=%v fields=%v subject=%q", b.Truncated, b.TruncatedFields, b.Subject)
	}
	if p := *b.Row["payload"]; !strings.HasPrefix(huge, p) || len(p) < 100_000 {
		t.Fatalf("payload kept %d bytes; want a prefix of useful size", len(p))
	}
	if *b.Row["event_id"] != testEventID {
		t.Fatal("small values must stay whole")
	}
}

func TestDeadLetterTinyMaxPayloadManyColumns(t *testing.T) {
	r := mustNew(t, seedConfig(), WithMaxPayload(MinMaxPayload))
	var cols []string
	row := seedRow()
	for i := 0; i < 300; i++ {
		c := fmt.Sprintf("%s_%03d", strings.Repeat("c", 55), i)
		cols = append(cols, c)
		row[c] = txt("\x01\x02\x03\x04") // escapes to 24 bytes of JSON
	}
	rel := newRelation(1, "public", "outbox", append(seedColumns, cols...)...)
	ins := newInsert(rel, row)
	reason := errors.New(strings.Repeat("very long reason\r\n", 500))
	m := r.DeadLetter(ins, testCommit, reason)
	b := decodeDLQ(t, m, MinMaxPayload)
	if !b.Truncated || !b.FieldsDropped || b.Row != nil || b.ReasonClass != ClassRejectedByBroker {
		t.Fatalf("body = %+v", b)
	}
	if h := m.Header.Get(contract.DLQReason); len(h) > maxReasonBytes || strings.ContainsAny(h, "\r\n") {
		t.Fatalf("reason header %q", h)
	}
}

type classedError struct{}

func (classedError) Error() string       { return "maximum payload exceeded" }
func (classedError) ReasonClass() string { return "broker_too_large" }

func TestDeadLetterReasonClass(t *testing.T) {
	r := mustNew(t, seedConfig())
	ins := newInsert(newRelation(1, "public", "outbox", seedColumns...), seedRow())
	for _, tt := range []struct {
		reason error
		class  string
	}{
		{errors.New("stream rejected it"), ClassRejectedByBroker},
		{fmt.Errorf("publish: %w", classedError{}), "broker_too_large"},
		{fmt.Errorf("wrapped: %w", &RouteError{Class: ClassNullField}), ClassNullField},
		{nil, ClassUnknown},
	} {
		m := r.DeadLetter(ins, testCommit, tt.reason)
		if got := m.Header.Get(contract.DLQReasonClass); got != tt.class {
			t.Errorf("reason %v: class %q, want %q", tt.reason, got, tt.class)
		}
		if b := decodeDLQ(t, m, DefaultMaxPayload); b.ReasonClass != tt.class || b.EventID != testEventID {
			t.Errorf("reason %v: body %+v", tt.reason, b)
		}
	}
}

func TestDeadLetterOddValues(t *testing.T) {
	r := mustNew(t, seedConfig())
	rel := newRelation(1, "other", "tbl", "event_id", "blob", "gone", "text")
	ins := newInsert(rel, map[string]replication.Value{
		"event_id": txt("e\n1"), // not header-safe: body only
		"blob":     {Kind: replication.ValueBinary, Data: []byte{0, 1, 2}},
		"gone":     {Kind: replication.ValueUnchanged},
		"text":     txt("bad utf8 \xff\xfe \"quoted\" \\ \t"),
	})
	_, err := r.Route(ins, testCommit)
	if !isClass(err, ClassUnknownTable) {
		t.Fatalf("Route: %v", err)
	}
	m := r.DeadLetter(ins, testCommit, err)
	if m.Subject != "outbox_dlq.other~2Etbl" || m.Header.Get(contract.MsgID) != "dlq:other.tbl:0/16B3748" {
		t.Fatalf("record = %+v", m)
	}
	if _, ok := m.Header.NATS()[contract.EventID]; ok {
		t.Fatal("an event id with a line break must not become a header")
	}
	b := decodeDLQ(t, m, DefaultMaxPayload)
	if b.EventID != "e\n1" || b.Row["blob"] != nil || b.Row["gone"] != nil || b.Omitted["blob"] == "" || b.Omitted["gone"] == "" ||
		*b.Row["text"] != "bad utf8 \ufffd\ufffd \"quoted\" \\ \t" {
		t.Fatalf("body = %+v", b)
	}

	// A row shorter than its relation (a decoder bug) must not panic.
	ins.Values = ins.Values[:2]
	b = decodeDLQ(t, r.DeadLetter(ins, testCommit, err), DefaultMaxPayload)
	if b.Row["text"] != nil || b.Omitted["text"] == "" {
		t.Fatalf("short row: %+v", b)
	}
	// Neither must a missing row.
	if d := r.DeadLetter(nil, testCommit, err); d == nil || !json.Valid(d.Data) {
		t.Fatal("DeadLetter(nil)")
	}
}

// Regression (issue 16, case 1): the rows of one COPY share one LSN, and a
// dead-letter id made of the LSN alone let the stream keep the first record
// and drop the rest as duplicates. Each row's id is its own, and the same
// when the row is decoded again.
func TestDeadLetterIDsUniquePerRow(t *testing.T) {
	r := mustNew(t, seedConfig())
	rel := newRelation(1, "public", "outbox", seedColumns...)
	longID := strings.Repeat("i", maxDLQEventIDBytes+1)
	tests := []struct {
		name    string
		eventID replication.Value
		ordinal uint32
		want    string
	}{
		{"event id", txt("e-1"), 0, "dlq:public.outbox:event:e-1"},
		{"event id, later ordinal", txt("e-2"), 3, "dlq:public.outbox:event:e-2"},
		{"NULL event id", null, 0, "dlq:public.outbox:0/16B3748"},
		{"NULL event id, second row of the LSN", null, 1, "dlq:public.outbox:0/16B3748:1"},
		{"NULL event id, fifth row of the LSN", null, 4, "dlq:public.outbox:0/16B3748:4"},
		{"event id too long for a header", txt(longID), 2, "dlq:public.outbox:0/16B3748:2"},
		{"event id not header-safe", txt("a\nb"), 1, "dlq:public.outbox:0/16B3748:1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			row := seedRow()
			row["event_id"] = tt.eventID
			row["event_type"] = null
			ins := newInsert(rel, row)
			ins.Ordinal = tt.ordinal
			_, err := r.Route(ins, testCommit)
			if err == nil {
				t.Fatal("Route accepted a NULL event type")
			}
			for i := 0; i < 2; i++ { // a replay gives the same id
				if got := r.DeadLetter(ins, testCommit, err).Header.Get(contract.MsgID); got != tt.want {
					t.Fatalf("id %q, want %q", got, tt.want)
				}
			}
		})
	}

	// The broker-side path: a routed message rejected as too large.
	row := seedRow()
	row["event_id"] = txt(longID)
	ins := newInsert(rel, row)
	ins.Ordinal = 2
	m, err := r.Route(ins, testCommit)
	if err != nil {
		t.Fatal(err)
	}
	if got := r.DeadLetterMessage(m, classedError{}).Header.Get(contract.MsgID); got != "dlq:public.outbox:0/16B3748:2" {
		t.Fatalf("broker-side id %q", got)
	}
}

func TestDeadLetterMessage(t *testing.T) {
	r := mustNew(t, seedConfig())
	ins := newInsert(newRelation(1, "public", "outbox", seedColumns...), seedRow())
	m, err := r.Route(ins, testCommit)
	if err != nil {
		t.Fatal(err)
	}
	reason := classedError{}
	d := r.DeadLetterMessage(m, reason)
	if d.Subject != "outbox_dlq.public~2Eoutbox" {
		t.Fatalf("subject %q", d.Subject)
	}
	// Same id as DeadLetter gives the row: whichever path dead-letters it,
	// a replay is de-duplicated.
	if id := r.DeadLetter(ins, testCommit, reason).Header.Get(contract.MsgID); d.Header.Get(contract.MsgID) != id {
		t.Fatalf("ids differ: %q vs %q", d.Header.Get(contract.MsgID), id)
	}
	checkHeaders(t, d.Header.NATS(), nats.Header{
		contract.MsgID:          {"dlq:public.outbox:event:" + testEventID},
		contract.Table:          {"public.outbox"},
		contract.DLQReason:      {reason.Error()},
		contract.DLQReasonClass: {"broker_too_large"},
		contract.DLQLSN:         {"0/16B3748"},
		contract.CommitLSN:      {"0/16B37A0"},
		contract.CommitTime:     {"2026-11-29T09:35:22.5Z"},
		contract.EventID:        {testEventID},
		contract.ContentType:    {contract.JSONContentType},
	})
	b := decodeDLQ(t, d, DefaultMaxPayload)
	if b.Subject != m.Subject || b.Payload == nil || *b.Payload != testPayload || b.Row != nil ||
		b.Headers[contract.EventType] != "RegistrationConfirmed" || len(b.Headers) != len(m.Header) {
		t.Fatalf("body = %+v", b)
	}

	// A message too large for the broker still yields a record that fits.
	m.Data = []byte(strings.Repeat("x", 3<<20))
	d = r.DeadLetterMessage(m, reason)
	if b := decodeDLQ(t, d, DefaultMaxPayload); !b.Truncated || b.TruncatedFields["payload"] != 3<<20 {
		t.Fatalf("huge message: truncated=%v %v", b.Truncated, b.TruncatedFields)
	}
}
