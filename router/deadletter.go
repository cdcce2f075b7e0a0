package router

import (
	"errors"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/replication"
)

// ClassUnknown is the reason class of a dead-letter record whose reason is
// nil.
const ClassUnknown = "unknown"

const (
	// maxReasonBytes bounds the reason text in a dead-letter record; an
	// error that embeds a huge value must not make the record too large.
	maxReasonBytes = 1024
	// maxDLQEventIDBytes bounds the Outbox-Event-Id of a dead-letter
	// record; a longer id is only in the body.
	maxDLQEventIDBytes = 256
	// shortMetaBytes is how much of the reason, subject and event id the
	// last-resort record keeps.
	shortMetaBytes = 128
)

// DeadLetter builds the dead-letter record of a row that Route refused or
// that the broker permanently rejected; it never fails and is safe for
// concurrent use. The record goes to <dead_letter_subject>.<EscapeToken(
// schema.table)> with these headers:
//
//   - Nats-Msg-Id: dlq:<schema.table>:event:<event id> when the event id
//     is known and fits a header, else dlq:<schema.table>:<row LSN>, with
//     ":<ordinal>" appended for the second and later rows sharing that LSN
//     (one COPY's rows share it). The id is unique per row and the same
//     when the WAL is decoded again, so re-sending the record after a
//     relay restart is de-duplicated by the stream and no two rows
//     de-duplicate each other;
//   - Outbox-Table, Outbox-DLQ-Reason (reason.Error(), cut to 1 KiB),
//     Outbox-DLQ-Reason-Class (from a ReasonClasser in reason's chain, else
//     rejected_by_broker), Outbox-DLQ-LSN (the row's LSN),
//     Outbox-Commit-LSN, Outbox-Commit-Time, Content-Type;
//   - Outbox-Event-Id when the event id is known.
//
// The body is a JSON object:
//
//	{"table": "public.outbox", "lsn": "0/16B3748", "commit_lsn": "0/16B37A0",
//	 "commit_time": "2026-11-29T09:35:21.123456Z", "reason": "...",
//	 "reason_class": "invalid_field", "event_id": "...", "subject": "...",
//	 "row": {"event_id": "...", "payload": "{...}", "occurred_at": null, ...},
//	 "omitted": {"column": "binary value"}, "truncated": false}
//
// event_id and subject (the subject the event would have had) appear when
// known; row holds every column's text in table order, NULL as null; a
// binary or unchanged value is null and listed in omitted. The record
// always fits in the max payload: when the row is too big, the largest
// values are cut (at a UTF-8 boundary), "truncated" is true and
// "truncated_fields" maps each cut column to its full length in bytes.
func (r *Router) DeadLetter(ins *replication.Insert, commit CommitInfo, reason error) *Message {
	rec := dlqRecord{commit: commit}
	rec.setReason(reason)
	var rule *tableRule
	if ins != nil {
		rec.lsn, rec.ordinal = ins.LSN, ins.Ordinal
		if rel := ins.Relation; rel != nil {
			rec.table = rel.QualifiedName()
			rule = r.rules[relKey{rel.Namespace, rel.Name}]
			rec.row = make([]dlqField, len(rel.Columns))
			for i, c := range rel.Columns {
				f := &rec.row[i]
				f.name = c.Name
				if i >= len(ins.Values) {
					f.null, f.note = true, "value missing from the decoded row"
					continue
				}
				switch v := ins.Values[i]; v.Kind {
				case replication.ValueText:
					f.val = v.Data
				case replication.ValueNull:
					f.null = true
				case replication.ValueBinary:
					f.null, f.note = true, "binary value ("+strconv.Itoa(len(v.Data))+" bytes) not shown"
				default:
					f.null, f.note = true, "unchanged TOAST value, not sent"
				}
			}
		}
	}
	var re *RouteError
	if errors.As(reason, &re) {
		rec.eventID, rec.subject = re.EventID, re.Subject
	}
	if rec.eventID == "" && ins != nil && ins.Relation != nil {
		// Best effort, so an operator can find the event by id.
		col := DefaultEventIDColumn
		if rule != nil {
			col = rule.eventID
		}
		if i := ins.Relation.ColumnIndex(col); i >= 0 && i < len(ins.Values) && ins.Values[i].Kind == replication.ValueText {
			rec.eventID = string(ins.Values[i].Data)
		}
	}
	return r.buildDLQ(&rec)
}

// DeadLetterMessage builds the dead-letter record of a routed message that
// the broker permanently rejected, for a caller that no longer has the row
// (the decoder reuses its buffers). It is DeadLetter's record with the
// event's subject, headers and payload in place of the row:
//
//	{..., "subject": "...", "headers": {"Outbox-Event-Type": "...", ...},
//	 "payload": "{...}", "truncated": false}
//
// It never fails and is safe for concurrent use.
func (r *Router) DeadLetterMessage(m *Message, reason error) *Message {
	rec := dlqRecord{
		table:   m.Table,
		lsn:     m.LSN,
		ordinal: m.Ordinal,
		commit:  m.Commit,
		eventID: m.EventID,
		subject: m.Subject,
		event:   true,
	}
	rec.setReason(reason)
	hs := slices.Clone(m.Header)
	slices.SortStableFunc(hs, func(a, b contract.HeaderField) int { return strings.Compare(a.Name, b.Name) })
	for _, f := range hs {
		rec.headers = append(rec.headers, dlqField{name: f.Name, val: []byte(f.Value)})
	}
	rec.payload = []dlqField{{name: "payload", val: m.Data, null: m.Data == nil}}
	return r.buildDLQ(&rec)
}

// dlqRecord is the content of a dead-letter record before encoding.
type dlqRecord struct {
	table   string
	lsn     replication.LSN
	ordinal uint32
	commit  CommitInfo
	reason  string
	class   string
	eventID string
	subject string
	event   bool       // DeadLetterMessage's form: headers and payload, no row
	row     []dlqField // table columns, in order
	headers []dlqField // the event's headers
	payload []dlqField // the event's payload, one field
}

type dlqField struct {
	name string
	val  []byte
	null bool
	note string // why a non-NULL value is shown as null
}

// headerEventID reports whether the event id is known and fits a header.
func (rec *dlqRecord) headerEventID() bool {
	return rec.eventID != "" && len(rec.eventID) <= maxDLQEventIDBytes && checkHeaderValue(rec.eventID) == ""
}

// msgID is the record's Nats-Msg-Id (see DeadLetter). The event id form and
// the LSN form cannot meet: an LSN never starts with "event:".
func (rec *dlqRecord) msgID(lsn string) string {
	if rec.headerEventID() {
		return "dlq:" + rec.table + ":event:" + rec.eventID
	}
	id := "dlq:" + rec.table + ":" + lsn
	if rec.ordinal > 0 {
		// Ordinal 0 keeps the id that earlier versions gave, so a record
		// re-sent across an upgrade is still a duplicate.
		id += ":" + strconv.FormatUint(uint64(rec.ordinal), 10)
	}
	return id
}

func (rec *dlqRecord) setReason(reason error) {
	if reason == nil {
		rec.reason, rec.class = "no reason given", ClassUnknown
		return
	}
	rec.reason = cutUTF8(reason.Error(), maxReasonBytes)
	rec.class = ClassRejectedByBroker
	var rc ReasonClasser
	if errors.As(reason, &rc) {
		if c := rc.ReasonClass(); c != "" {
			rec.class = c
		}
	}
}

// buildDLQ encodes rec, cutting values until the record fits the max
// payload.
func (r *Router) buildDLQ(rec *dlqRecord) *Message {
	lsn := rec.lsn.String()
	commitLSN, commitTime := formatCommit(rec.commit)
	h := contract.Headers{
		{Name: contract.MsgID, Value: rec.msgID(lsn)},
		{Name: contract.Table, Value: headerText(rec.table)},
		{Name: contract.DLQReason, Value: headerText(rec.reason)},
		{Name: contract.DLQReasonClass, Value: headerText(rec.class)},
		{Name: contract.DLQLSN, Value: lsn},
		{Name: contract.CommitLSN, Value: commitLSN},
		{Name: contract.CommitTime, Value: commitTime},
		{Name: contract.ContentType, Value: contract.JSONContentType},
	}
	if rec.headerEventID() {
		h = append(h, contract.HeaderField{Name: contract.EventID, Value: rec.eventID})
	}
	room := r.maxPayload - headerSize(h)

	enc := dlqEncoder{rec: rec, lsn: lsn, commitLSN: commitLSN, commitTime: commitTime, valueCap: -1}
	body := enc.encode()
	if len(body) > room {
		// Halve the longest values until the record fits: the work is
		// bounded by twice the row's size.
		longest := 0
		for _, f := range enc.fields() {
			longest = max(longest, len(f.val))
		}
		for c := longest / 2; len(body) > room && c > 0; c /= 2 {
			enc.valueCap = c
			body = enc.encode()
		}
		if len(body) > room {
			enc.valueCap = 0
			body = enc.encode()
		}
		if len(body) > room {
			enc.dropFields = true
			body = enc.encode()
		}
		if len(body) > room {
			enc.shortMeta = true
			body = enc.encode()
		}
	}
	return &Message{
		Subject: r.dlqSubject + "." + EscapeToken(rec.table),
		Header:  h,
		Data:    body,
		EventID: rec.eventID,
		// Dead-letter records need no order among themselves.
		Key:    "",
		Table:  rec.table,
		LSN:    rec.lsn,
		Commit: rec.commit,
	}
}

// dlqEncoder writes a dlqRecord's JSON body under truncation settings.
type dlqEncoder struct {
	rec                        *dlqRecord
	lsn, commitLSN, commitTime string
	valueCap                   int  // longest value kept, -1 for all
	dropFields                 bool // leave out row, headers and payload
	shortMeta                  bool // cut reason, subject, event id
}

func (e *dlqEncoder) fields() []*dlqField {
	var out []*dlqField
	for _, g := range [][]dlqField{e.rec.row, e.rec.headers, e.rec.payload} {
		for i := range g {
			out = append(out, &g[i])
		}
	}
	return out
}

func (e *dlqEncoder) encode() []byte {
	b := e.appendMeta(make([]byte, 0, 512))
	var cut []*dlqField
	if !e.dropFields {
		b = e.appendValues(b, &cut)
	}
	b = e.appendOmitted(b)
	truncated := e.dropFields || e.shortMeta || len(cut) > 0
	if len(cut) > 0 {
		b = appendByName(b, "truncated_fields", cut, func(b []byte, f *dlqField) []byte {
			return strconv.AppendInt(b, int64(len(f.val)), 10)
		})
	}
	if e.dropFields {
		b = append(b, `,"fields_dropped":true`...)
	}
	b = append(b, `,"truncated":`...)
	b = strconv.AppendBool(b, truncated)
	return append(b, '}')
}

// appendMeta opens the object and appends what locates the row and why it
// is here: table, positions, reason, event id and subject.
func (e *dlqEncoder) appendMeta(b []byte) []byte {
	rec := e.rec
	meta := func(s string) string {
		if e.shortMeta {
			return cutUTF8(s, shortMetaBytes)
		}
		return s
	}
	b = append(b, `{"table":`...)
	b = appendJSONString(b, rec.table)
	b = append(b, `,"lsn":`...)
	b = appendJSONString(b, e.lsn)
	b = append(b, `,"commit_lsn":`...)
	b = appendJSONString(b, e.commitLSN)
	b = append(b, `,"commit_time":`...)
	b = appendJSONString(b, e.commitTime)
	b = append(b, `,"reason":`...)
	b = appendJSONString(b, meta(rec.reason))
	b = append(b, `,"reason_class":`...)
	b = appendJSONString(b, rec.class)
	if rec.eventID != "" {
		b = append(b, `,"event_id":`...)
		b = appendJSONString(b, meta(rec.eventID))
	}
	if rec.subject != "" {
		b = append(b, `,"subject":`...)
		b = appendJSONString(b, meta(rec.subject))
	}
	return b
}

// appendValues appends the row, or the event's headers and payload, and
// adds each value it cuts to cut.
func (e *dlqEncoder) appendValues(b []byte, cut *[]*dlqField) []byte {
	object := func(key string, fs []dlqField) {
		b = append(b, ',', '"')
		b = append(b, key...)
		b = append(b, `":{`...)
		for i := range fs {
			if i > 0 {
				b = append(b, ',')
			}
			b = e.appendField(b, &fs[i], cut)
		}
		b = append(b, '}')
	}
	if e.rec.event {
		object("headers", e.rec.headers)
		b = append(b, `,"payload":`...)
		return e.appendValue(b, &e.rec.payload[0], cut)
	}
	object("row", e.rec.row)
	return b
}

// appendOmitted appends the notes of values shown as null, if any.
func (e *dlqEncoder) appendOmitted(b []byte) []byte {
	var omitted []*dlqField
	for _, f := range e.fields() {
		if f.note != "" {
			omitted = append(omitted, f)
		}
	}
	if len(omitted) == 0 {
		return b
	}
	return appendByName(b, "omitted", omitted, func(b []byte, f *dlqField) []byte {
		return appendJSONString(b, f.note)
	})
}

// appendByName appends ,"key":{"<name>":<value>,...} for fs, each value
// written by value.
func appendByName(b []byte, key string, fs []*dlqField, value func([]byte, *dlqField) []byte) []byte {
	b = append(b, ',', '"')
	b = append(b, key...)
	b = append(b, `":{`...)
	for i, f := range fs {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, f.name)
		b = append(b, ':')
		b = value(b, f)
	}
	return append(b, '}')
}

// appendField appends "name":value.
func (e *dlqEncoder) appendField(b []byte, f *dlqField, cut *[]*dlqField) []byte {
	b = appendJSONString(b, f.name)
	b = append(b, ':')
	return e.appendValue(b, f, cut)
}

func (e *dlqEncoder) appendValue(b []byte, f *dlqField, cut *[]*dlqField) []byte {
	if f.null {
		return append(b, "null"...)
	}
	v := f.val
	if e.valueCap >= 0 && len(v) > e.valueCap {
		v = cutUTF8(v, e.valueCap)
		*cut = append(*cut, f)
	}
	return appendJSONString(b, v)
}

// headerSize is the encoded size of a header block as nats.go sends it.
func headerSize(h contract.Headers) int {
	n := hdrOverhead
	for _, f := range h {
		n += hdrLineLen(f.Name, len(f.Value))
	}
	return n
}

// headerText makes s travel unchanged in a header: line breaks become
// spaces and surrounding whitespace goes, which nats.go would do anyway,
// but doing it here keeps headerSize exact.
func headerText(s string) string {
	if strings.ContainsAny(s, "\r\n") {
		s = strings.NewReplacer("\r", " ", "\n", " ").Replace(s)
	}
	return strings.Trim(s, " \t")
}

// cutUTF8 returns at most n bytes of s, not splitting a UTF-8 sequence.
func cutUTF8[T text](s T, n int) T {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// appendJSONString appends s as a JSON string. Invalid UTF-8 becomes
// U+FFFD, as encoding/json does.
func appendJSONString[T text](b []byte, s T) []byte {
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xF])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(string(s[i:min(i+utf8.UTFMax, len(s))]))
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i++
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
