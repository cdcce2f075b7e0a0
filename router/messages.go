package router

import (
	"fmt"
	"regexp"
)

// MessageConfig maps the logical messages of one pg_logical_emit_message
// prefix: table-less events, each message's content an outbox envelope
// (outbox.Envelope) whose fields have fixed names, so there are no columns
// to name or map to headers. Their Outbox-Table is MessageTable(Prefix).
type MessageConfig struct {
	// Prefix is the prefix passed to pg_logical_emit_message: 1-63
	// letters, digits, _ or -.
	Prefix string `yaml:"prefix"`
	// Subject is the subject template, as TableConfig.Subject; {schema}
	// is MessageSchema and {table} the prefix. Default DefaultSubject.
	Subject string `yaml:"subject"`
	// AggregateType, when set, is the aggregate type of every message of
	// the prefix, whatever its envelope says.
	AggregateType string `yaml:"aggregate_type"`
	// CloudEvents adds CloudEvents binary-mode headers, as
	// TableConfig.CloudEvents; the default source is
	// DefaultCloudEventsSourcePrefix + MessageTable(Prefix).
	CloudEvents CloudEventsConfig `yaml:"cloudevents"`
}

// MessageTable returns the Outbox-Table header value, and the dead-letter
// record's table, of a prefix's events: MessageSchema.<prefix>.
func MessageTable(prefix string) string { return MessageSchema + "." + prefix }

// MessagePrefixes returns the configured message prefixes, in order.
func (c *Config) MessagePrefixes() []string {
	out := make([]string, 0, len(c.Messages))
	for _, m := range c.Messages {
		out = append(out, m.Prefix)
	}
	return out
}

// prefixRE is what the relay accepts as a prefix: PostgreSQL accepts any
// string, but the prefix becomes {table} of subjects and part of the
// Outbox-Table header.
var prefixRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,63}$`)

// compileMessages turns each MessageConfig into the rule RouteEnvelope
// uses, with the table steps that apply to an envelope (the subject, the
// aggregate type, CloudEvents) and the defaults written back to c.
func (c *Config) compileMessages(fail func(path, format string, args ...any), dlqOK bool, dlqFilter string) map[string]*tableRule {
	rules := make(map[string]*tableRule, len(c.Messages))
	seen := make(map[string]bool, len(c.Messages))
	for i := range c.Messages {
		m := &c.Messages[i]
		path := fmt.Sprintf("messages[%d]", i)
		switch {
		case !prefixRE.MatchString(m.Prefix):
			fail(path+".prefix", "%q is not a valid prefix: use 1-63 letters, digits, _ or - (the prefix passed to pg_logical_emit_message)", m.Prefix)
			continue
		case seen[m.Prefix]:
			fail(path+".prefix", "%q is mapped twice", m.Prefix)
			continue
		}
		seen[m.Prefix] = true
		// The envelope's fields stand in for the default columns.
		tc := TableConfig{Subject: m.Subject, AggregateType: m.AggregateType, CloudEvents: m.CloudEvents}
		r := &tableRule{path: path, schema: MessageSchema, name: m.Prefix, qualified: MessageTable(m.Prefix)}
		r.schemaB, r.nameB = []byte(r.schema), []byte(r.name)
		t := &tableCompiler{c: c, tc: &tc, r: r, fail: fail, ok: true}
		t.subject(dlqOK, dlqFilter)
		t.columns()
		t.aggregateType()
		t.headers()
		t.cloudEvents()
		m.Subject, m.CloudEvents = tc.Subject, tc.CloudEvents
		if t.ok {
			rules[m.Prefix] = r
		}
	}
	return rules
}
