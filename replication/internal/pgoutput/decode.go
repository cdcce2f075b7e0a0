// Package pgoutput decodes the messages of PostgreSQL's pgoutput logical
// replication plugin, protocol version 1, without copying tuple data.
//
// pglogrepl's decoder allocates a struct and a copy of the bytes for every
// column of every row, garbage in proportion to the data the relay reads
// (its cost: bench/README.md). This decoder fills caller-owned
// structures and lets tuple values point into the CopyData buffer, which the
// caller must treat as valid only until the next receive.
//
// The input arrives from the network, so every length is checked and a
// malformed message yields an error, never a panic (see FuzzDecode).
//
// Format: https://www.postgresql.org/docs/current/protocol-logicalrep-message-formats.html
package pgoutput

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"
)

// Message types of pgoutput protocol version 1.
const (
	TypeBegin    = 'B'
	TypeCommit   = 'C'
	TypeOrigin   = 'O'
	TypeRelation = 'R'
	TypeType     = 'Y'
	TypeInsert   = 'I'
	TypeUpdate   = 'U'
	TypeDelete   = 'D'
	TypeTruncate = 'T'
	TypeMessage  = 'M'
)

// Tuple column kinds.
const (
	KindNull      = 'n'
	KindUnchanged = 'u'
	KindText      = 't'
	KindBinary    = 'b'
)

// ErrMalformed reports a message that does not follow the pgoutput format.
var ErrMalformed = errors.New("malformed pgoutput message")

// Begin is a Begin message.
type Begin struct {
	FinalLSN   uint64
	CommitTime time.Time
	XID        uint32
}

// Commit is a Commit message.
type Commit struct {
	Flags      uint8
	CommitLSN  uint64
	EndLSN     uint64
	CommitTime time.Time
}

// RelationColumn is a column of a Relation message.
type RelationColumn struct {
	Flags   uint8
	Name    string
	TypeOID uint32
	TypeMod int32
}

// Relation is a Relation message.
type Relation struct {
	ID              uint32
	Namespace       string
	Name            string
	ReplicaIdentity uint8
	Columns         []RelationColumn
}

// Column is one value of a tuple; Data aliases the input buffer.
type Column struct {
	Kind byte
	Data []byte
}

// Insert is an Insert message. Columns is reused between calls to
// DecodeInsert with the same *Insert.
type Insert struct {
	RelationID uint32
	Columns    []Column
}

// Message is a logical decoding message (pg_logical_emit_message).
type Message struct {
	Transactional bool
	LSN           uint64
	Prefix        string
	Content       []byte // aliases the input buffer
}

// Truncate is a Truncate message.
type Truncate struct {
	Options     uint8
	RelationIDs []uint32
}

// pgEpoch is the PostgreSQL timestamp epoch: microseconds count from here.
var pgEpoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

type reader struct {
	b   []byte
	err error
}

func (r *reader) fail(what string) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: truncated %s", ErrMalformed, what)
	}
	r.b = nil
}

func (r *reader) u8(what string) uint8 {
	if len(r.b) < 1 {
		r.fail(what)
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

func (r *reader) u16(what string) uint16 {
	if len(r.b) < 2 {
		r.fail(what)
		return 0
	}
	v := binary.BigEndian.Uint16(r.b)
	r.b = r.b[2:]
	return v
}

func (r *reader) u32(what string) uint32 {
	if len(r.b) < 4 {
		r.fail(what)
		return 0
	}
	v := binary.BigEndian.Uint32(r.b)
	r.b = r.b[4:]
	return v
}

func (r *reader) u64(what string) uint64 {
	if len(r.b) < 8 {
		r.fail(what)
		return 0
	}
	v := binary.BigEndian.Uint64(r.b)
	r.b = r.b[8:]
	return v
}

func (r *reader) time(what string) time.Time {
	us := int64(r.u64(what))
	return pgEpoch.Add(time.Duration(us) * time.Microsecond)
}

func (r *reader) bytes(n int, what string) []byte {
	if n < 0 || len(r.b) < n {
		r.fail(what)
		return nil
	}
	v := r.b[:n:n]
	r.b = r.b[n:]
	return v
}

func (r *reader) cstring(what string) string {
	for i, c := range r.b {
		if c == 0 {
			s := string(r.b[:i])
			r.b = r.b[i+1:]
			return s
		}
	}
	r.fail(what)
	return ""
}

func (r *reader) done(what string) error {
	if r.err != nil {
		return fmt.Errorf("decode %s: %w", what, r.err)
	}
	return nil
}

// DecodeBegin decodes a Begin message; src starts after the type byte.
func DecodeBegin(src []byte, m *Begin) error {
	r := reader{b: src}
	m.FinalLSN = r.u64("final LSN")
	m.CommitTime = r.time("commit time")
	m.XID = r.u32("xid")
	return r.done("Begin")
}

// DecodeCommit decodes a Commit message; src starts after the type byte.
func DecodeCommit(src []byte, m *Commit) error {
	r := reader{b: src}
	m.Flags = r.u8("flags")
	m.CommitLSN = r.u64("commit LSN")
	m.EndLSN = r.u64("end LSN")
	m.CommitTime = r.time("commit time")
	return r.done("Commit")
}

// maxColumns bounds a column count read from the wire before allocating:
// PostgreSQL tables have at most 1,600 columns.
const maxColumns = 1600

// DecodeRelation decodes a Relation message; src starts after the type byte.
func DecodeRelation(src []byte, m *Relation) error {
	r := reader{b: src}
	m.ID = r.u32("relation id")
	m.Namespace = r.cstring("namespace")
	m.Name = r.cstring("relation name")
	m.ReplicaIdentity = r.u8("replica identity")
	n := int(r.u16("column count"))
	if n > maxColumns {
		return fmt.Errorf("decode Relation: %w: %d columns", ErrMalformed, n)
	}
	m.Columns = make([]RelationColumn, 0, n)
	for i := 0; i < n && r.err == nil; i++ {
		var c RelationColumn
		c.Flags = r.u8("column flags")
		c.Name = r.cstring("column name")
		c.TypeOID = r.u32("column type")
		c.TypeMod = int32(r.u32("column type modifier"))
		m.Columns = append(m.Columns, c)
	}
	return r.done("Relation")
}

// DecodeInsert decodes an Insert message; src starts after the type byte.
// Column data aliases src.
func DecodeInsert(src []byte, m *Insert) error {
	r := reader{b: src}
	m.RelationID = r.u32("relation id")
	if t := r.u8("tuple type"); r.err == nil && t != 'N' {
		return fmt.Errorf("decode Insert: %w: tuple type %q, want 'N'", ErrMalformed, t)
	}
	cols, err := decodeTuple(&r, m.Columns[:0])
	m.Columns = cols
	if err != nil {
		return fmt.Errorf("decode Insert: %w", err)
	}
	return r.done("Insert")
}

func decodeTuple(r *reader, cols []Column) ([]Column, error) {
	n := int(r.u16("tuple column count"))
	if n > maxColumns {
		return cols, fmt.Errorf("%w: %d tuple columns", ErrMalformed, n)
	}
	for i := 0; i < n && r.err == nil; i++ {
		c := Column{Kind: r.u8("column kind")}
		switch c.Kind {
		case KindNull, KindUnchanged:
		case KindText, KindBinary:
			l := r.u32("column length")
			c.Data = r.bytes(int(l), "column data")
		default:
			if r.err == nil {
				return cols, fmt.Errorf("%w: column kind %q", ErrMalformed, c.Kind)
			}
		}
		cols = append(cols, c)
	}
	return cols, r.err
}

// DecodeMessage decodes a logical decoding message; src starts after the
// type byte. Content aliases src.
func DecodeMessage(src []byte, m *Message) error {
	r := reader{b: src}
	m.Transactional = r.u8("flags")&1 == 1
	m.LSN = r.u64("message LSN")
	m.Prefix = r.cstring("prefix")
	l := r.u32("content length")
	m.Content = r.bytes(int(l), "content")
	return r.done("Message")
}

// DecodeTruncate decodes a Truncate message; src starts after the type byte.
func DecodeTruncate(src []byte, m *Truncate) error {
	r := reader{b: src}
	n := r.u32("relation count")
	m.Options = r.u8("options")
	if r.err == nil && int64(n)*4 > int64(len(r.b)) {
		return fmt.Errorf("decode Truncate: %w: %d relations in %d bytes", ErrMalformed, n, len(r.b))
	}
	m.RelationIDs = m.RelationIDs[:0]
	for i := uint32(0); i < n && r.err == nil; i++ {
		m.RelationIDs = append(m.RelationIDs, r.u32("relation id"))
	}
	return r.done("Truncate")
}
