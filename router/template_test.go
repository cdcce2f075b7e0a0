package router

import (
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/contract"
)

func TestParseTemplate(t *testing.T) {
	vals := [numPlaceholders][]byte{
		phAggregateType: []byte("Order"),
		phAggregateID:   []byte("o.42"),
		phEventType:     []byte("Created"),
		phTable:         []byte("outbox"),
		phSchema:        []byte("public"),
	}
	tests := []struct {
		tmpl, subject, filter, err string
	}{
		{tmpl: DefaultSubject, subject: "outbox.Order.o~2E42", filter: "outbox.*.*"},
		{tmpl: "events.{schema}.{table}.{event_type}", subject: "events.public.outbox.Created", filter: "events.*.*.*"},
		{tmpl: "evt-{event_type}.agg:{aggregate_id}", subject: "evt-Created.agg:o~2E42", filter: "*.*"},
		{tmpl: "fixed.subject", subject: "fixed.subject", filter: "fixed.subject"},
		{tmpl: "a.{aggregate_type}:{aggregate_id}", subject: "a.Order:o~2E42", filter: "a.*"},
		{tmpl: "a.{aggregate_type}+x-{aggregate_id}.{event_type}-{table}", err: "share a token"},
		// Regression (issue 16, likely case): types "a-b" and "a" with ids
		// "c" and "b-c" rendered one subject.
		{tmpl: "a.{aggregate_type}-{aggregate_id}", err: "share a token"},
		{tmpl: "a.{aggregate_type}~{aggregate_id}", err: "share a token"},
		{tmpl: "{schema}_{table}", err: "share a token"},
		{tmpl: "", err: "is empty"},
		{tmpl: "outbox.{aggregate}", err: "unknown placeholder {aggregate} (use {aggregate_type}"},
		{tmpl: "outbox.{}", err: "empty placeholder"},
		{tmpl: "outbox.{aggregate_id", err: "unbalanced braces"},
		{tmpl: "outbox.aggregate_id}", err: "unbalanced braces"},
		{tmpl: "outbox.{{aggregate_id}}", err: "unbalanced braces"},
		{tmpl: "outbox.{aggregate.id}", err: "unknown placeholder {aggregate.id}"},
		{tmpl: "outbox.*", err: "wildcard '*'"},
		{tmpl: "outbox.>", err: "wildcard '>'"},
		{tmpl: "out box.{aggregate_id}", err: "whitespace"},
		{tmpl: "outbox.\t", err: "whitespace"},
		{tmpl: ".outbox", err: "start or end with '.'"},
		{tmpl: "outbox.", err: "start or end with '.'"},
		{tmpl: "outbox..{aggregate_id}", err: "empty token"},
		{tmpl: "outbox.{aggregate_type}{aggregate_id}", err: "touch"},
		{tmpl: "$JS.API.{aggregate_id}", err: "reserved"},
	}
	for _, tt := range tests {
		tp, err := parseTemplate(tt.tmpl)
		if tt.err != "" {
			if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Errorf("parseTemplate(%q) error = %v, want it to contain %q", tt.tmpl, err, tt.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("parseTemplate(%q): %v", tt.tmpl, err)
			continue
		}
		if got := string(tp.render(nil, &vals)); got != tt.subject {
			t.Errorf("render(%q) = %q, want %q", tt.tmpl, got, tt.subject)
		}
		if tp.renderedLen(&vals) != len(tt.subject) {
			t.Errorf("renderedLen(%q) = %d, want %d", tt.tmpl, tp.renderedLen(&vals), len(tt.subject))
		}
		if tp.filter != tt.filter {
			t.Errorf("filter(%q) = %q, want %q", tt.tmpl, tp.filter, tt.filter)
		}
	}
}

// checkSubject reports why s is not a valid literal NATS subject.
func checkSubject(s string) string {
	if s == "" {
		return "empty"
	}
	for _, tok := range strings.Split(s, ".") {
		if tok == "" {
			return "empty token"
		}
		if strings.ContainsAny(tok, "*> \t\r\n") {
			return "wildcard or whitespace in token " + tok
		}
	}
	return ""
}

func FuzzParseTemplate(f *testing.F) {
	for _, s := range []string{DefaultSubject, "a.{table}:{schema}.b", "a.{table}-{schema}.b", "{event_type}", "x.{aggregate_id}.y.{aggregate_type}", "{", "}", "a..b", "$x"} {
		f.Add(s, "Order", "id.1", "")
	}
	f.Fuzz(func(t *testing.T, tmpl, aggType, aggID, eventType string) {
		tp, err := parseTemplate(tmpl)
		if err != nil {
			if tp != nil {
				t.Fatal("a template and an error")
			}
			return
		}
		vals := [numPlaceholders][]byte{
			phAggregateType: []byte(aggType),
			phAggregateID:   []byte(aggID),
			phEventType:     []byte(eventType),
			phTable:         []byte("outbox"),
			phSchema:        []byte("public"),
		}
		subject := string(tp.render(nil, &vals))
		if msg := checkSubject(subject); msg != "" {
			t.Fatalf("template %q rendered %q: %s", tmpl, subject, msg)
		}
		if len(subject) != tp.renderedLen(&vals) {
			t.Fatalf("renderedLen = %d, rendered %d bytes", tp.renderedLen(&vals), len(subject))
		}
		if !contract.SubjectMatches(subject, tp.filter) {
			t.Fatalf("filter %q does not match subject %q of template %q", tp.filter, subject, tmpl)
		}
	})
}

// Two placeholders in one token stay injective when a byte no escaped
// value holds separates them: distinct (type, id) pairs never share a
// subject.
func TestTemplateInjective(t *testing.T) {
	values := []string{"", "~", ":", "+", "a", "a-b", "b-c", "c", "a:b", "~3A", "~7E", "a~", "é", "a.b"}
	for _, tmpl := range []string{"x.{aggregate_type}:{aggregate_id}", "{aggregate_type}+{aggregate_id}", "p{aggregate_type}=-{aggregate_id}q"} {
		tp, err := parseTemplate(tmpl)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[string][2]string{}
		for _, a := range values {
			for _, b := range values {
				vals := [numPlaceholders][]byte{phAggregateType: []byte(a), phAggregateID: []byte(b)}
				s := string(tp.render(nil, &vals))
				if prev, ok := seen[s]; ok {
					t.Fatalf("%s: %q and %q both render %q", tmpl, prev, [2]string{a, b}, s)
				}
				seen[s] = [2]string{a, b}
			}
		}
	}
}
