package router

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/replication"
)

// Message is an outbox row routed to NATS. Its strings and Data are copies:
// they stay valid after the decoder reuses the row's buffers.
type Message struct {
	// Subject is the rendered subject template.
	Subject string
	// Header holds the contract headers and the mapped extra columns.
	Header nats.Header
	// Data is the payload column's text exactly as PostgreSQL sent it.
	Data []byte
	// EventID is the event id, also the Nats-Msg-Id header.
	EventID string
	// Key is the ordering key: aggregate type + "\x00" + aggregate id. The
	// publisher keeps the messages of one key in order. Dead-letter records
	// have no key: they need no order among themselves.
	Key string
	// Table is the row's schema-qualified table.
	Table string
	// LSN and Ordinal are the row's change LSN and its position among the
	// changes sharing it (replication.Insert); DeadLetterMessage derives
	// the record's de-duplication id from them when the event id cannot
	// serve.
	LSN     replication.LSN
	Ordinal uint32
	// Commit is the commit of the transaction that inserted the row.
	Commit CommitInfo
	// HeaderLen is the encoded size of Header on the wire ("NATS/1.0"
	// line, one line per value, closing blank line), so that no one needs
	// to walk the map to learn it.
	HeaderLen int

	// vals backs the header values, reused with the message (Release);
	// shape says which keys Header maps to which slot of vals.
	vals  []string
	shape hdrShape
}

// hdrShape identifies the header keys of a routed message and their slots
// in its vals: the routing plan (table and relation version) and which
// optional headers (bit 0: occurred_at, bit i+1: the i-th extra column) the
// row had.
type hdrShape struct {
	plan *plan
	bits uint64
}

// CommitInfo identifies the commit of the transaction an outbox row belongs
// to.
type CommitInfo struct {
	LSN  replication.LSN
	Time time.Time
}

// Router maps outbox rows to NATS messages. Route keeps a per-relation cache
// and a scratch buffer, so it must be called from one goroutine at a time;
// Handles, DeadLetter, DeadLetterMessage and Release are safe for concurrent
// use.
type Router struct {
	rules      map[relKey]*tableRule
	dlqSubject string
	maxSubject int
	maxPayload int

	// plans caches one compiled plan per relation id; a plan whose pointer
	// differs from the row's relation is stale (ALTER TABLE) and rebuilt.
	plans map[uint32]*plan
	last  *plan
	buf   []byte

	// The commit strings are the same for every row of a transaction.
	commit                  CommitInfo
	commitLSNs, commitTimes string

	// free holds released messages: their header maps, header value
	// slices and payload buffers are what Route would otherwise allocate
	// for every row (a header map of ten entries alone is four allocations).
	free sync.Pool
}

type relKey struct{ schema, name string }

// New validates cfg (a deep copy: the caller's maps are not modified) and
// returns a Router for it. Options: WithMaxPayload (default
// DefaultMaxPayload). Errors wrap ErrInvalidConfig or ErrInvalidOption.
func New(cfg Config, opts ...Option) (*Router, error) {
	o := options{maxPayload: DefaultMaxPayload}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return nil, err
		}
	}
	cfg.Tables = slices.Clone(cfg.Tables)
	for i := range cfg.Tables {
		if h := cfg.Tables[i].Headers; h != nil {
			cp := make(map[string]string, len(h))
			for k, v := range h {
				cp[k] = v
			}
			cfg.Tables[i].Headers = cp
		}
	}
	rules, err := cfg.compile()
	if err != nil {
		return nil, err
	}
	r := &Router{
		rules:      make(map[relKey]*tableRule, len(rules)),
		dlqSubject: cfg.DeadLetterSubject,
		maxSubject: cfg.MaxSubjectBytes,
		maxPayload: o.maxPayload,
		plans:      make(map[uint32]*plan),
	}
	for _, rule := range rules {
		r.rules[relKey{rule.schema, rule.name}] = rule
	}
	return r, nil
}

// Handles reports whether rel's table is in the configuration.
func (r *Router) Handles(rel *replication.Relation) bool {
	return rel != nil && r.rules[relKey{rel.Namespace, rel.Name}] != nil
}

// plan is a tableRule resolved against one relation: column positions are
// looked up once per relation, not once per row.
type plan struct {
	rel  *replication.Relation
	rule *tableRule
	// err is set when a configured column is missing; every row fails with
	// a copy of it until the table changes again.
	err *RouteError

	eventID, aggID, version, eventType, payload int
	aggType, occurredAt                         int // -1: not in the table
	extras                                      []planExtra
}

type planExtra struct {
	idx    int
	column string
	header string
}

func (r *Router) planFor(rel *replication.Relation) *plan {
	if p := r.last; p != nil && p.rel == rel {
		return p
	}
	if p := r.plans[rel.ID]; p != nil && p.rel == rel {
		r.last = p
		return p
	}
	p := &plan{rel: rel, rule: r.rules[relKey{rel.Namespace, rel.Name}]}
	if p.rule != nil {
		p.compile()
	}
	r.plans[rel.ID] = p
	r.last = p
	return p
}

func (p *plan) compile() {
	rule, rel := p.rule, p.rel
	missing := func(column, key string) int {
		i := rel.ColumnIndex(column)
		if i < 0 && p.err == nil {
			p.err = &RouteError{
				Table:  rule.qualified,
				Column: column,
				Class:  ClassMissingColumn,
				Reason: fmt.Sprintf("the table has no column %q (dropped or renamed? restore it or fix %s.%s)", column, rule.path, key),
			}
		}
		return i
	}
	p.eventID = missing(rule.eventID, "columns.event_id")
	p.aggID = missing(rule.aggID, "columns.aggregate_id")
	p.version = missing(rule.version, "columns.aggregate_version")
	p.eventType = missing(rule.eventType, "columns.event_type")
	p.payload = missing(rule.payload, "columns.payload")
	p.aggType, p.occurredAt = -1, -1
	if rule.aggTypeCol != "" {
		if rule.aggTypeExplicit {
			p.aggType = missing(rule.aggTypeCol, "columns.aggregate_type")
		} else {
			p.aggType = rel.ColumnIndex(rule.aggTypeCol)
		}
	}
	if rule.occurredExplicit {
		p.occurredAt = missing(rule.occurredCol, "columns.occurred_at")
	} else {
		p.occurredAt = rel.ColumnIndex(rule.occurredCol)
	}
	for _, e := range rule.extras {
		p.extras = append(p.extras, planExtra{
			idx:    missing(e.column, "headers."+e.column),
			column: e.column,
			header: e.header,
		})
	}
	p.compileTrace(missing)
}

// maxKeptScratch is the largest scratch buffer Route keeps between rows.
const maxKeptScratch = 64 << 10

// fixedHeaders is the number of headers every event carries.
const fixedHeaders = 10

// hdrOverhead is the encoded size of a header block without its lines
// ("NATS/1.0\r\n" and the final "\r\n"); each line adds name, ": ", value,
// "\r\n". This is what nats.go sends and what the server counts against
// max_payload.
const hdrOverhead = len("NATS/1.0\r\n") + len("\r\n")

func hdrLineLen(name string, valueLen int) int { return len(name) + 2 + valueLen + 2 }

// The fixed part of the header block: names and separators of the headers
// every event has, plus the constant Content-Type value.
var fixedHdrLen = hdrOverhead +
	hdrLineLen(contract.MsgID, 0) + hdrLineLen(contract.EventID, 0) +
	hdrLineLen(contract.EventType, 0) + hdrLineLen(contract.AggregateType, 0) +
	hdrLineLen(contract.AggregateID, 0) + hdrLineLen(contract.AggregateVersion, 0) +
	hdrLineLen(contract.CommitLSN, 0) + hdrLineLen(contract.CommitTime, 0) +
	hdrLineLen(contract.Table, 0) + hdrLineLen(contract.ContentType, len(contract.JSONContentType))

// MaxHeaderBytes is the largest header block JetStream stores: a longer
// one is refused for good (error 10097, "header size exceeds maximum
// allowed of 64k"), even when the message is within max_payload.
const MaxHeaderBytes = 1<<16 - 1

// Offsets of the parts of Route's scratch buffer, which becomes one string.
const (
	partSubject = iota
	partKey
	partEventID
	partEventType
	partAggType
	partAggID
	partVersion
	partOccurredAt
	partCESubject
	numParts
)

// Route maps an inserted outbox row to a message. commit is the commit of
// the row's transaction. Every error is a *RouteError wrapping
// ErrUnroutable: routing the row again cannot succeed, so the caller
// dead-letters it with DeadLetter.
func (r *Router) Route(ins *replication.Insert, commit CommitInfo) (*Message, error) {
	rel := ins.Relation
	if rel == nil {
		return nil, &RouteError{Class: ClassUnknownTable, Reason: "the row has no relation (a decoder bug)"}
	}
	p := r.planFor(rel)
	if p.rule == nil {
		return nil, &RouteError{
			Table:  rel.QualifiedName(),
			Class:  ClassUnknownTable,
			Reason: "the table is not in the router configuration (add it to tables, or remove it from the publication)",
		}
	}
	rule := p.rule
	if p.err != nil {
		e := *p.err
		return nil, &e
	}
	rd := rowReader{rule: rule, vals: ins.Values, rel: rel}

	// Required fields, in a fixed order so a row's error class is stable.
	eventID, ok := rd.text(p.eventID, true)
	if ok && len(eventID) == 0 {
		rd.fail(p.eventID, ClassInvalidField, "the event id is empty")
	}
	rd.headerSafe(p.eventID, eventID)
	if rd.err == nil {
		// Later errors carry the event id into the dead-letter record.
		rd.eventID = eventID
	}
	aggID, _ := rd.text(p.aggID, true)
	rd.headerSafe(p.aggID, aggID)
	versionText, ok := rd.text(p.version, true)
	version, vok := parseInt64(versionText)
	if ok && !vok {
		rd.fail(p.version, ClassInvalidField, "aggregate version "+quoteValue(versionText)+" is not a decimal int64")
	}
	eventType, ok := rd.text(p.eventType, true)
	if ok && len(eventType) == 0 {
		rd.fail(p.eventType, ClassInvalidField, "the event type is empty")
	}
	rd.headerSafe(p.eventType, eventType)

	// Aggregate type: the constant, else the column, else (absent, NULL or
	// empty) the table name.
	aggType := rule.aggTypeConstB
	if len(aggType) == 0 && p.aggType >= 0 {
		aggType, _ = rd.text(p.aggType, false)
		rd.headerSafe(p.aggType, aggType)
	}
	if len(aggType) == 0 {
		aggType = rule.nameB
	}

	payload, _ := rd.text(p.payload, true)

	var occurredAt time.Time
	hasOccurred := false
	if p.occurredAt >= 0 {
		if b, ok := rd.text(p.occurredAt, false); ok && b != nil {
			t, err := parseTimestamp(b)
			if err != nil {
				rd.fail(p.occurredAt, ClassInvalidField, "occurred_at "+quoteValue(b)+" "+err.Error())
			}
			occurredAt, hasOccurred = t, true
		}
	}

	nHeaders := fixedHeaders
	extraLen := 0
	shape := hdrShape{plan: p}
	if hasOccurred {
		shape.bits = 1
	}
	if len(p.extras) > 63 {
		shape.plan = nil // too many optional headers to tell apart: never reused
	}
	for i, e := range p.extras {
		b, ok := rd.text(e.idx, false)
		if !ok || b == nil {
			continue
		}
		shape.bits |= 2 << i
		rd.headerSafe(e.idx, b)
		nHeaders++
		extraLen += hdrLineLen(e.header, len(b))
	}
	if rd.err != nil {
		return nil, rd.err
	}

	// Every size is checked before anything is copied, so an oversized row
	// costs a scan, never a large scratch buffer.
	var phv [numPlaceholders][]byte
	phv[phAggregateType] = aggType
	phv[phAggregateID] = aggID
	phv[phEventType] = eventType
	phv[phTable] = rule.nameB
	phv[phSchema] = rule.schemaB
	subjectLen := rule.tmpl.renderedLen(&phv)
	if subjectLen > r.maxSubject {
		return nil, &RouteError{
			Table: rule.qualified, Class: ClassSubjectTooLong, EventID: rd.eventIDString(),
			Reason: fmt.Sprintf("the subject would be %d bytes, over max_subject_bytes %d (shorten the values or the subject template of %s)", subjectLen, r.maxSubject, rule.path),
		}
	}
	var verBuf [20]byte
	versionStr := strconv.AppendInt(verBuf[:0], version, 10)
	var tsBuf [40]byte
	occurredStr := tsBuf[:0]
	if hasOccurred {
		occurredStr = occurredAt.AppendFormat(occurredStr, time.RFC3339Nano)
		extraLen += hdrLineLen(contract.OccurredAt, len(occurredStr))
		nHeaders++
	}
	ce := rule.ceSource != ""
	if ce {
		nHeaders += ceFixedHeaders
		extraLen += ceFixedHdrLen + len(rule.ceSource) + len(eventID) + len(eventType) + len(aggType) + len(aggID) + len(versionStr)
		if hasOccurred {
			extraLen += hdrLineLen(contract.CETime, len(occurredStr))
			nHeaders++
		}
	}
	lsnStr, timeStr := r.commitStrings(commit)
	hdrLen := fixedHdrLen + extraLen + 2*len(eventID) + len(eventType) + len(aggType) + len(aggID) +
		len(versionStr) + len(lsnStr) + len(timeStr) + len(rule.qualified)
	if total := hdrLen + len(payload); total > r.maxPayload {
		return nil, &RouteError{
			Table: rule.qualified, Class: ClassTooLarge, EventID: rd.eventIDString(),
			Subject: string(rule.tmpl.render(nil, &phv)),
			Reason: fmt.Sprintf("the message would be %d bytes (payload %d + headers %d), over the NATS max payload %d (make the event smaller or raise max_payload)",
				total, len(payload), hdrLen, r.maxPayload),
		}
	}
	if hdrLen > MaxHeaderBytes {
		// Checked here, not left to the broker: a message it refuses
		// would hold its key (and, in a batch, the whole stream) until it
		// is dead-lettered.
		return nil, &RouteError{
			Table: rule.qualified, Class: ClassHeaderTooLarge, EventID: rd.eventIDString(),
			Subject: string(rule.tmpl.render(nil, &phv)),
			Reason: fmt.Sprintf("the headers would be %d bytes, over JetStream's limit of %d (shorten the event type, event id or mapped header columns)",
				hdrLen, MaxHeaderBytes),
		}
	}

	// One scratch buffer becomes one string; every string field is a slice
	// of it.
	var off [numParts + 1]int
	buf := r.buf[:0]
	off[partSubject] = len(buf)
	buf = rule.tmpl.render(buf, &phv)
	off[partKey] = len(buf)
	buf = append(buf, aggType...)
	buf = append(buf, 0)
	buf = append(buf, aggID...)
	off[partEventID] = len(buf)
	buf = append(buf, eventID...)
	off[partEventType] = len(buf)
	buf = append(buf, eventType...)
	off[partAggType] = len(buf)
	buf = append(buf, aggType...)
	off[partAggID] = len(buf)
	buf = append(buf, aggID...)
	off[partVersion] = len(buf)
	buf = append(buf, versionStr...)
	off[partOccurredAt] = len(buf)
	buf = append(buf, occurredStr...)
	off[partCESubject] = len(buf)
	if ce {
		buf = append(buf, aggType...)
		buf = append(buf, '/')
		buf = append(buf, aggID...)
	}
	off[numParts] = len(buf)
	extrasStart := len(buf)
	for _, e := range p.extras {
		if b, _ := rd.text(e.idx, false); b != nil {
			buf = append(buf, b...)
		}
	}
	if cap(buf) <= maxKeptScratch {
		r.buf = buf
	} else {
		// A rare large row must not pin its size for the relay's lifetime.
		r.buf = nil
	}

	s := string(buf)
	part := func(i int) string { return s[off[i]:off[i+1]] }
	eventIDStr := part(partEventID)
	m, _ := r.free.Get().(*Message)
	if m == nil {
		m = &Message{}
	}
	h := m.Header
	// A recycled message filled by a row of the same shape already maps
	// every key to its slot in vals: writing vals is enough, and Route
	// skips eleven map assignments (a string hash each), a tenth of its
	// time. The shape's plan cannot be a new plan at a reused address:
	// the message itself keeps its plan alive. Otherwise the map is overwritten, not cleared: rows
	// of one table set the same keys, and clearing cost as much as routing
	// the rest of the row. Should it hold a key this row lacks (another
	// table's extra column, an absent occurred_at), the count tells and it
	// is filled afresh.
	reuse := h != nil && shape.plan != nil && m.shape == shape && len(h) == nHeaders && cap(m.vals) >= nHeaders
	if h == nil {
		h = make(nats.Header, nHeaders)
	}
	if cap(m.vals) < nHeaders {
		m.vals = make([]string, nHeaders)
	}
	vals := m.vals[:nHeaders]
	n := 0
	set := func(k, v string) {
		vals[n] = v
		if !reuse {
			h[k] = vals[n : n+1 : n+1]
		}
		n++
	}
	fill := func() {
		n = 0
		set(contract.MsgID, eventIDStr)
		set(contract.EventID, eventIDStr)
		set(contract.EventType, part(partEventType))
		set(contract.AggregateType, part(partAggType))
		set(contract.AggregateID, part(partAggID))
		set(contract.AggregateVersion, part(partVersion))
		if hasOccurred {
			set(contract.OccurredAt, part(partOccurredAt))
		}
		set(contract.CommitLSN, lsnStr)
		set(contract.CommitTime, timeStr)
		set(contract.Table, rule.qualified)
		set(contract.ContentType, contract.JSONContentType)
		if ce {
			// Shared strings, no formatting: CloudEvents mode costs eight
			// header slots per row, and the subject's bytes.
			set(contract.CESpecVersion, contract.CESpecVersionValue)
			set(contract.CEID, eventIDStr)
			set(contract.CESource, rule.ceSource)
			set(contract.CEType, part(partEventType))
			set(contract.CESubject, part(partCESubject))
			set(contract.CEAggregateVersion, part(partVersion))
			set(contract.CEContentType, contract.JSONContentType)
			if hasOccurred {
				set(contract.CETime, part(partOccurredAt))
			}
		}
		pos := extrasStart
		for _, e := range p.extras {
			if b, _ := rd.text(e.idx, false); b != nil {
				set(e.header, s[pos:pos+len(b)])
				pos += len(b)
			}
		}
	}
	fill()
	if !reuse && len(h) != n {
		clear(h)
		fill()
	}

	data := m.Data[:0]
	if data == nil || cap(data) > maxKeptScratch {
		// Never nil: an empty payload is not a NULL one.
		data = make([]byte, 0, len(payload))
	}
	*m = Message{
		Subject:   part(partSubject),
		Header:    h,
		Data:      append(data, payload...),
		EventID:   eventIDStr,
		Key:       s[off[partKey]:off[partEventID]],
		Table:     rule.qualified,
		LSN:       ins.LSN,
		Ordinal:   ins.Ordinal,
		Commit:    commit,
		HeaderLen: hdrLen,
		vals:      vals,
		shape:     shape,
	}
	return m, nil
}

// Release hands m back for reuse by a later Route: its header map, header
// values and payload buffer are overwritten then. Call it only when nothing
// reads m, its Header or its Data any more, for example from the
// publisher's Done callback, which runs after every publish attempt has
// returned. Its Header must still hold what Route put there: do not release
// a message whose header map was changed (the next Route writes the values
// into the slots the keys already map to). Releasing is optional (an
// unreleased message is garbage collected) and safe for concurrent use
// with Route.
func (r *Router) Release(m *Message) {
	if m == nil {
		return
	}
	for i := range m.vals {
		m.vals[i] = "" // do not pin the row's strings while pooled
	}
	*m = Message{Header: m.Header, Data: m.Data[:0], vals: m.vals, shape: m.shape}
	r.free.Put(m)
}

// commitStrings returns the commit LSN and time headers, formatting them
// once per transaction.
func (r *Router) commitStrings(c CommitInfo) (lsn, ts string) {
	if r.commitLSNs == "" || c.LSN != r.commit.LSN || !c.Time.Equal(r.commit.Time) {
		r.commit = c
		r.commitLSNs, r.commitTimes = formatCommit(c)
	}
	return r.commitLSNs, r.commitTimes
}

func formatCommit(c CommitInfo) (lsn, ts string) {
	return c.LSN.String(), c.Time.UTC().Format(time.RFC3339Nano)
}

// rowReader reads a row's column texts, keeping the first error.
type rowReader struct {
	rule    *tableRule
	rel     *replication.Relation
	vals    []replication.Value
	err     *RouteError
	eventID []byte // set once the event id is known to be valid
}

// eventIDString returns the event id for an error, "" when unknown.
func (rd *rowReader) eventIDString() string { return string(rd.eventID) }

func (rd *rowReader) fail(idx int, class, reason string) {
	if rd.err != nil {
		return
	}
	col := ""
	if idx >= 0 && idx < len(rd.rel.Columns) {
		col = rd.rel.Columns[idx].Name
	}
	rd.err = &RouteError{Table: rd.rule.qualified, Column: col, Class: class, Reason: reason, EventID: rd.eventIDString()}
}

// text returns column idx's text. A NULL returns (nil, true) unless
// required; binary and unchanged values are errors, since only the text
// form has a defined meaning here. ok is false after an error.
func (rd *rowReader) text(idx int, required bool) (b []byte, ok bool) {
	if idx < 0 || idx >= len(rd.vals) {
		rd.fail(idx, ClassInvalidField, fmt.Sprintf("the row has %d values but the table %d columns", len(rd.vals), len(rd.rel.Columns)))
		return nil, false
	}
	v := rd.vals[idx]
	switch v.Kind {
	case replication.ValueText:
		if v.Data == nil {
			// Keep NULL (nil) apart from the empty string.
			return []byte{}, true
		}
		return v.Data, true
	case replication.ValueNull:
		if required {
			rd.fail(idx, ClassNullField, "the value is NULL but the field is required")
			return nil, false
		}
		return nil, true
	case replication.ValueBinary:
		rd.fail(idx, ClassInvalidField, "the value was sent in binary format; the relay reads text (do not enable the publication's binary option)")
	default:
		rd.fail(idx, ClassInvalidField, "the value was sent as an unchanged TOAST pointer, which an inserted row cannot have")
	}
	return nil, false
}

// headerSafe fails the row when b cannot travel unchanged in a header.
func (rd *rowReader) headerSafe(idx int, b []byte) {
	if rd.err != nil || b == nil {
		return
	}
	if msg := checkHeaderValue(b); msg != "" {
		rd.fail(idx, ClassInvalidField, "value "+quoteValue(b)+" "+msg)
	}
}

// quoteValue quotes a column value for an error message, cut to 64 bytes
// so a huge value cannot bloat errors, logs and dead-letter headers.
func quoteValue(b []byte) string {
	const max = 64
	if len(b) <= max {
		return strconv.Quote(string(b))
	}
	cut := max
	for cut > 0 && !utf8.RuneStart(b[cut]) {
		cut--
	}
	return strconv.Quote(string(b[:cut])) + fmt.Sprintf("... (%d bytes)", len(b))
}

// parseInt64 parses an optionally negative decimal int64 without
// allocating (strconv.ParseInt would need a string).
func parseInt64(b []byte) (int64, bool) {
	neg := len(b) > 0 && b[0] == '-'
	if neg {
		b = b[1:]
	}
	if len(b) == 0 {
		return 0, false
	}
	// Accumulate as a negative number: its range includes math.MinInt64.
	var n int64
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		d := int64(c - '0')
		if n < (math.MinInt64+d)/10 {
			return 0, false
		}
		n = n*10 - d
	}
	if !neg {
		if n == math.MinInt64 {
			return 0, false
		}
		n = -n
	}
	return n, true
}
