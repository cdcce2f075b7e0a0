package pgoutput

import (
	"encoding/binary"
	"errors"
	"testing"
	"time"
)

type builder []byte

func (b builder) u8(v uint8) builder   { return append(b, v) }
func (b builder) u16(v uint16) builder { return binary.BigEndian.AppendUint16(b, v) }
func (b builder) u32(v uint32) builder { return binary.BigEndian.AppendUint32(b, v) }
func (b builder) u64(v uint64) builder { return binary.BigEndian.AppendUint64(b, v) }
func (b builder) str(s string) builder { return append(append(b, s...), 0) }
func (b builder) text(s string) builder {
	return append(b.u8(KindText).u32(uint32(len(s))), s...)
}

func TestDecodeInsert(t *testing.T) {
	src := builder{}.u32(16384).u8('N').u16(3).text("abc").u8(KindNull).text("")
	var m Insert
	if err := DecodeInsert(src, &m); err != nil {
		t.Fatal(err)
	}
	if m.RelationID != 16384 || len(m.Columns) != 3 {
		t.Fatalf("got %+v", m)
	}
	if string(m.Columns[0].Data) != "abc" || m.Columns[1].Kind != KindNull || m.Columns[2].Kind != KindText || len(m.Columns[2].Data) != 0 {
		t.Fatalf("columns %+v", m.Columns)
	}
	// Reuse keeps the backing array.
	first := &m.Columns[0]
	if err := DecodeInsert(src, &m); err != nil {
		t.Fatal(err)
	}
	if &m.Columns[0] != first {
		t.Fatal("DecodeInsert did not reuse the column slice")
	}
}

func TestDecodeErrors(t *testing.T) {
	valid := builder{}.u32(1).u8('N').u16(1).text("abc")
	tests := []struct {
		name string
		src  []byte
	}{
		{"empty", nil},
		{"no tuple", valid[:4]},
		{"wrong tuple type", builder{}.u32(1).u8('K').u16(0)},
		{"short length", valid[:len(valid)-4]},
		{"short data", valid[:len(valid)-1]},
		{"bad kind", builder{}.u32(1).u8('N').u16(1).u8('x')},
		{"too many columns", builder{}.u32(1).u8('N').u16(2000)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var m Insert
			if err := DecodeInsert(tt.src, &m); !errors.Is(err, ErrMalformed) {
				t.Fatalf("err = %v, want ErrMalformed", err)
			}
		})
	}
}

func TestDecodeBeginCommitRelationMessage(t *testing.T) {
	ts := time.Date(2026, 11, 29, 9, 35, 21, 123456000, time.UTC)
	us := uint64(ts.Sub(pgEpoch) / time.Microsecond)

	var b Begin
	if err := DecodeBegin(builder{}.u64(0x16B3748).u64(us).u32(42), &b); err != nil {
		t.Fatal(err)
	}
	if b.FinalLSN != 0x16B3748 || !b.CommitTime.Equal(ts) || b.XID != 42 {
		t.Fatalf("begin %+v", b)
	}
	var c Commit
	if err := DecodeCommit(builder{}.u8(0).u64(10).u64(20).u64(us), &c); err != nil {
		t.Fatal(err)
	}
	if c.CommitLSN != 10 || c.EndLSN != 20 || !c.CommitTime.Equal(ts) {
		t.Fatalf("commit %+v", c)
	}
	var r Relation
	src := builder{}.u32(7).str("public").str("outbox").u8('d').u16(2).
		u8(1).str("event_id").u32(2950).u32(0xffffffff).
		u8(0).str("payload").u32(3802).u32(0xffffffff)
	if err := DecodeRelation(src, &r); err != nil {
		t.Fatal(err)
	}
	if r.ID != 7 || r.Namespace != "public" || r.Name != "outbox" || len(r.Columns) != 2 || r.Columns[1].Name != "payload" || r.Columns[1].TypeOID != 3802 || r.Columns[0].TypeMod != -1 {
		t.Fatalf("relation %+v", r)
	}
	var m Message
	if err := DecodeMessage(builder{}.u8(1).u64(99).str("outbox").u32(2).u8('{').u8('}'), &m); err != nil {
		t.Fatal(err)
	}
	if !m.Transactional || m.LSN != 99 || m.Prefix != "outbox" || string(m.Content) != "{}" {
		t.Fatalf("message %+v", m)
	}
	var tr Truncate
	if err := DecodeTruncate(builder{}.u32(2).u8(1).u32(5).u32(6), &tr); err != nil {
		t.Fatal(err)
	}
	if len(tr.RelationIDs) != 2 || tr.RelationIDs[1] != 6 {
		t.Fatalf("truncate %+v", tr)
	}
	if err := DecodeTruncate(builder{}.u32(1<<30).u8(0), &tr); !errors.Is(err, ErrMalformed) {
		t.Fatalf("huge truncate: %v", err)
	}
}

// FuzzDecode feeds arbitrary bytes to every decoder: they must return an
// error or a result, never panic or allocate without bound.
func FuzzDecode(f *testing.F) {
	f.Add(byte(TypeInsert), []byte(builder{}.u32(1).u8('N').u16(1).text("abc")))
	f.Add(byte(TypeRelation), []byte(builder{}.u32(7).str("public").str("outbox").u8('d').u16(1).u8(1).str("id").u32(25).u32(0)))
	f.Add(byte(TypeMessage), []byte(builder{}.u8(1).u64(99).str("p").u32(0)))
	f.Add(byte(TypeTruncate), []byte(builder{}.u32(1).u8(0).u32(5)))
	f.Fuzz(func(t *testing.T, typ byte, src []byte) {
		switch typ % 6 {
		case 0:
			var m Insert
			if err := DecodeInsert(src, &m); err == nil {
				for _, c := range m.Columns {
					if c.Kind != KindNull && c.Kind != KindUnchanged && c.Kind != KindText && c.Kind != KindBinary {
						t.Fatalf("accepted kind %q", c.Kind)
					}
				}
			}
		case 1:
			var m Relation
			_ = DecodeRelation(src, &m)
		case 2:
			var m Message
			if err := DecodeMessage(src, &m); err == nil && len(m.Content) > len(src) {
				t.Fatal("content longer than input")
			}
		case 3:
			var m Truncate
			_ = DecodeTruncate(src, &m)
		case 4:
			var m Begin
			_ = DecodeBegin(src, &m)
		case 5:
			var m Commit
			_ = DecodeCommit(src, &m)
		}
	})
}

func BenchmarkDecodeInsert(b *testing.B) {
	payload := `{"registrationId":"0b7e8f6a-3c1d-4a8e-9a57-2f4e9d1c6b3a","version":7,"note":"` + string(make([]byte, 180)) + `"}`
	src := builder{}.u32(16384).u8('N').u16(8).
		text("0b7e8f6a-3c1d-4a8e-9a57-2f4e9d1c6b3a").text("registration").text("agg-123").text("7").
		text("RegistrationConfirmed").text(payload).text("2026-11-29 09:35:21.123456+00").text("PENDING")
	var m Insert
	b.ReportAllocs()
	b.SetBytes(int64(len(src)))
	for i := 0; i < b.N; i++ {
		if err := DecodeInsert(src, &m); err != nil {
			b.Fatal(err)
		}
	}
}
