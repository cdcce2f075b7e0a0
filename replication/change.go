package replication

import (
	"time"

	"github.com/jackc/pglogrepl"
)

// LSN is a PostgreSQL WAL position.
type LSN = pglogrepl.LSN

// Relation describes a table as the publication sent it in a Relation
// message. A new *Relation replaces the old one whenever the table's shape
// changes (ALTER TABLE), so a consumer may cache per-relation plans keyed by
// the pointer.
type Relation struct {
	ID        uint32
	Namespace string
	Name      string
	Columns   []Column
}

// QualifiedName returns "schema.table".
func (r *Relation) QualifiedName() string { return r.Namespace + "." + r.Name }

// ColumnIndex returns the position of the column named name, or -1.
func (r *Relation) ColumnIndex(name string) int {
	for i, c := range r.Columns {
		if c.Name == name {
			return i
		}
	}
	return -1
}

// Column is one column of a Relation.
type Column struct {
	Name    string
	TypeOID uint32
}

// ValueKind says how a tuple column was sent.
type ValueKind uint8

// Kinds of tuple values, as pgoutput marks them.
const (
	// ValueNull is SQL NULL.
	ValueNull ValueKind = iota
	// ValueText is the column's text output, in Data.
	ValueText
	// ValueUnchanged is an unchanged TOASTed value; pgoutput never sends it
	// for an INSERT, but the decoder accepts it.
	ValueUnchanged
	// ValueBinary is the column's binary send format, in Data.
	ValueBinary
)

// Value is one column of a decoded tuple. Data is only valid until the next
// call to Stream.Next: copy what must outlive it.
type Value struct {
	Kind ValueKind
	Data []byte
}

// Insert is a row inserted into a published table.
type Insert struct {
	Relation *Relation
	// Values has one entry per Relation column, in column order.
	Values []Value
	// LSN is the WAL position of the change. It is stable across replays
	// but not unique: COPY writes many tuples in one WAL record
	// (heap_multi_insert), and they all carry that record's LSN.
	LSN LSN
	// Ordinal is the row's position among the changes of its transaction
	// that share LSN, 0 for the first. pgoutput sends a multi-insert
	// record's tuples in the same order every time the WAL is decoded, so
	// LSN and Ordinal together identify the row across replays.
	Ordinal uint32
	// Tx is the transaction the row belongs to.
	Tx *Begin
}

// Begin opens a transaction. Its rows and messages follow, then Commit.
type Begin struct {
	XID        uint32
	FinalLSN   LSN // the commit record's LSN
	CommitTime time.Time
}

// Commit closes the transaction opened by the last Begin.
type Commit struct {
	// CommitLSN is the LSN of the commit record.
	CommitLSN LSN
	// EndLSN is the end of the commit record: once every message of this
	// transaction and of all earlier ones is acknowledged, confirming EndLSN
	// tells PostgreSQL never to send the transaction again.
	EndLSN     LSN
	CommitTime time.Time
}

// Message is a logical decoding message written with
// pg_logical_emit_message (pgoutput's "messages" option).
type Message struct {
	Transactional bool
	Prefix        string
	Content       []byte
	LSN           LSN
	// Tx is the enclosing transaction of a transactional message, else nil.
	Tx *Begin
}

// Wake is what Next returns when the time set with Stream.WakeAt has come
// and nothing was received before it: the caller's chance to finish what
// waits on time (the relay's batch spans) while the outbox is quiet.
type Wake struct{}

// Truncate reports a TRUNCATE of published tables; the relay ignores it,
// since truncating an outbox removes rows, it does not create events.
type Truncate struct {
	Relations []*Relation
}
