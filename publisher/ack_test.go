package publisher

import (
	"encoding/json"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
)

func TestParsePubAck(t *testing.T) {
	tests := []struct {
		in   string
		ok   bool
		want jetstream.PubAck
	}{
		{`{"stream":"OUTBOX","seq":42}`, true, jetstream.PubAck{Stream: "OUTBOX", Sequence: 42}},
		{`{"stream":"OUTBOX", "seq":7,"duplicate":true}`, true, jetstream.PubAck{Stream: "OUTBOX", Sequence: 7, Duplicate: true}},
		{` { "seq" : 1 , "stream" : "A-b_c" , "domain" : "hub" } `, true, jetstream.PubAck{Stream: "A-b_c", Sequence: 1, Domain: "hub"}},
		{`{"stream":"S","seq":18446744073709551615,"duplicate":false}`, true, jetstream.PubAck{Stream: "S", Sequence: 1<<64 - 1}},
		{`{"stream":"S","seq":3,"val":"12"}`, true, jetstream.PubAck{Stream: "S", Sequence: 3, Value: "12"}},
		// Everything else goes to encoding/json.
		{`{"error":{"code":503,"err_code":10077,"description":"stream sealed"},"stream":"S","seq":0}`, false, jetstream.PubAck{}},
		{`{"stream":"S","seq":18446744073709551616}`, false, jetstream.PubAck{}},
		{`{"stream":"S","seq":1.5}`, false, jetstream.PubAck{}},
		{`{"stream":"S","seq":01}`, false, jetstream.PubAck{}},
		{`{"stream":"S\u0041","seq":1}`, false, jetstream.PubAck{}},
		{`{"stream":"S","seq":1,"batch":"b"}`, false, jetstream.PubAck{}},
		{`{"stream":"S","seq":1,"stream":"T"}`, false, jetstream.PubAck{}},
		{`{"stream":"S"}`, false, jetstream.PubAck{}},
		{`{"seq":1}`, false, jetstream.PubAck{}},
		{`{"stream":"S","seq":1} x`, false, jetstream.PubAck{}},
		{`{"stream":"S","seq":1,}`, false, jetstream.PubAck{}},
		{`{}`, false, jetstream.PubAck{}},
		{``, false, jetstream.PubAck{}},
		{`null`, false, jetstream.PubAck{}},
	}
	for _, tt := range tests {
		var got jetstream.PubAck
		var stream string
		ok := parsePubAck([]byte(tt.in), &got, &stream)
		if ok != tt.ok || (ok && got != tt.want) {
			t.Errorf("parsePubAck(%s) = %+v, %v; want %+v, %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
}

// FuzzParsePubAck checks that whatever the fast parser accepts,
// encoding/json reads the same way.
func FuzzParsePubAck(f *testing.F) {
	for _, s := range []string{
		`{"stream":"OUTBOX","seq":42}`,
		`{"stream":"OUTBOX","seq":7,"duplicate":true,"domain":"d"}`,
		`{"error":{"code":503,"description":"x"}}`,
		`{"stream":"S","seq":3,"val":"12"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var fast jetstream.PubAck
		var stream string
		if !parsePubAck(b, &fast, &stream) {
			return
		}
		var slow pubAckResponse
		if err := json.Unmarshal(b, &slow); err != nil {
			t.Fatalf("fast parser accepted %q, encoding/json: %v", b, err)
		}
		if slow.Error != nil || slow.PubAck != fast {
			t.Fatalf("%q: fast %+v, encoding/json %+v (error %v)", b, fast, slow.PubAck, slow.Error)
		}
	})
}

func BenchmarkParsePubAck(b *testing.B) {
	in := []byte(`{"stream":"OUTBOX","seq":1234567}`)
	b.Run("fast", func(b *testing.B) {
		var ack jetstream.PubAck
		var stream string
		b.ReportAllocs()
		for b.Loop() {
			if !parsePubAck(in, &ack, &stream) {
				b.Fatal("rejected")
			}
		}
	})
	b.Run("encoding_json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var resp pubAckResponse
			if err := json.Unmarshal(in, &resp); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func TestParseBatchReply(t *testing.T) {
	tests := []struct {
		in   string
		ok   bool
		want batchReply
	}{
		{`{"type":"ack","seq":500,"msgs":500}`, true, batchReply{Type: "ack", Seq: 500}},
		{`{"type":"gap","last_seq":3,"seq":5}`, true, batchReply{Type: "gap", Seq: 5}},
		{`{"stream":"OUTBOX","seq":42,"batch":"Xy7.1","count":3}`, true, batchReply{Stream: "OUTBOX", Seq: 42, Batch: "Xy7.1", Count: 3}},
		{` { "stream" : "S" , "seq" : 1 , "domain" : "hub" , "batch" : "b" , "count" : 1 , "duplicate" : false } `, true, batchReply{Stream: "S", Seq: 1, Batch: "b", Count: 1}},
		{`{"stream":"S","seq":3,"val":"12"}`, true, batchReply{Stream: "S", Seq: 3}},
		{`{"type":"other","seq":1}`, true, batchReply{Type: "other", Seq: 1}},
		// Everything else goes to encoding/json.
		{`{"type":"err","seq":2,"error":{"code":400,"err_code":10100,"description":"x"}}`, false, batchReply{}},
		{`{"error":{"code":503,"err_code":10077,"description":"stream sealed"},"stream":"S","seq":0}`, false, batchReply{}},
		{`{"stream":"S","seq":1,"batch":"b","count":1,"count":2}`, false, batchReply{}},
		{`{"type":"ack","type":"gap","seq":1}`, false, batchReply{}},
		{`{"Type":"ack","seq":1}`, false, batchReply{}},
		{`{"type":"ack","seq":-1}`, false, batchReply{}},
		{`{"type":"ack","seq":1,"msgs":null}`, false, batchReply{}},
		{`{"type":"a\u0063k","seq":1}`, false, batchReply{}},
		{`{"stream":"S","seq":1,"count":1.0}`, false, batchReply{}},
		{`{"stream":"S","seq":1,"duplicate":tru}`, false, batchReply{}},
		{`{"stream":"S","seq":1,"duplicate":truex}`, false, batchReply{}},
		{`{"stream":"S","seq":1}{}`, false, batchReply{}},
		{`{}`, false, batchReply{}},
		{``, false, batchReply{}},
		{`[]`, false, batchReply{}},
	}
	for _, tt := range tests {
		var got batchReply
		ok := parseBatchReply([]byte(tt.in), &got, "S", "b")
		if ok != tt.ok || (ok && got != tt.want) {
			t.Errorf("parseBatchReply(%s) = %+v, %v; want %+v, %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
}

// FuzzParseBatchReply checks that whatever the fast parser accepts,
// encoding/json reads the same way.
func FuzzParseBatchReply(f *testing.F) {
	for _, s := range []string{
		`{"type":"ack","seq":500,"msgs":500}`,
		`{"type":"gap","last_seq":3,"seq":5}`,
		`{"type":"err","seq":2,"error":{"code":400,"description":"x"}}`,
		`{"stream":"OUTBOX","seq":42,"batch":"b1","count":3,"domain":"d","duplicate":true,"val":"1"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var fast batchReply
		if !parseBatchReply(b, &fast, "OUTBOX", "b1") {
			return
		}
		var slow batchReply
		if err := json.Unmarshal(b, &slow); err != nil {
			t.Fatalf("fast parser accepted %q, encoding/json: %v", b, err)
		}
		if slow != fast {
			t.Fatalf("%q: fast %+v, encoding/json %+v", b, fast, slow)
		}
	})
}

func BenchmarkParseBatchReply(b *testing.B) {
	in := []byte(`{"stream":"OUTBOX","seq":1234567,"batch":"UqFbvXxJ0nV3rKx5hGdQ2p1a","count":1}`)
	b.Run("fast", func(b *testing.B) {
		var r batchReply
		b.ReportAllocs()
		for b.Loop() {
			if !parseBatchReply(in, &r, "OUTBOX", "UqFbvXxJ0nV3rKx5hGdQ2p1a") {
				b.Fatal("rejected")
			}
		}
	})
	b.Run("encoding_json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var r batchReply
			if err := json.Unmarshal(in, &r); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestParseReplySubject reads back what replySubject writes, and nothing
// of another shape.
func TestParseReplySubject(t *testing.T) {
	b := &Batch{prefix: "_INBOX.abc.", flow: "125"}
	b.id = "Qx9k2"
	subj := string(b.replySubject(nil, 17, opCommitEOB))
	id, seq, ok := b.parseReplySubject(subj)
	if !ok || id != "Qx9k2" || seq != 17 {
		t.Fatalf("parseReplySubject(%q) = %q, %d, %v; want Qx9k2, 17, true", subj, id, seq, ok)
	}
	for _, bad := range []string{
		"_INBOX.abc.Qx9k2.125.fail.17.$FI",                     // one token short
		"_INBOX.abc.Qx9k2.125.fail.17.x.y.$FI",                 // one too many
		"_INBOX.abc.Qx9k2.125.fail.seventeen.x.$FI",            // no sequence
		"_INBOX.abd.Qx9k2.125.fail.17.x.$FI",                   // another prefix
		"_INBOX.abc.Qx9k2.125.fail.17.x",                       // no $FI
		"_INBOX.abc.Qx9k2.125.fail.-1.x.$FI",                   // negative
		"_INBOX.abc.Qx9k2.125.fail.18446744073709551616.x.$FI", // overflow
	} {
		if id, seq, ok := b.parseReplySubject(bad); ok {
			t.Errorf("parseReplySubject(%q) = %q, %d, true; want false", bad, id, seq)
		}
	}
}
