package router

import (
	"fmt"
	"math"
	"strconv"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/replication"
)

// Message is an outbox row routed to NATS. Its strings and Data are copies:
// they stay valid after the decoder reuses the row's buffers.
type Message struct {
	// Subject is the rendered subject template.
	Subject string
	// Header holds the contract headers and the mapped extra columns, each
	// name once; the publisher encodes them (Headers.NATS is the map).
	Header contract.Headers
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
}

// CommitInfo identifies the commit of the transaction an outbox row belongs
// to.
type CommitInfo struct {
	LSN  replication.LSN
	Time time.Time
}

// Router maps outbox rows to NATS messages. Route keeps a per-relation cache
// and a scratch buffer, so it must be called from one goroutine at a time;
// Handles, DeadLetter and DeadLetterMessage are safe for concurrent use.
// Each message Route returns is the caller's: the router never touches it
// again.
type Router struct {
	rules      map[relKey]*tableRule
	messages   map[string]*tableRule // by message prefix
	dlqSubject string
	maxSubject int
	maxPayload int

	// plans caches one compiled plan per relation id; a plan whose pointer
	// differs from the row's relation is stale (ALTER TABLE) and rebuilt.
	plans map[uint32]*plan
	last  *plan
	buf   []byte
	// extras is the scratch list of a row's mapped header columns.
	extras []hdrValue

	// The commit strings are the same for every row of a transaction.
	commit                  CommitInfo
	commitLSNs, commitTimes string

	// traceDropped counts trace context values left off their events
	// (tracecontext.go); read by metrics from other goroutines.
	traceDropped atomic.Uint64
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
	cfg = cfg.Clone()
	rules, msgs, err := cfg.compile()
	if err != nil {
		return nil, err
	}
	r := &Router{
		rules:      make(map[relKey]*tableRule, len(rules)),
		messages:   msgs,
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

// HandlesMessage reports whether logical messages of prefix are in the
// configuration (Config.Messages); others are other applications'.
func (r *Router) HandlesMessage(prefix string) bool { return r.messages[prefix] != nil }

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
	trace  bool // a trace context column: advisory (tracecontext.go)
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
var fixedHeaders = eventHeaders.always

// hdrOverhead is the encoded size of a header block without its lines
// ("NATS/1.0\r\n" and the final "\r\n"); each line adds name, ": ", value,
// "\r\n". This is what nats.go sends and what the server counts against
// max_payload.
const hdrOverhead = len("NATS/1.0\r\n") + len("\r\n")

func hdrLineLen(name string, valueLen int) int { return len(name) + 2 + valueLen + 2 }

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
	partExtras // the extra columns' values, back to back
	numParts
)

// Route maps an inserted outbox row to a message. commit is the commit of
// the row's transaction. Every error is a *RouteError wrapping
// ErrUnroutable: routing the row again cannot succeed, so the caller
// dead-letters it with DeadLetter.
func (r *Router) Route(ins *replication.Insert, commit CommitInfo) (*Message, error) {
	p, err := r.rowPlan(ins.Relation)
	if err != nil {
		return nil, err
	}
	ev := event{lsn: ins.LSN, ordinal: ins.Ordinal, extras: r.extras[:0]}
	defer r.keepExtras(&ev)
	rerr := p.read(ins.Values, &ev)
	if ev.traceDropped > 0 {
		r.traceDropped.Add(uint64(ev.traceDropped))
	}
	if rerr != nil {
		return nil, rerr
	}
	return r.route(p.rule, &ev, commit)
}

// event is one outbox event's fields as read from its source, before any
// limit is checked. The byte slices point into the source's buffers.
type event struct {
	eventID, aggType, aggID, eventType, payload []byte
	version                                     int64
	occurredAt                                  time.Time
	hasOccurred                                 bool
	// extras are the mapped header columns the row has (not NULL), in the
	// plan's order.
	extras  []hdrValue
	lsn     replication.LSN
	ordinal uint32
	// traceDropped is how many trace context values the row had that no
	// header can carry.
	traceDropped int
}

type hdrValue struct {
	name  string
	value []byte
}

// keepExtras keeps ev's extras slice for the next Route without pinning
// the row's buffers.
func (r *Router) keepExtras(ev *event) {
	clear(ev.extras)
	r.extras = ev.extras[:0]
}

// rowPlan returns the routing plan of rel, or why no row of it can be
// routed.
func (r *Router) rowPlan(rel *replication.Relation) (*plan, error) {
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
	if p.err != nil {
		e := *p.err
		return nil, &e
	}
	return p, nil
}

// read reads the event's fields from a row. Fields are checked in a fixed
// order, so that a row's error class is stable; the first error wins.
func (p *plan) read(vals []replication.Value, ev *event) *RouteError {
	rule := p.rule
	rd := rowReader{fieldCheck: fieldCheck{rule: rule}, vals: vals, rel: p.rel}
	eventID, ok := rd.text(p.eventID, true)
	if ok && len(eventID) == 0 {
		rd.fail(p.eventID, ClassInvalidField, "the event id is empty")
	}
	rd.headerSafe(p.eventID, eventID)
	if rd.err == nil {
		// Later errors carry the event id into the dead-letter record.
		rd.eventID = eventID
	}
	ev.eventID = eventID
	ev.aggID, _ = rd.text(p.aggID, true)
	rd.headerSafe(p.aggID, ev.aggID)
	versionText, ok := rd.text(p.version, true)
	version, vok := parseInt64(versionText)
	if ok && !vok {
		rd.fail(p.version, ClassInvalidField, "aggregate version "+quoteValue(versionText)+" is not a decimal int64")
	}
	ev.version = version
	ev.eventType, ok = rd.text(p.eventType, true)
	if ok && len(ev.eventType) == 0 {
		rd.fail(p.eventType, ClassInvalidField, "the event type is empty")
	}
	rd.headerSafe(p.eventType, ev.eventType)

	// Aggregate type: the constant, else the column, else (absent, NULL or
	// empty) the table name.
	ev.aggType = rule.aggTypeConstB
	if len(ev.aggType) == 0 && p.aggType >= 0 {
		ev.aggType, _ = rd.text(p.aggType, false)
		rd.headerSafe(p.aggType, ev.aggType)
	}
	if len(ev.aggType) == 0 {
		ev.aggType = rule.nameB
	}
	ev.payload, _ = rd.text(p.payload, true)
	if p.occurredAt >= 0 {
		if b, ok := rd.text(p.occurredAt, false); ok && b != nil {
			t, err := parseTimestamp(b)
			if err != nil {
				rd.fail(p.occurredAt, ClassInvalidField, "occurred_at "+quoteValue(b)+" "+err.Error())
			}
			ev.occurredAt, ev.hasOccurred = t, true
		}
	}
	for _, e := range p.extras {
		b, ok := rd.text(e.idx, false)
		if !ok || b == nil {
			continue
		}
		if e.trace {
			if b = traceValue(b); b == nil {
				ev.traceDropped++
				continue
			}
		} else {
			rd.headerSafe(e.idx, b)
		}
		ev.extras = append(ev.extras, hdrValue{name: e.header, value: b})
	}
	return rd.err
}

// route checks ev against the limits and builds its message.
func (r *Router) route(rule *tableRule, ev *event, commit CommitInfo) (*Message, error) {
	var l layout
	if err := r.checkLimits(rule, ev, commit, &l); err != nil {
		return nil, err
	}
	return r.build(rule, ev, &l, commit), nil
}

// layout is what checkLimits learns of a message before anything is
// copied: the subject's placeholder values, the formatted numbers and
// times, and the header block's size.
type layout struct {
	phv [numPlaceholders][]byte
	// The aggregate version and occurred_at (empty when the event has
	// none) as header text. Lengths, not slices of the arrays: a struct
	// pointing into itself would escape to the heap.
	verBuf        [20]byte
	tsBuf         [40]byte
	verLen, tsLen int
	lsn, ts       string // the commit headers
	nHeaders      int
	hdrLen        int
	ce            bool
}

func (l *layout) version() []byte  { return l.verBuf[:l.verLen] }
func (l *layout) occurred() []byte { return l.tsBuf[:l.tsLen] }

// checkLimits computes ev's subject and header sizes and refuses a message
// over max_subject_bytes, the max payload or JetStream's header limit.
// Every size is checked before anything is copied, so an oversized row
// costs a scan, never a large scratch buffer.
func (r *Router) checkLimits(rule *tableRule, ev *event, commit CommitInfo, l *layout) *RouteError {
	l.phv[phAggregateType] = ev.aggType
	l.phv[phAggregateID] = ev.aggID
	l.phv[phEventType] = ev.eventType
	l.phv[phTable] = rule.nameB
	l.phv[phSchema] = rule.schemaB
	if n := rule.tmpl.renderedLen(&l.phv); n > r.maxSubject {
		return &RouteError{
			Table: rule.qualified, Class: ClassSubjectTooLong, EventID: string(ev.eventID),
			Reason: fmt.Sprintf("the subject would be %d bytes, over max_subject_bytes %d (shorten the values or the subject template of %s)", n, r.maxSubject, rule.path),
		}
	}
	l.verLen = len(strconv.AppendInt(l.verBuf[:0], ev.version, 10))
	if ev.hasOccurred {
		l.tsLen = len(ev.occurredAt.AppendFormat(l.tsBuf[:0], time.RFC3339Nano))
	}
	l.lsn, l.ts = r.commitStrings(commit)
	lens := [numVals]int{
		vEventID: len(ev.eventID), vEventType: len(ev.eventType), vAggType: len(ev.aggType), vAggID: len(ev.aggID),
		vVersion: l.verLen, vOccurredAt: l.tsLen, vCommitLSN: len(l.lsn), vCommitTime: len(l.ts), vTable: len(rule.qualified),
		vCESource: len(rule.ceSource), vCESubject: len(ev.aggType) + 1 + len(ev.aggID),
	}
	hdrLen, nHeaders := eventHeaders.size(&lens, ev.hasOccurred)
	hdrLen += hdrOverhead
	if l.ce = rule.ceSource != ""; l.ce {
		n, c := cloudEventsHeaders.size(&lens, ev.hasOccurred)
		hdrLen, nHeaders = hdrLen+n, nHeaders+c
	}
	nHeaders += len(ev.extras)
	for _, x := range ev.extras {
		hdrLen += hdrLineLen(x.name, len(x.value))
	}
	if total := hdrLen + len(ev.payload); total > r.maxPayload {
		return &RouteError{
			Table: rule.qualified, Class: ClassTooLarge, EventID: string(ev.eventID),
			Subject: string(rule.tmpl.render(nil, &l.phv)),
			Reason: fmt.Sprintf("the message would be %d bytes (payload %d + headers %d), over the NATS max payload %d (make the event smaller or raise max_payload)",
				total, len(ev.payload), hdrLen, r.maxPayload),
		}
	}
	if hdrLen > MaxHeaderBytes {
		// Checked here, not left to the broker: a message it refuses
		// would hold its key (and, in a batch, the whole stream) until it
		// is dead-lettered.
		return &RouteError{
			Table: rule.qualified, Class: ClassHeaderTooLarge, EventID: string(ev.eventID),
			Subject: string(rule.tmpl.render(nil, &l.phv)),
			Reason: fmt.Sprintf("the headers would be %d bytes, over JetStream's limit of %d (shorten the event type, event id or mapped header columns)",
				hdrLen, MaxHeaderBytes),
		}
	}
	l.nHeaders, l.hdrLen = nHeaders, hdrLen
	return nil
}

// build copies ev into a message. One scratch buffer becomes one string;
// every string field is a slice of it.
func (r *Router) build(rule *tableRule, ev *event, l *layout, commit CommitInfo) *Message {
	var off [numParts + 1]int
	buf := r.buf[:0]
	off[partSubject] = len(buf)
	buf = rule.tmpl.render(buf, &l.phv)
	off[partKey] = len(buf)
	buf = append(append(append(buf, ev.aggType...), 0), ev.aggID...)
	off[partEventID] = len(buf)
	buf = append(buf, ev.eventID...)
	off[partEventType] = len(buf)
	buf = append(buf, ev.eventType...)
	off[partAggType] = len(buf)
	buf = append(buf, ev.aggType...)
	off[partAggID] = len(buf)
	buf = append(buf, ev.aggID...)
	off[partVersion] = len(buf)
	buf = append(buf, l.version()...)
	off[partOccurredAt] = len(buf)
	buf = append(buf, l.occurred()...)
	off[partCESubject] = len(buf)
	if l.ce {
		buf = append(append(append(buf, ev.aggType...), '/'), ev.aggID...)
	}
	off[partExtras] = len(buf)
	for _, x := range ev.extras {
		buf = append(buf, x.value...)
	}
	off[numParts] = len(buf)
	if cap(buf) <= maxKeptScratch {
		r.buf = buf
	} else {
		// A rare large row must not pin its size for the relay's lifetime.
		r.buf = nil
	}
	s := string(buf)
	var parts [numParts]string
	for i := range parts {
		parts[i] = s[off[i]:off[i+1]]
	}
	a := new(routed)
	backing := a.hdr[:0]
	if l.nHeaders > len(a.hdr) {
		backing = make(contract.Headers, 0, l.nHeaders)
	}
	a.msg = Message{
		Subject:   parts[partSubject],
		Header:    header(rule, ev, l, &parts, backing),
		Data:      append(make([]byte, 0, len(ev.payload)), ev.payload...), // never nil: an empty payload is not a NULL one
		EventID:   parts[partEventID],
		Key:       parts[partKey],
		Table:     rule.qualified,
		LSN:       ev.lsn,
		Ordinal:   ev.ordinal,
		Commit:    commit,
		HeaderLen: l.hdrLen,
	}
	return &a.msg
}

// inlineHeaders is how many headers a routed message holds in its own
// allocation: the contract headers and one extra column.
const inlineHeaders = 12

// routed is a message and the backing array of its headers, allocated
// together: the array lives exactly as long as the message.
type routed struct {
	msg Message
	hdr [inlineHeaders]contract.HeaderField
}

// header appends the headers of a message, built from its parts, to
// backing (of capacity l.nHeaders: no allocation per header).
func header(rule *tableRule, ev *event, l *layout, parts *[numParts]string, backing contract.Headers) contract.Headers {
	vals := [numVals]string{
		vEventID: parts[partEventID], vEventType: parts[partEventType], vAggType: parts[partAggType], vAggID: parts[partAggID],
		vVersion: parts[partVersion], vOccurredAt: parts[partOccurredAt], vCommitLSN: l.lsn, vCommitTime: l.ts, vTable: rule.qualified,
		vCESource: rule.ceSource, vCESubject: parts[partCESubject],
	}
	h := eventHeaders.appendTo(backing, &vals, ev.hasOccurred)
	if l.ce {
		// Shared strings, no formatting: CloudEvents mode costs header
		// slots, and the subject's bytes.
		h = cloudEventsHeaders.appendTo(h, &vals, ev.hasOccurred)
	}
	extras := parts[partExtras]
	for _, x := range ev.extras {
		h = append(h, contract.HeaderField{Name: x.name, Value: extras[:len(x.value)]})
		extras = extras[len(x.value):]
	}
	return h
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
	return replication.FormatLSN(c.LSN), c.Time.UTC().Format(time.RFC3339Nano)
}

// fieldCheck keeps the first error found in an event's fields.
type fieldCheck struct {
	rule    *tableRule
	err     *RouteError
	eventID []byte // set once the event id is known to be valid
}

// fail records the first error, naming column (the envelope's field name
// for a logical message).
func (fc *fieldCheck) fail(column, class, reason string) {
	if fc.err == nil {
		fc.err = &RouteError{Table: fc.rule.qualified, Column: column, Class: class, Reason: reason, EventID: string(fc.eventID)}
	}
}

// headerSafe fails the event when b cannot travel unchanged in a header.
func (fc *fieldCheck) headerSafe(column string, b []byte) {
	if fc.err != nil || b == nil {
		return
	}
	if msg := checkHeaderValue(b); msg != "" {
		fc.fail(column, ClassInvalidField, "value "+quoteValue(b)+" "+msg)
	}
}

// rowReader reads a row's column texts, keeping the first error.
type rowReader struct {
	fieldCheck
	rel  *replication.Relation
	vals []replication.Value
}

func (rd *rowReader) column(idx int) string {
	if idx >= 0 && idx < len(rd.rel.Columns) {
		return rd.rel.Columns[idx].Name
	}
	return ""
}

func (rd *rowReader) fail(idx int, class, reason string) {
	if rd.err == nil {
		rd.fieldCheck.fail(rd.column(idx), class, reason)
	}
}

// headerSafe fails the row when b cannot travel unchanged in a header.
func (rd *rowReader) headerSafe(idx int, b []byte) {
	if rd.err == nil && b != nil {
		rd.fieldCheck.headerSafe(rd.column(idx), b)
	}
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
