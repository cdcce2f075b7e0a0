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
	i := skipSpace(b, 0)
	if i >= len(b) || b[i] != '{' {
		return false
	}
	i++
	seenStream, seenSeq := false, false
	for first := true; ; first = false {
		i = skipSpace(b, i)
		if i >= len(b) {
			return false
		}
		if b[i] == '}' {
			if first {
				return false // {}: not an ack
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
		i = skipSpace(b, i+1)
		switch string(key) {
		case "stream":
			v, n, ok := plainString(b, i)
			if !ok || seenStream {
				return false
			}
			if string(v) != *stream {
				*stream = string(v)
			}
			ack.Stream, i, seenStream = *stream, n, true
		case "seq":
			v, n, ok := uintLiteral(b, i)
			if !ok || seenSeq {
				return false
			}
			ack.Sequence, i, seenSeq = v, n, true
		case "duplicate":
			switch {
			case hasPrefixAt(b, i, "true"):
				ack.Duplicate, i = true, i+4
			case hasPrefixAt(b, i, "false"):
				ack.Duplicate, i = false, i+5
			default:
				return false
			}
		case "domain", "val":
			v, n, ok := plainString(b, i)
			if !ok {
				return false
			}
			if key[0] == 'd' {
				ack.Domain = string(v)
			} else {
				ack.Value = string(v)
			}
			i = n
		default:
			return false
		}
	}
	return skipSpace(b, i) == len(b) && seenStream && seenSeq
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
