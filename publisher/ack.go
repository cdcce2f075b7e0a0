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
			if seenStream {
				return 0, false
			}
			seenStream = true
			return internString(b, i, stream, &ack.Stream)
		case "seq":
			if seenSeq {
				return 0, false
			}
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
// false for anything else (an error report, an escaped string, a repeated
// member) and the caller hands the answer to encoding/json. stream interns
// the stream name; an answer naming batch (the current batch's id) takes
// that string rather than a copy.
func parseBatchReply(b []byte, r *batchReply, stream *string, batch string) bool {
	*r = batchReply{}
	var seen uint8
	once := func(bit uint8) bool {
		if seen&bit != 0 {
			return false
		}
		seen |= bit
		return true
	}
	var ignoredUint uint64
	var ignoredBool bool
	return eachMember(b, func(key []byte, i int) (int, bool) {
		switch string(key) {
		case "type":
			if !once(1 << 0) {
				return 0, false
			}
			return internString(b, i, nil, &r.Type)
		case "seq":
			if !once(1 << 1) {
				return 0, false
			}
			return uintInto(b, i, &r.Seq)
		case "stream":
			if !once(1 << 2) {
				return 0, false
			}
			return internString(b, i, stream, &r.Stream)
		case "batch":
			if !once(1 << 3) {
				return 0, false
			}
			v, n, ok := plainString(b, i)
			if ok {
				r.Batch = batch
				if string(v) != batch {
					r.Batch = string(v)
				}
			}
			return n, ok
		case "count":
			if !once(1 << 4) {
				return 0, false
			}
			return uintInto(b, i, &r.Count)
		case "msgs", "last_seq":
			return uintInto(b, i, &ignoredUint)
		case "duplicate":
			return boolInto(b, i, &ignoredBool)
		case "domain", "val":
			_, n, ok := plainString(b, i)
			return n, ok
		}
		return 0, false
	})
}

// eachMember walks b as one flat JSON object, calling member with each key
// and the index of its value; member reads the value and returns the index
// after it, or false for a key or value it does not take. It reports whether
// b is exactly such an object, with at least one member and nothing after it.
// Keys must be plain strings (plainString): one with an escape is not taken.
func eachMember(b []byte, member func(key []byte, i int) (int, bool)) bool {
	i := skipSpace(b, 0)
	if i >= len(b) || b[i] != '{' {
		return false
	}
	i++
	for first := true; ; first = false {
		i = skipSpace(b, i)
		if i >= len(b) {
			return false
		}
		if b[i] == '}' {
			if first {
				return false // {}: not an answer
			}
			i++
			break
		}
		if !first {
			if b[i] != ',' {
				return false
			}
			i = skipSpace(b, i+1)
		}
		key, n, ok := plainString(b, i)
		if !ok {
			return false
		}
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

// internString reads a plain string at b[i] into *dst, reusing *intern
// (when not nil) while the string is the same, so that the answers of one
// stream do not allocate its name each time. Without intern it keeps the
// constants a type member takes and allocates only an unknown one.
func internString(b []byte, i int, intern *string, dst *string) (int, bool) {
	v, n, ok := plainString(b, i)
	if !ok {
		return 0, false
	}
	switch {
	case intern != nil:
		if string(v) != *intern {
			*intern = string(v)
		}
		*dst = *intern
	case string(v) == "ack":
		*dst = "ack"
	case string(v) == "gap":
		*dst = "gap"
	case string(v) == "err":
		*dst = "err"
	default:
		*dst = string(v)
	}
	return n, true
}

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
