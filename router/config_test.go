package router

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/outbox-relay/outbox-relay/contract"
)

func TestValidateDefaults(t *testing.T) {
	c := Config{Tables: []TableConfig{{Table: "outbox"}}}
	if err := c.Validate(); err != nil {
		t.Fatalf("Validate: %v", err)
	}
	want := Config{
		Tables: []TableConfig{{
			Table:   "public.outbox",
			Subject: DefaultSubject,
			Columns: ColumnsConfig{
				EventID:          "event_id",
				AggregateID:      "aggregate_id",
				AggregateVersion: "aggregate_version",
				EventType:        "event_type",
				Payload:          "payload",
			},
		}},
		DeadLetterSubject: DefaultDeadLetterSubject,
		MaxSubjectBytes:   DefaultMaxSubjectBytes,
	}
	if !reflect.DeepEqual(c, want) {
		t.Fatalf("after Validate:\n got %+v\nwant %+v", c, want)
	}
	// Idempotent: validating again changes nothing.
	again := c
	if err := again.Validate(); err != nil || !reflect.DeepEqual(again, want) {
		t.Fatalf("second Validate: %v, %+v", err, again)
	}
}

func TestValidateExtraHeaderDefaultName(t *testing.T) {
	c := Config{Tables: []TableConfig{{Table: "outbox", Headers: map[string]string{"trace_id": "", "tenant": "X-Tenant"}}}}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if got := c.Tables[0].Headers; got["trace_id"] != "Outbox-Extra-trace_id" || got["tenant"] != "X-Tenant" {
		t.Fatalf("headers after Validate = %v", got)
	}
}

func TestValidateErrors(t *testing.T) {
	ok := func() TableConfig { return TableConfig{Table: "public.outbox"} }
	tests := []struct {
		name string
		cfg  Config
		path string // YAML key path the error must name
		msg  string // and a fragment of its message
	}{
		{"no tables", Config{}, "tables", "no tables"},
		{"empty table name", Config{Tables: []TableConfig{ok(), {Table: ""}}}, "tables[1].table", "is empty"},
		{"table with two dots", Config{Tables: []TableConfig{{Table: "a.b.c"}}}, "tables[0].table", "more than one '.'"},
		{"empty schema", Config{Tables: []TableConfig{{Table: ".outbox"}}}, "tables[0].table", "empty schema or table"},
		{"whitespace table", Config{Tables: []TableConfig{{Table: " outbox"}}}, "tables[0].table", "whitespace"},
		{"duplicate table", Config{Tables: []TableConfig{{Table: "outbox"}, {Table: "public.outbox"}}}, "tables[1].table", "already mapped by tables[0]"},
		{"unknown placeholder", Config{Tables: []TableConfig{ok(), {Table: "b", Subject: "x.{aggregate}"}}},
			"tables[1].subject", "unknown placeholder {aggregate} (use {aggregate_type}, {aggregate_id}, {event_type}, {table}, {schema})"},
		{"unbalanced brace", Config{Tables: []TableConfig{{Table: "t", Subject: "x.{table"}}}, "tables[0].subject", "unbalanced"},
		{"empty token", Config{Tables: []TableConfig{{Table: "t", Subject: "x..{table}"}}}, "tables[0].subject", "empty token"},
		{"leading dot", Config{Tables: []TableConfig{{Table: "t", Subject: ".x.{table}"}}}, "tables[0].subject", "start or end"},
		{"trailing dot", Config{Tables: []TableConfig{{Table: "t", Subject: "x.{table}."}}}, "tables[0].subject", "start or end"},
		{"wildcard in subject", Config{Tables: []TableConfig{{Table: "t", Subject: "x.*.{table}"}}}, "tables[0].subject", "wildcard"},
		{"full wildcard in subject", Config{Tables: []TableConfig{{Table: "t", Subject: "x.>"}}}, "tables[0].subject", "wildcard"},
		{"space in subject", Config{Tables: []TableConfig{{Table: "t", Subject: "x y.{table}"}}}, "tables[0].subject", "whitespace"},
		{"subject overlaps dead letters", Config{Tables: []TableConfig{{Table: "t", Subject: "outbox_dlq.{table}"}}}, "tables[0].subject", "overlap the dead-letter subjects"},
		{"default subject vs outbox.dlq", Config{DeadLetterSubject: "outbox.dlq", Tables: []TableConfig{ok()}}, "tables[0].subject", "overlap"},
		{"subject longer than max", Config{MaxSubjectBytes: 10, Tables: []TableConfig{{Table: "t", Subject: "a-very-long-literal.{table}"}}}, "tables[0].subject", "over max_subject_bytes"},
		{"constant and column aggregate type", Config{Tables: []TableConfig{{Table: "t", AggregateType: "Order", Columns: ColumnsConfig{AggregateType: "kind"}}}},
			"tables[0].aggregate_type", "choose one"},
		{"aggregate type constant with newline", Config{Tables: []TableConfig{{Table: "t", AggregateType: "Or\nder"}}}, "tables[0].aggregate_type", "line break"},
		{"column name too long", Config{Tables: []TableConfig{{Table: "t", Columns: ColumnsConfig{Payload: strings.Repeat("p", 64)}}}}, "tables[0].columns.payload", "longer than 63"},
		{"header collides with contract", Config{Tables: []TableConfig{{Table: "t", Headers: map[string]string{"kind": "outbox-event-type"}}}},
			"tables[0].headers.kind", "collides with the contract header Outbox-Event-Type"},
		{"header in Nats- namespace", Config{Tables: []TableConfig{{Table: "t", Headers: map[string]string{"s": "Nats-Expected-Stream"}}}},
			"tables[0].headers.s", "Nats-"},
		{"invalid header chars", Config{Tables: []TableConfig{{Table: "t", Headers: map[string]string{"x": "X Tenant"}}}}, "tables[0].headers.x", "header name"},
		{"default header name invalid", Config{Tables: []TableConfig{{Table: "t", Headers: map[string]string{"my col": ""}}}}, "tables[0].headers.my col", "set an explicit name"},
		{"duplicate header names", Config{Tables: []TableConfig{{Table: "t", Headers: map[string]string{"a": "X-Tenant", "b": "x-tenant"}}}},
			"tables[0].headers.b", "also mapped from column \"a\""},
		{"empty header column", Config{Tables: []TableConfig{{Table: "t", Headers: map[string]string{"": "X-A"}}}}, "tables[0].headers", "empty column name"},
		{"negative max subject", Config{MaxSubjectBytes: -1, Tables: []TableConfig{ok()}}, "max_subject_bytes", "out of range"},
		{"huge max subject", Config{MaxSubjectBytes: 1 << 20, Tables: []TableConfig{ok()}}, "max_subject_bytes", "max_control_line"},
		{"dead letter wildcard", Config{DeadLetterSubject: "dlq.>", Tables: []TableConfig{ok()}}, "dead_letter_subject", "wildcard"},
		{"dead letter placeholder", Config{DeadLetterSubject: "dlq.{table}", Tables: []TableConfig{ok()}}, "dead_letter_subject", "placeholders"},
		{"dead letter empty token", Config{DeadLetterSubject: "dlq..x", Tables: []TableConfig{ok()}}, "dead_letter_subject", "empty token"},
		{"dead letter reserved", Config{DeadLetterSubject: "$SYS.dlq", Tables: []TableConfig{ok()}}, "dead_letter_subject", "reserves"},
		{"dead letter too long", Config{DeadLetterSubject: strings.Repeat("d", 3700), Tables: []TableConfig{ok()}}, "dead_letter_subject", "shorten"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			if !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("Validate = %v, want ErrInvalidConfig", err)
			}
			var ce *ConfigError
			if !errors.As(err, &ce) {
				t.Fatalf("Validate = %v, want a *ConfigError", err)
			}
			if ce.Path != tt.path {
				t.Fatalf("error path = %q, want %q (error: %v)", ce.Path, tt.path, err)
			}
			if !strings.Contains(err.Error(), tt.path+": ") || !strings.Contains(ce.Msg, tt.msg) {
				t.Fatalf("error = %q, want %q and %q", err, tt.path, tt.msg)
			}
			if _, err := New(tt.cfg); !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("New = %v, want ErrInvalidConfig", err)
			}
		})
	}
}

func TestValidateReportsEveryError(t *testing.T) {
	c := Config{Tables: []TableConfig{{Table: ""}, {Table: "t", Subject: "x.{nope}"}}}
	err := c.Validate()
	for _, p := range []string{"tables[0].table: ", "tables[1].subject: "} {
		if err == nil || !strings.Contains(err.Error(), p) {
			t.Errorf("Validate = %v, want it to mention %s", err, p)
		}
	}
}

func TestNewDoesNotModifyCallerConfig(t *testing.T) {
	hdr := map[string]string{"trace_id": ""}
	c := Config{Tables: []TableConfig{{Table: "outbox", Headers: hdr}}}
	if _, err := New(c); err != nil {
		t.Fatal(err)
	}
	if c.Tables[0].Table != "outbox" || c.Tables[0].Subject != "" || hdr["trace_id"] != "" {
		t.Fatalf("New modified its argument: %+v %v", c, hdr)
	}
}

func TestSubjectFilters(t *testing.T) {
	c := Config{Tables: []TableConfig{
		{Table: "a"},
		{Table: "b", Subject: "outbox.{table}.{aggregate_id}"}, // same filter as a
		{Table: "c", Subject: "events.{event_type}"},
		{Table: "d", Subject: "events.created"}, // inside events.*
		{Table: "e", Subject: "x.{aggregate}"},  // invalid: skipped
	}}
	want := []string{"outbox.*.*", "events.*"}
	if got := c.SubjectFilters(); !reflect.DeepEqual(got, want) {
		t.Fatalf("SubjectFilters = %q, want %q", got, want)
	}
	if got := c.DeadLetterFilter(); got != "outbox_dlq.>" {
		t.Fatalf("DeadLetterFilter = %q", got)
	}
}

func TestConfigYAML(t *testing.T) {
	const doc = `
dead_letter_subject: dead
max_subject_bytes: 512
tables:
  - table: billing.outbox
    subject: billing.{event_type}.{aggregate_id}
    aggregate_type: Invoice
    columns:
      event_id: id
      aggregate_id: invoice_id
      aggregate_version: seq
      event_type: kind
      payload: body
      occurred_at: created_at
    headers:
      trace_id: Trace-Id
`
	var c Config
	if err := yaml.Unmarshal([]byte(doc), &c); err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	tc := c.Tables[0]
	if c.DeadLetterSubject != "dead" || c.MaxSubjectBytes != 512 || tc.AggregateType != "Invoice" ||
		tc.Columns != (ColumnsConfig{EventID: "id", AggregateID: "invoice_id", AggregateVersion: "seq", EventType: "kind", Payload: "body", OccurredAt: "created_at"}) ||
		tc.Headers["trace_id"] != "Trace-Id" {
		t.Fatalf("decoded %+v", c)
	}
}

func FuzzValidate(f *testing.F) {
	f.Add("public.outbox", DefaultSubject, "", "col", "", "")
	f.Add("a.b", "x.{table}", "T", "c", "X-C", "dlq")
	f.Fuzz(func(t *testing.T, table, subject, aggType, hdrCol, hdrName, dlq string) {
		c := Config{
			DeadLetterSubject: dlq,
			Tables: []TableConfig{{
				Table: table, Subject: subject, AggregateType: aggType,
				Headers: map[string]string{hdrCol: hdrName},
			}},
		}
		err := c.Validate()
		if err != nil {
			var ce *ConfigError
			if !errors.Is(err, ErrInvalidConfig) || !errors.As(err, &ce) || ce.Path == "" {
				t.Fatalf("Validate = %v: not a ConfigError with a path", err)
			}
			return
		}
		if _, err := New(c); err != nil {
			t.Fatalf("New after a successful Validate: %v", err)
		}
		for _, f := range c.SubjectFilters() {
			if contract.FiltersOverlap(f, c.DeadLetterFilter()) {
				t.Fatalf("event filter %q overlaps %q", f, c.DeadLetterFilter())
			}
		}
	})
}
