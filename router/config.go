package router

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"

	"github.com/outbox-relay/outbox-relay/contract"
)

// Configuration defaults.
const (
	// DefaultDeadLetterSubject is the dead-letter subject prefix. It is
	// deliberately not under "outbox.": the default event subjects
	// (outbox.*.*) would otherwise overlap the dead-letter subjects, an event
	// of aggregate type "dlq" would land among the dead letters, and
	// JetStream refuses two streams with overlapping subjects.
	DefaultDeadLetterSubject = "outbox_dlq"
	// DefaultMaxSubjectBytes is the default longest subject Route produces.
	DefaultMaxSubjectBytes = 1024
	// MaxMaxSubjectBytes bounds max_subject_bytes: the NATS server's
	// max_control_line (4 KiB by default) limits the whole publish line,
	// subject and reply inbox included.
	MaxMaxSubjectBytes = 4000
	// DefaultSchema is the schema of a table named without one.
	DefaultSchema = "public"
)

// Default column names: the seed's outbox table (sql/outbox.sql).
const (
	DefaultEventIDColumn          = "event_id"
	DefaultAggregateIDColumn      = "aggregate_id"
	DefaultAggregateVersionColumn = "aggregate_version"
	DefaultEventTypeColumn        = "event_type"
	DefaultPayloadColumn          = "payload"
	DefaultAggregateTypeColumn    = "aggregate_type"
	DefaultOccurredAtColumn       = "occurred_at"
)

// maxIdentifierBytes is PostgreSQL's identifier length limit (NAMEDATALEN-1):
// a longer configured name can never match a column or table.
const maxIdentifierBytes = 63

// Config maps outbox tables to NATS subjects and headers. The cmd layer
// embeds it in the YAML configuration file; call Validate (New does) before
// use.
type Config struct {
	// Tables lists the outbox tables the relay publishes; at least one
	// table or message prefix.
	Tables []TableConfig `yaml:"tables"`
	// Messages lists the pg_logical_emit_message prefixes whose messages
	// the relay publishes as table-less events.
	Messages []MessageConfig `yaml:"messages"`
	// DeadLetterSubject prefixes dead-letter subjects: a record for a row of
	// schema.table goes to <DeadLetterSubject>.<EscapeToken("schema.table")>.
	// Default DefaultDeadLetterSubject.
	DeadLetterSubject string `yaml:"dead_letter_subject"`
	// MaxSubjectBytes is the longest subject Route produces; a row whose
	// subject would be longer is dead-lettered (subject_too_long). Default
	// DefaultMaxSubjectBytes, at most MaxMaxSubjectBytes.
	MaxSubjectBytes int `yaml:"max_subject_bytes"`
}

// TableConfig maps one outbox table.
type TableConfig struct {
	// Table is "schema.table", or "table" for public.table. Names are
	// matched exactly as PostgreSQL stores them (unquoted identifiers are
	// lower case).
	Table string `yaml:"table"`
	// Subject is the subject template, default DefaultSubject. Placeholders
	// {aggregate_type}, {aggregate_id}, {event_type}, {table} and {schema}
	// may appear anywhere in a token; their values are escaped with
	// EscapeToken.
	Subject string `yaml:"subject"`
	// AggregateType, when set, is the aggregate type of every row of the
	// table; it excludes Columns.AggregateType.
	AggregateType string `yaml:"aggregate_type"`
	// Columns names the table's columns; empty fields take the defaults.
	Columns ColumnsConfig `yaml:"columns"`
	// Headers maps extra columns to header names; an empty name means
	// contract.ExtraPrefix + column. A NULL value omits the header.
	Headers map[string]string `yaml:"headers"`
	// CloudEvents adds CloudEvents binary-mode headers beside the Outbox-*
	// ones; off by default.
	CloudEvents CloudEventsConfig `yaml:"cloudevents"`
}

// ColumnsConfig names the columns of an outbox table. EventID, AggregateID,
// AggregateVersion, EventType and Payload are required in every row.
type ColumnsConfig struct {
	// EventID is the event id column (default event_id): Nats-Msg-Id, so
	// JetStream drops a re-published event.
	EventID string `yaml:"event_id"`
	// AggregateID is the aggregate id column (default aggregate_id). The
	// empty string is a valid id; NULL is not.
	AggregateID string `yaml:"aggregate_id"`
	// AggregateVersion is the aggregate version column (default
	// aggregate_version), an int64.
	AggregateVersion string `yaml:"aggregate_version"`
	// EventType is the event type column (default event_type), non-empty.
	EventType string `yaml:"event_type"`
	// Payload is the payload column (default payload), published as the
	// message body exactly as PostgreSQL's text output (jsonb text).
	Payload string `yaml:"payload"`
	// AggregateType is the aggregate type column. Empty means "aggregate_type
	// if the table has it": without such a column, or when its value is NULL
	// or empty, the aggregate type is the table name. A column named here
	// must exist in the table.
	AggregateType string `yaml:"aggregate_type"`
	// OccurredAt is the occurrence time column (timestamptz or timestamp).
	// Empty means "occurred_at if the table has it"; without it, or when it
	// is NULL, the Outbox-Occurred-At header is omitted. A column named here
	// must exist in the table.
	OccurredAt string `yaml:"occurred_at"`
	// Traceparent and Tracestate are the W3C trace context columns,
	// published as the traceparent and tracestate headers so that
	// consumers continue the writer's trace. Empty means "traceparent"
	// ("tracestate") if the table has it; a NULL value omits the header;
	// TraceOff ("-") maps none. A column named here must exist in the
	// table.
	Traceparent string `yaml:"traceparent"`
	Tracestate  string `yaml:"tracestate"`
}

// tableRule is a validated TableConfig in the form Route uses.
type tableRule struct {
	path         string // YAML path, e.g. tables[0]
	schema, name string // relation namespace and name
	qualified    string // schema.name
	tmpl         *template

	aggTypeConst string
	// The constant values of placeholders, as bytes for rendering.
	aggTypeConstB, schemaB, nameB []byte
	// Column names; optional columns may be absent from the table unless
	// the configuration named them explicitly.
	eventID, aggID, version, eventType, payload string
	aggTypeCol                                  string
	aggTypeExplicit                             bool
	occurredCol                                 string
	occurredExplicit                            bool
	extras                                      []extraHeader // sorted by header name
	// ceSource is the ce-source value; empty when CloudEvents mode is off.
	ceSource string
	// trace maps the trace context columns (tracecontext.go).
	trace []traceHeader
}

type extraHeader struct {
	column, header string
}

// reservedHeaders are the contract's headers: the relay sets them itself, so
// an extra column must not overwrite one. Compared case-insensitively,
// because consumers in other languages often treat header names so.
var reservedHeaders = []string{
	contract.MsgID, contract.EventID, contract.EventType, contract.AggregateType,
	contract.AggregateID, contract.AggregateVersion, contract.OccurredAt,
	contract.CommitLSN, contract.CommitTime, contract.Table, contract.ContentType,
	contract.DLQReason, contract.DLQReasonClass, contract.DLQLSN,
}

// Validate applies the defaults to c and checks it. Every problem is
// reported, as a *ConfigError naming its YAML key path and wrapping
// ErrInvalidConfig; several are joined with errors.Join. Validate is
// idempotent.
func (c *Config) Validate() error {
	_, _, err := c.compile()
	return err
}

// compile validates c, applying defaults, and returns the table rules and
// the message rules by prefix.
func (c *Config) compile() ([]*tableRule, map[string]*tableRule, error) {
	var errs []error
	fail := func(path, format string, args ...any) {
		errs = append(errs, &ConfigError{Path: path, Msg: fmt.Sprintf(format, args...)})
	}
	dlqOK := c.checkSubjects(fail)
	dlqFilter := c.DeadLetterSubject + ".>"
	if len(c.Tables) == 0 && len(c.Messages) == 0 {
		fail("tables", "no tables configured (add one, e.g. `tables: [{table: public.outbox}]`)")
	}
	rules := make([]*tableRule, 0, len(c.Tables))
	seen := make(map[string]int, len(c.Tables))
	for i := range c.Tables {
		t := &tableCompiler{c: c, tc: &c.Tables[i], r: &tableRule{path: fmt.Sprintf("tables[%d]", i)}, fail: fail, ok: true}
		t.name(i, seen)
		t.subject(dlqOK, dlqFilter)
		t.columns()
		t.aggregateType()
		t.headers()
		t.cloudEvents()
		if t.ok {
			rules = append(rules, t.r)
		}
	}
	msgs := c.compileMessages(fail, dlqOK, dlqFilter)
	if len(errs) > 0 {
		return nil, nil, errors.Join(errs...)
	}
	return rules, msgs, nil
}

// checkSubjects applies the defaults of max_subject_bytes and
// dead_letter_subject and checks them. It reports whether the dead-letter
// subject is valid.
func (c *Config) checkSubjects(fail func(path, format string, args ...any)) (dlqOK bool) {
	if c.MaxSubjectBytes == 0 {
		c.MaxSubjectBytes = DefaultMaxSubjectBytes
	}
	if c.MaxSubjectBytes < 0 || c.MaxSubjectBytes > MaxMaxSubjectBytes {
		fail("max_subject_bytes", "%d is out of range (use 1 to %d; the NATS server's max_control_line limits the publish line)",
			c.MaxSubjectBytes, MaxMaxSubjectBytes)
	}
	if c.DeadLetterSubject == "" {
		c.DeadLetterSubject = DefaultDeadLetterSubject
	}
	if msg := checkLiteralSubject(c.DeadLetterSubject); msg != "" {
		fail("dead_letter_subject", "%s", msg)
		return false
	}
	if n := len(c.DeadLetterSubject) + 1 + maxEscapedTableLen; n > MaxMaxSubjectBytes {
		// Dead-letter subjects are not held to max_subject_bytes (a DLQ
		// record must never fail); their length is bounded here instead.
		fail("dead_letter_subject", "is %d bytes: with an escaped schema.table (up to %d bytes) dead-letter subjects could exceed %d bytes (shorten it)",
			len(c.DeadLetterSubject), maxEscapedTableLen, MaxMaxSubjectBytes)
	}
	return true
}

// tableCompiler turns one TableConfig into a tableRule, one step per
// section of the table's configuration.
type tableCompiler struct {
	c    *Config
	tc   *TableConfig
	r    *tableRule
	fail func(path, format string, args ...any)
	ok   bool // false once an error makes the rule unusable
}

func (t *tableCompiler) bad(key, format string, args ...any) {
	t.fail(t.r.path+key, format, args...)
	t.ok = false
}

// name checks the table name and that no other entry maps it.
func (t *tableCompiler) name(i int, seen map[string]int) {
	tc, r := t.tc, t.r
	switch schema, name, msg := splitTableName(tc.Table); {
	case msg != "":
		t.bad(".table", "%s", msg)
	case schema == MessageSchema:
		t.bad(".table", "%q: %s is the schema of logical messages' events, not of a table (map the prefix under messages, e.g. `messages: [{prefix: %s}]`)", tc.Table, MessageSchema, name)
	default:
		tc.Table = schema + "." + name
		r.schema, r.name, r.qualified = schema, name, tc.Table
		r.schemaB, r.nameB = []byte(schema), []byte(name)
		if j, dup := seen[tc.Table]; dup {
			t.bad(".table", "%s is already mapped by tables[%d] (merge the two entries)", tc.Table, j)
		} else {
			seen[tc.Table] = i
		}
	}
}

// subject parses the subject template.
func (t *tableCompiler) subject(dlqOK bool, dlqFilter string) {
	c, tc, r := t.c, t.tc, t.r
	if tc.Subject == "" {
		tc.Subject = DefaultSubject
	}
	if tmpl, err := parseTemplate(tc.Subject); err != nil {
		t.bad(".subject", "%s", err)
	} else {
		r.tmpl = tmpl
		// Every placeholder expands to at least one byte.
		if minLen := tmpl.renderedLen(&[numPlaceholders][]byte{}); c.MaxSubjectBytes > 0 && minLen > c.MaxSubjectBytes {
			t.bad(".subject", "is at least %d bytes long, over max_subject_bytes %d", minLen, c.MaxSubjectBytes)
		}
		if dlqOK && contract.FiltersOverlap(tmpl.filter, dlqFilter) {
			t.bad(".subject", "subjects %q overlap the dead-letter subjects %q (change the subject or dead_letter_subject)", tmpl.filter, dlqFilter)
		}
	}
}

// columns applies the column defaults.
func (t *tableCompiler) columns() {
	tc, r := t.tc, t.r
	col := &tc.Columns
	for _, f := range []struct {
		key string
		val *string
		def string
	}{
		{"event_id", &col.EventID, DefaultEventIDColumn},
		{"aggregate_id", &col.AggregateID, DefaultAggregateIDColumn},
		{"aggregate_version", &col.AggregateVersion, DefaultAggregateVersionColumn},
		{"event_type", &col.EventType, DefaultEventTypeColumn},
		{"payload", &col.Payload, DefaultPayloadColumn},
		{"aggregate_type", &col.AggregateType, ""},
		{"occurred_at", &col.OccurredAt, ""},
	} {
		if *f.val == "" {
			*f.val = f.def
		}
		if len(*f.val) > maxIdentifierBytes {
			t.bad(".columns."+f.key, "%q is longer than %d bytes, so no PostgreSQL column can have that name", *f.val, maxIdentifierBytes)
		}
	}
	r.eventID, r.aggID, r.version, r.eventType, r.payload = col.EventID, col.AggregateID, col.AggregateVersion, col.EventType, col.Payload
	r.occurredCol, r.occurredExplicit = col.OccurredAt, col.OccurredAt != ""
	if !r.occurredExplicit {
		r.occurredCol = DefaultOccurredAtColumn
	}
}

// aggregateType resolves the aggregate type: a constant, a named column,
// or the optional default column.
func (t *tableCompiler) aggregateType() {
	tc, r, col := t.tc, t.r, &t.tc.Columns
	switch {
	case tc.AggregateType != "" && col.AggregateType != "":
		t.bad(".aggregate_type", "is set together with columns.aggregate_type %q: choose one (a constant for every row, or a column)", col.AggregateType)
	case tc.AggregateType != "":
		if msg := checkHeaderValue(tc.AggregateType); msg != "" {
			t.bad(".aggregate_type", "%q %s", tc.AggregateType, msg)
		}
		r.aggTypeConst, r.aggTypeConstB = tc.AggregateType, []byte(tc.AggregateType)
	case col.AggregateType != "":
		r.aggTypeCol, r.aggTypeExplicit = col.AggregateType, true
	default:
		r.aggTypeCol = DefaultAggregateTypeColumn
	}
}

// headers maps the extra columns, in sorted column order so errors are
// deterministic.
func (t *tableCompiler) headers() {
	tc, r := t.tc, t.r
	cols := make([]string, 0, len(tc.Headers))
	for k := range tc.Headers {
		cols = append(cols, k)
	}
	sort.Strings(cols)
	byName := make(map[string]string, len(cols)) // lower-case header -> column
	for _, column := range cols {
		key := ".headers." + column
		if column == "" {
			t.bad(".headers", "has an empty column name")
			continue
		}
		if len(column) > maxIdentifierBytes {
			t.bad(key, "column name is longer than %d bytes, so no PostgreSQL column can have that name", maxIdentifierBytes)
			continue
		}
		h := tc.Headers[column]
		if h == "" {
			h = contract.ExtraPrefix + column
		}
		if msg := checkHeaderName(h); msg != "" {
			t.bad(key, "header name %q %s", h, msg)
			continue
		}
		if tc.CloudEvents.Enabled && isCEHeader(h) {
			t.bad(key, "header name %q collides with a CloudEvents header, which the relay sets itself with cloudevents.enabled (choose another name)", h)
			continue
		}
		if other, dup := byName[strings.ToLower(h)]; dup {
			t.bad(key, "header %q is also mapped from column %q (header names are compared case-insensitively; rename one)", h, other)
			continue
		}
		byName[strings.ToLower(h)] = column
		tc.Headers[column] = h
		r.extras = append(r.extras, extraHeader{column: column, header: h})
	}
	sort.Slice(r.extras, func(a, b int) bool { return r.extras[a].header < r.extras[b].header })
	r.trace = compileTrace(&tc.Columns, byName, t.bad)
}

// cloudEvents checks the CloudEvents settings.
func (t *tableCompiler) cloudEvents() {
	tc, r := t.tc, t.r
	if ce := &tc.CloudEvents; ce.Enabled {
		if ce.Source == "" && r.qualified != "" {
			ce.Source = DefaultCloudEventsSourcePrefix + r.qualified
		}
		if msg := checkCloudEventsSource(ce.Source); msg != "" {
			t.bad(".cloudevents.source", "%q %s", ce.Source, msg)
		}
		r.ceSource = ce.Source
	} else if ce.Source != "" {
		t.bad(".cloudevents.source", "is set but cloudevents.enabled is false (enable it or remove source)")
	}
}

// maxEscapedTableLen is the longest EscapeToken("schema.table"): two
// 63-byte identifiers and the dot, each byte escaped.
const maxEscapedTableLen = 3 * (2*maxIdentifierBytes + 1)

// QualifiedTable returns a configured table name with its schema: a name
// without one is in DefaultSchema. The one place that default is applied.
func QualifiedTable(name string) string {
	if strings.Contains(name, ".") {
		return name
	}
	return DefaultSchema + "." + name
}

// Clone returns a copy of c that shares nothing mutable with it: its
// table and message lists and every table's header map are copied, so that validating
// or compiling the copy never changes c.
func (c Config) Clone() Config {
	c.Tables = slices.Clone(c.Tables)
	for i := range c.Tables {
		c.Tables[i].Headers = maps.Clone(c.Tables[i].Headers)
	}
	c.Messages = slices.Clone(c.Messages)
	return c
}

// splitTableName parses "schema.table" or "table"; msg explains a bad name.
func splitTableName(s string) (schema, name, msg string) {
	if s == "" {
		return "", "", "is empty (name the outbox table, e.g. public.outbox)"
	}
	if strings.TrimSpace(s) != s {
		return "", "", fmt.Sprintf("%q has leading or trailing whitespace", s)
	}
	schema, name, found := strings.Cut(s, ".")
	if !found {
		schema, name = DefaultSchema, s
	}
	switch {
	case strings.Contains(name, "."):
		return "", "", fmt.Sprintf("%q has more than one '.' (use schema.table)", s)
	case schema == "" || name == "":
		return "", "", fmt.Sprintf("%q has an empty schema or table name (use schema.table or table)", s)
	case len(schema) > maxIdentifierBytes || len(name) > maxIdentifierBytes:
		return "", "", fmt.Sprintf("%q: PostgreSQL names are at most %d bytes", s, maxIdentifierBytes)
	}
	return schema, name, ""
}

// checkLiteralSubject checks a subject without placeholders or wildcards.
func checkLiteralSubject(s string) string {
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '*' || c == '>':
			return fmt.Sprintf("%q contains wildcard %q (give a literal subject; the relay appends .<table>)", s, c)
		case c == '{' || c == '}':
			return fmt.Sprintf("%q contains a brace: placeholders are not supported here", s)
		case c <= ' ' || c == 0x7F:
			return fmt.Sprintf("%q contains whitespace or a control byte", s)
		}
	}
	if strings.HasPrefix(s, ".") || strings.HasSuffix(s, ".") || strings.Contains(s, "..") {
		return fmt.Sprintf("%q has an empty token (no leading, trailing or double dots)", s)
	}
	if strings.HasPrefix(s, "$") {
		return fmt.Sprintf("%q starts with '$', which NATS reserves for system APIs", s)
	}
	return ""
}

// headerKeyByte mirrors nats.go's header key check (printable ASCII except
// `"(),/:;<=>?@[\]{}`); nats.go refuses to publish any other key.
var headerKeyByte = func() (t [256]bool) {
	for c := 33; c <= 126; c++ {
		t[c] = !strings.ContainsRune(`"(),/:;<=>?@[\]{}`, rune(c))
	}
	return t
}()

func checkHeaderName(h string) string {
	for i := 0; i < len(h); i++ {
		if !headerKeyByte[h[i]] {
			return fmt.Sprintf("contains %q: header names are printable ASCII without spaces or any of \"(),/:;<=>?@[\\]{} (set an explicit name)", h[i])
		}
	}
	for _, r := range reservedHeaders {
		if strings.EqualFold(h, r) {
			return fmt.Sprintf("collides with the contract header %s, which the relay sets itself (choose another name, e.g. %sName)", r, contract.ExtraPrefix)
		}
	}
	if len(h) >= 5 && strings.EqualFold(h[:5], "Nats-") {
		return "starts with Nats-: NATS and JetStream act on such headers (e.g. Nats-Expected-Stream), so the relay never maps a column to one"
	}
	return ""
}

// checkHeaderValue reports why a NATS header cannot carry v unchanged:
// nats.go replaces CR and LF with spaces and trims surrounding spaces and
// tabs, and the reader skips leading ones.
func checkHeaderValue[T text](v T) string {
	for i := 0; i < len(v); i++ {
		if v[i] == '\r' || v[i] == '\n' {
			return "contains a line break, which a NATS header cannot carry"
		}
	}
	if len(v) > 0 && (isSpaceTab(v[0]) || isSpaceTab(v[len(v)-1])) {
		return "has leading or trailing whitespace, which a NATS header does not keep"
	}
	return ""
}

func isSpaceTab(c byte) bool { return c == ' ' || c == '\t' }

// SubjectFilters returns the subject filters that match every event subject
// the configured tables can produce: each template token holding a
// placeholder becomes '*'. Duplicates and filters contained in another are
// dropped, so the result can be a stream's subject list as it is. It applies
// the defaults to a copy of c and skips templates Validate would reject.
func (c *Config) SubjectFilters() []string {
	all := make([]string, 0, len(c.Tables)+len(c.Messages))
	subjects := make([]string, 0, cap(all))
	for _, tc := range c.Tables {
		subjects = append(subjects, tc.Subject)
	}
	for _, m := range c.Messages {
		subjects = append(subjects, m.Subject)
	}
	for _, s := range subjects {
		if s == "" {
			s = DefaultSubject
		}
		if t, err := parseTemplate(s); err == nil {
			all = append(all, t.filter)
		}
	}
	var out []string
	for i, f := range all {
		covered := false
		for j, g := range all {
			// Keep the first of equal filters; drop any strictly covered.
			if i != j && contract.FilterCovers(g, f) && (f != g || j < i) {
				covered = true
				break
			}
		}
		if !covered {
			out = append(out, f)
		}
	}
	return out
}

// DeadLetterFilter returns the subject filter matching every dead-letter
// subject: <DeadLetterSubject>.>.
func (c *Config) DeadLetterFilter() string {
	s := c.DeadLetterSubject
	if s == "" {
		s = DefaultDeadLetterSubject
	}
	return s + ".>"
}
