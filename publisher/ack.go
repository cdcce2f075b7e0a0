package publisher

import (
	"github.com/nats-io/nats.go/jetstream"
)

// parsePubAck parses the reply JetStream sends for a stored message,
// {"stream":"S","seq":N} with optional "duplicate", "domain" and "val", into
// ack without reflection or allocation: with encoding/json, parsing was a
// large share of the per-ack cost (bench/README.md, BenchmarkParsePubAck).
// It reports false for anything else, errors included; the caller then hands
// the reply to encoding/json, so an unexpected but valid reply is never
// misread, only parsed more slowly. stream interns the stream name: every
// ack of a stream carries the same one.
func parsePubAck(b []byte, ack *jetstream.PubAck, stream *string) bool {
	*ack = jetstream.PubAck{}
	seenStream, seenSeq := false, false
	ok := eachMember(b, func(key []byte, i int) (int, bool) {
		switch string(key) {
		case "stream":
			v, n, ok := plainString(b, i)
			if ok {
				*stream = knownOr(v, *stream)
				ack.Stream, seenStream = *stream, true
			}
			return n, ok
		case "seq":
			seenSeq = true
			return uintInto(b, i, &ack.Sequence)
		case "duplicate":
			return boolInto(b, i, &ack.Duplicate)
		case "domain":
			return stringInto(b, i, &ack.Domain)
		case "val":
			return stringInto(b, i, &ack.Value)
		}
		return 0, false
	})
	return ok && seenStream && seenSeq
}

// parseBatchReply parses an answer to a fast-ingest batch (batchReply)
// without reflection or allocation, as parsePubAck does a PubAck: at
// moderate rates each event is a batch of its own, and encoding/json was
// the largest part of reading its answer (BenchmarkParseBatchReply). It
// reads a flow ack {"type":"ack","seq":N,"msgs":M}, a gap report
// {"type":"gap","last_seq":L,"seq":N} and a PubAck without an error (the
// batch's final count, {"stream":"S","seq":N,"batch":"id","count":K} with
// optional "domain", "duplicate" and "val"), into r; members batchReply has
// no field for are checked, not kept, as encoding/json would. It reports
// false for anything else (an error report, an escaped string) and the
// caller hands the answer to encoding/json. An answer naming stream (the
// publisher's) or batch (the current batch's id) takes that string rather
// than a copy.
func parseBatchReply(b []byte, r *batchReply, stream, batch string) bool {
	*r = batchReply{}
	return eachMember(b, func(key []byte, i int) (int, bool) {
		var v []byte
		n, ok := 0, false
		switch string(key) {
		case "seq":
			return uintInto(b, i, &r.Seq)
		case "count":
			return uintInto(b, i, &r.Count)
		case "msgs", "last_seq":
			_, n, ok = uintLiteral(b, i)
			return n, ok
		case "duplicate":
			var dup bool
			return boolInto(b, i, &dup)
		case "domain", "val":
			_, n, ok = plainString(b, i)
			return n, ok
		case "type", "stream", "batch":
			if v, n, ok = plainString(b, i); !ok {
				return 0, false
			}
		default:
			return 0, false
		}
		switch key[0] {
		case 't':
			r.Type = knownOr(v, "ack") // gap and err are failures: rare
		case 's':
			r.Stream = knownOr(v, stream)
		default:
			r.Batch = knownOr(v, batch)
		}
		return n, true
	})
}

// knownOr returns known when v spells it, else a copy of v.
func knownOr(v []byte, known string) string {
	if string(v) == known {
		return known
	}
	return string(v)
}

// eachMember walks b as one flat JSON object, calling member with each key
// and the index of its value; member reads the value and returns the index
// after it, or false for a key or value it does not take. It reports whether
// b is exactly such an object, with at least one member and nothing after it.
// Keys must be plain strings (plainString): one with an escape is not taken,
// nor a key that comes twice (encoding/json keeps the last value; the
// caller's fallback reads it so), nor more than maxMembers members.
func eachMember(b []byte, member func(key []byte, i int) (int, bool)) bool {
	var keys [maxMembers][]byte
	i := skipSpace(b, 0)
	if i >= len(b) || b[i] != '{' {
		return false
	}
	i++
	for k := 0; ; k++ {
		i = skipSpace(b, i)
		if i >= len(b) {
			return false
		}
		if b[i] == '}' {
			if k == 0 {
				return false // {}: not an answer
			}
			i++
			break
		}
		if k > 0 {
			if b[i] != ',' {
				return false
			}
			i = skipSpace(b, i+1)
		}
		key, n, ok := plainString(b, i)
		if !ok || k == maxMembers {
			return false
		}
		for _, seen := range keys[:k] {
			if string(seen) == string(key) {
				return false
			}
		}
		keys[k] = key
		i = skipSpace(b, n)
		if i >= len(b) || b[i] != ':' {
			return false
		}
		if i, ok = member(key, skipSpace(b, i+1)); !ok {
			return false
		}
	}
	return skipSpace(b, i) == len(b)
}

// maxMembers is the most members eachMember reads: a PubAck has at most
// seven, a batch answer as many.
const maxMembers = 8

func stringInto(b []byte, i int, dst *string) (int, bool) {
	v, n, ok := plainString(b, i)
	if ok {
		*dst = string(v)
	}
	return n, ok
}

func uintInto(b []byte, i int, dst *uint64) (int, bool) {
	v, n, ok := uintLiteral(b, i)
	if ok {
		*dst = v
	}
	return n, ok
}

func boolInto(b []byte, i int, dst *bool) (int, bool) {
	switch {
	case hasPrefixAt(b, i, "true"):
		*dst = true
		return i + 4, true
	case hasPrefixAt(b, i, "false"):
		*dst = false
		return i + 5, true
	}
	return 0, false
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// plainString reads a JSON string at b[i] that has no escapes and only
// printable ASCII, returning its contents and the index after it.
func plainString(b []byte, i int) ([]byte, int, bool) {
	if i >= len(b) || b[i] != '"' {
		return nil, 0, false
	}
	for j := i + 1; j < len(b); j++ {
		switch c := b[j]; {
		case c == '"':
			return b[i+1 : j], j + 1, true
		case c == '\\' || c < 0x20 || c >= 0x7f:
			return nil, 0, false
		}
	}
	return nil, 0, false
}

// uintLiteral reads a JSON number at b[i] that is a plain decimal uint64
// (no sign, fraction, exponent or leading zero).
func uintLiteral(b []byte, i int) (uint64, int, bool) {
	j := i
	var v uint64
	for j < len(b) && b[j] >= '0' && b[j] <= '9' {
		d := uint64(b[j] - '0')
		if v > (1<<64-1-d)/10 {
			return 0, 0, false
		}
		v = v*10 + d
		j++
	}
	if j == i || (b[i] == '0' && j > i+1) {
		return 0, 0, false
	}
	if j < len(b) && (b[j] == '.' || b[j] == 'e' || b[j] == 'E') {
		return 0, 0, false
	}
	return v, j, true
}

func hasPrefixAt(b []byte, i int, s string) bool {
	return len(b)-i >= len(s) && string(b[i:i+len(s)]) == s
}
