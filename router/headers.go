package router

import "github.com/outbox-relay/outbox-relay/contract"

// The event's headers, declared once. The size check (checkLimits), the
// header list (header) and the CloudEvents headers are all derived from
// these two lists, so a header added here is counted and set alike.

// hval names where a header's value comes from.
type hval uint8

const (
	vConst hval = iota // hdrField.lit
	vEventID
	vEventType
	vAggType
	vAggID
	vVersion
	vOccurredAt
	vCommitLSN
	vCommitTime
	vTable
	vCESource
	vCESubject // <aggregate type>/<aggregate id>
	numVals
)

// hdrField is one header: its name and the source of its value. An
// optional one is set only when the event has an occurred-at time (the
// only optional value).
type hdrField struct {
	name     string
	val      hval
	lit      string
	optional bool
}

// eventHeaders are the contract headers of every event.
var eventHeaders = hdrSet{fields: []hdrField{
	{name: contract.MsgID, val: vEventID},
	{name: contract.EventID, val: vEventID},
	{name: contract.EventType, val: vEventType},
	{name: contract.AggregateType, val: vAggType},
	{name: contract.AggregateID, val: vAggID},
	{name: contract.AggregateVersion, val: vVersion},
	{name: contract.OccurredAt, val: vOccurredAt, optional: true},
	{name: contract.CommitLSN, val: vCommitLSN},
	{name: contract.CommitTime, val: vCommitTime},
	{name: contract.Table, val: vTable},
	{name: contract.ContentType, lit: contract.JSONContentType},
}}.derive()

// cloudEventsHeaders are the CloudEvents binary content mode headers the
// events of a table with CloudEventsConfig.Enabled carry beside them.
var cloudEventsHeaders = hdrSet{fields: []hdrField{
	{name: contract.CESpecVersion, lit: contract.CESpecVersionValue},
	{name: contract.CEID, val: vEventID},
	{name: contract.CESource, val: vCESource},
	{name: contract.CEType, val: vEventType},
	{name: contract.CESubject, val: vCESubject},
	{name: contract.CEAggregateVersion, val: vVersion},
	{name: contract.CEAggregateType, val: vAggType},
	{name: contract.CEContentType, lit: contract.JSONContentType},
	{name: contract.CETime, val: vOccurredAt, optional: true},
}}.derive()

// hdrSet is a header list and what the size check needs of it.
type hdrSet struct {
	fields []hdrField
	// always and optional count the headers set on every event and those
	// set only with an occurred-at time.
	always, optional int
	// fixedLen is the encoded size of the always-set headers without their
	// variable values; uses counts those values' uses.
	fixedLen, optionalLen int
	uses, optionalUses    [numVals]int
}

func (s hdrSet) derive() hdrSet {
	for _, f := range s.fields {
		n := hdrLineLen(f.name, len(f.lit))
		if f.optional {
			s.optional++
			s.optionalLen += n
			s.optionalUses[f.val]++
			continue
		}
		s.always++
		s.fixedLen += n
		s.uses[f.val]++
	}
	return s
}

// size returns the encoded size and count of the set's headers for an
// event whose values have the lengths lens.
func (s *hdrSet) size(lens *[numVals]int, hasOccurred bool) (n, count int) {
	n, count = s.fixedLen, s.always
	for v := vEventID; v < numVals; v++ {
		n += s.uses[v] * lens[v]
	}
	if hasOccurred {
		n += s.optionalLen
		for v := vEventID; v < numVals; v++ {
			n += s.optionalUses[v] * lens[v]
		}
		count += s.optional
	}
	return n, count
}

// names returns the set's header names.
func (s *hdrSet) names() []string {
	out := make([]string, len(s.fields))
	for i, f := range s.fields {
		out[i] = f.name
	}
	return out
}

// appendTo appends the set's headers with the values vals to h.
func (s *hdrSet) appendTo(h contract.Headers, vals *[numVals]string, hasOccurred bool) contract.Headers {
	for _, f := range s.fields {
		switch {
		case f.optional && !hasOccurred:
		case f.val == vConst:
			h = append(h, contract.HeaderField{Name: f.name, Value: f.lit})
		default:
			h = append(h, contract.HeaderField{Name: f.name, Value: vals[f.val]})
		}
	}
	return h
}
