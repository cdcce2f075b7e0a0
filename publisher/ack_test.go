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
